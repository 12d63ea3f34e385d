"""Engines: samplers and learners built from spec strings ``backend[:option[:option]]``.

    hf[:fp32|bf16|fp16|int8|rtn<k>|amp-*|exact][:eager|sdpa]   transformers (engines/hf.py; samplers and learners)
    llamacpp[:f32|f16|q8_0|q4_0|file]                            llama.cpp on a GGUF (engines/llamacpp.py)
    vllm[:fp32|bf16|fp16][:batch-invariant]                      vLLM (engines/vllm.py; default bf16)

Each backend is a ``Backend`` (``engines/spec.py``: its grammar, refusals, engines and capabilities) in the one
registry ``BACKENDS``. The three above register themselves when this package imports their modules, through
``register_backend`` — the door a backend from outside the package uses too (``register_sampler(name, build,
cls)`` is the short form for a sampler alone). ``make_sampler`` / ``make_learner`` / ``sampler_class`` ask the
spec's backend; their modules import nothing heavy (transformers' models, llama_cpp and vllm load when an engine
is built).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollcorr.engines import hf, llamacpp, vllm  # noqa: F401  (each registers its backend)
from rollcorr.engines.base import Learner, Sampler, SamplingParams, process_logits
from rollcorr.engines.spec import (
    BACKENDS,
    Backend,
    EngineSpec,
    backend_of,
    check_role,
    parse_spec,
    register_backend,
    register_sampler,
)
from rollcorr.models.builtin import builtin_path, is_builtin, model_location

__all__ = [
    "BACKENDS",
    "Backend",
    "EngineSpec",
    "Learner",
    "Sampler",
    "SamplingParams",
    "backend_of",
    "make_learner",
    "make_sampler",
    "parse_spec",
    "process_logits",
    "register_backend",
    "register_sampler",
    "sampler_class",
]


def sampler_class(spec: str) -> type:
    """The class ``make_sampler(spec)`` builds, without building it (nor loading any engine)."""
    parsed = parse_spec(spec)
    return BACKENDS[parsed.backend].sampler_class(parsed)


def _check_model_path(model_path: str | Path | None) -> str | Path:
    """``model_location``'s reading (None → "builtin"; a built-in spelling as it is), else an existing path."""
    if is_builtin(model_path):
        return model_location(model_path)
    if not Path(builtin_path(model_path)).exists():  # builtin_path: ValueError for an unknown "builtin:<x>"
        raise FileNotFoundError(f"model path {str(model_path)!r} does not exist")
    return model_path


def make_sampler(
    spec: str, model_path: str | Path | None = None, *, threads: int = 0, **kwargs: Any
) -> Sampler:
    """A sampler for ``spec`` on ``model_path`` (None = the built-in model). Extra kwargs go to the backend.

    ``threads`` > 0: CPU threads for a backend with its own thread pool (llama.cpp's ``n_threads``); hf
    samplers run in torch's pool, which the process sets (``torch.set_num_threads``). The spec (and the
    backend's refusals) and the path are checked before anything is loaded.
    """
    parsed = check_role(spec, "sampler")
    path = _check_model_path(model_path)
    return BACKENDS[parsed.backend].make_sampler(parsed, path, threads=threads, **kwargs)


def make_learner(spec: str = "hf", model_path: str | Path | None = None, **kwargs: Any) -> Learner:
    """A learner for ``spec`` ("hf", "hf:bf16", ...; int8 is sampler-only) on ``model_path``."""
    parsed = check_role(spec, "learner")
    path = _check_model_path(model_path)
    return BACKENDS[parsed.backend].make_learner(parsed, path, **kwargs)
