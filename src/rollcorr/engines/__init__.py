"""Engines: samplers and learners built from spec strings.

Spec grammar ``backend[:option[:option]]``, options in any order:

    hf[:fp32|bf16|fp16|int8][:eager|sdpa]     transformers (default fp32, eager)
    llamacpp[:<quant>]                        llama.cpp via GGUF, e.g. llamacpp:q8_0 (rollcorr.engines.llamacpp)
    vllm[:fp32|bf16|fp16]                     vLLM (rollcorr.engines.vllm; default bf16)

Learners are ``hf`` only. The llamacpp and vllm backends are imported only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollcorr.engines.base import Learner, Sampler, SamplingParams, process_logits
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
]

BACKENDS = ("hf", "llamacpp", "vllm")
HF_DTYPES = ("fp32", "bf16", "fp16", "int8")
ATTNS = ("eager", "sdpa")
VLLM_DTYPES = ("fp32", "bf16", "fp16")
LONG_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
VLLM_DEFAULT_DTYPE = "bf16"  # what a bare "vllm" spec runs: str(parse_spec("vllm")) == "vllm:bf16"


@dataclass(frozen=True)
class EngineSpec:
    """A parsed spec: backend plus the options it understood (None = backend default)."""

    backend: str
    dtype: str | None = None
    attn: str | None = None
    quant: str | None = None

    def __str__(self) -> str:
        return ":".join([self.backend] + [o for o in (self.quant or self.dtype, self.attn) if o])


def parse_spec(spec: str) -> EngineSpec:
    """ "hf:bf16:sdpa" → EngineSpec("hf", dtype="bf16", attn="sdpa"); ValueError naming anything unknown."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"engine spec must be a non-empty string like 'hf:bf16', got {spec!r}")
    backend, *options = spec.strip().lower().split(":")
    if backend not in BACKENDS:
        raise ValueError(f"unknown engine backend {backend!r} in {spec!r}; use one of {BACKENDS}")
    if backend == "llamacpp":
        if len(options) > 1:
            raise ValueError(f"llamacpp takes one option (the GGUF quantisation), got {spec!r}")
        return EngineSpec("llamacpp", quant=options[0] if options and options[0] else None)
    dtype = attn = quant = None
    allowed_dtypes = HF_DTYPES if backend == "hf" else VLLM_DTYPES
    for opt in options:
        if opt in allowed_dtypes and dtype is None and quant is None:
            if opt == "int8":
                quant, dtype = "int8", "fp32"
            else:
                dtype = opt
        elif backend == "hf" and opt in ATTNS and attn is None:
            attn = opt
        else:
            known = allowed_dtypes + (ATTNS if backend == "hf" else ())
            raise ValueError(
                f"unknown or repeated option {opt!r} in engine spec {spec!r}; {backend} accepts {known}"
            )
    if backend == "hf":
        return EngineSpec("hf", dtype=dtype or "fp32", attn=attn or "eager", quant=quant)
    return EngineSpec("vllm", dtype=dtype or VLLM_DEFAULT_DTYPE)


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
    path = _check_model_path(model_path)
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
    return VLLMSampler(builtin_path(path), **kwargs)


def make_learner(spec: str = "hf", model_path: str | Path | None = None, **kwargs: Any) -> Learner:
    """A learner for ``spec`` ("hf", "hf:bf16", ...; int8 is sampler-only) on ``model_path``."""
    from rollcorr.engines.preflight import check_spec

    parsed = check_spec(spec, role="learner")  # hf with float weights (PreflightError is a ValueError)
    path = _check_model_path(model_path)
    from rollcorr.engines.hf import HFLearner

    return HFLearner(path, dtype=parsed.dtype, attn=parsed.attn, **kwargs)
