"""Engines: samplers and learners built from spec strings.

Spec grammar ``backend[:option[:option]]``, options in any order:

    hf[:fp32|bf16|fp16|int8|rtn<k>][:eager|sdpa]   transformers (default fp32, eager; rtn2 … rtn8: k-bit weights)
    llamacpp[:<quant>]                        llama.cpp via GGUF, e.g. llamacpp:q8_0 (rollcorr.engines.llamacpp)
    vllm[:fp32|bf16|fp16]                     vLLM (rollcorr.engines.vllm; default bf16)

Learners are ``hf`` only. The llamacpp and vllm backends are imported only when asked for.

Another sampler backend plugs in from outside the package with ``register_sampler(name, build, cls)``: its spec
is ``name`` or ``name:<option>`` (the option is passed to ``build``), and the trainer reads what it can do from
``cls`` (``can_resume``) before building it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollcorr.engines.base import Learner, Sampler, SamplingParams, process_logits
from rollcorr.engines.spec import (
    LONG_DTYPE,
    REGISTERED,
    EngineSpec,
    check_sampler_spec,
    parse_learner_spec,
    parse_spec,
    register_sampler,
)
from rollcorr.models.builtin import BUILTIN, builtin_path, is_builtin

__all__ = [
    "EngineSpec",
    "Learner",
    "Sampler",
    "SamplingParams",
    "make_learner",
    "make_sampler",
    "parse_spec",
    "process_logits",
    "register_sampler",
    "sampler_class",
]

def sampler_class(spec: str) -> type:
    """The class ``make_sampler(spec)`` builds, without building it (nor importing llama.cpp or vLLM)."""
    backend = parse_spec(spec).backend
    if backend in REGISTERED:
        return REGISTERED[backend].cls
    if backend == "hf":
        from rollcorr.engines.hf import HFSampler

        return HFSampler
    if backend == "llamacpp":
        from rollcorr.engines.llamacpp import LlamaCppSampler

        return LlamaCppSampler
    from rollcorr.engines.vllm import VLLMSampler

    return VLLMSampler


def _check_model_path(model_path: str | Path | None) -> str | Path:
    """None → "builtin"; a built-in spelling ("builtin:chain") stays as is; else an existing path."""
    if model_path is None:
        return BUILTIN
    if is_builtin(model_path):
        return str(model_path)
    if not Path(builtin_path(model_path)).exists():  # builtin_path: ValueError for an unknown "builtin:<x>"
        raise FileNotFoundError(f"model path {str(model_path)!r} does not exist")
    return model_path


def make_sampler(
    spec: str, model_path: str | Path | None = None, *, threads: int = 0, **kwargs: Any
) -> Sampler:
    """A sampler for ``spec`` on ``model_path`` (None = the built-in model). Extra kwargs go to the backend.

    ``threads`` > 0: CPU threads for a backend with its own thread pool (llama.cpp's ``n_threads``); hf
    samplers run in torch's pool, which the process sets (``torch.set_num_threads``). The spec and path are
    checked before anything is loaded.
    """
    parsed = parse_spec(spec)
    check_sampler_spec(parsed)
    path = _check_model_path(model_path)
    if parsed.backend in REGISTERED:
        return REGISTERED[parsed.backend].build(parsed, None if path == BUILTIN else path, threads=threads, **kwargs)
    if parsed.backend == "hf" and parsed.dtype == "exact":
        from rollcorr.engines.exact import ExactSampler

        return ExactSampler(path, **kwargs)
    if parsed.backend == "hf":
        from rollcorr.engines.hf import HFSampler

        return HFSampler(path, dtype=parsed.dtype, attn=parsed.attn, quant=parsed.quant, **kwargs)
    if parsed.backend == "llamacpp":
        from rollcorr.engines.llamacpp import LlamaCppSampler

        if parsed.quant is not None:
            kwargs["quant"] = parsed.quant
        if threads > 0:
            kwargs.setdefault("n_threads", threads)
        return LlamaCppSampler(builtin_path(path), **kwargs)
    from rollcorr.engines.vllm import VLLMSampler

    if parsed.dtype is not None:
        kwargs["dtype"] = LONG_DTYPE[parsed.dtype]
    if parsed.mode == "batch-invariant":
        kwargs["batch_invariant"] = True
    return VLLMSampler(builtin_path(path), **kwargs)


def make_learner(spec: str = "hf", model_path: str | Path | None = None, **kwargs: Any) -> Learner:
    """A learner for ``spec`` ("hf", "hf:bf16", ...; int8 is sampler-only) on ``model_path``."""
    parsed = parse_learner_spec(spec)  # hf with float weights
    path = _check_model_path(model_path)
    if parsed.dtype == "exact":
        from rollcorr.engines.exact import ExactLearner

        return ExactLearner(path, **kwargs)
    from rollcorr.engines.hf import HFLearner

    return HFLearner(path, dtype=parsed.dtype, attn=parsed.attn, **kwargs)
