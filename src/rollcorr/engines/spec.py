"""Engine specs (``backend[:option[:option]]``) and the registry of sampler backends added from outside.

Parsing a spec loads nothing, so ``rollcorr.engines.preflight`` and the trainer's checks read it before any
backend is imported; ``rollcorr.engines`` builds the engines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rollcorr.engines.base import Sampler

BACKENDS = ("hf", "llamacpp", "vllm")
HF_DTYPES = ("fp32", "bf16", "fp16", "int8")
HF_RTN = tuple(f"rtn{k}" for k in range(2, 9))  # hf:rtn<k>: k-bit round-to-nearest weights (engines/fake_quant.py)
# learners with float32 master weights computing under autocast (engines/hf.py); sampler specs refuse them
HF_AMP = ("amp-bf16", "amp-fp16")
HF_EXACT = "exact"  # hf:exact: the bitwise-exact sampler / learner pair (engines/exact.py)
AMP_DTYPE = {"amp-bf16": "bf16", "amp-fp16": "fp16"}
ATTNS = ("eager", "sdpa")
VLLM_DTYPES = ("fp32", "bf16", "fp16")
VLLM_BATCH_INVARIANT = "batch-invariant"  # vllm[:dtype]:batch-invariant: vLLM's VLLM_BATCH_INVARIANT=1 (GPU builds)
LONG_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
VLLM_DEFAULT_DTYPE = "bf16"  # what a bare "vllm" spec runs: str(parse_spec("vllm")) == "vllm:bf16"


@dataclass(frozen=True)
class RegisteredSampler:
    """A sampler backend registered from outside: ``build(spec, model_path, threads=..., **kwargs)`` makes one,
    ``cls`` is its class (asked for capabilities such as ``can_resume`` before anything is built)."""

    build: Callable[..., Sampler]
    cls: type


REGISTERED: dict[str, RegisteredSampler] = {}


def register_sampler(name: str, build: Callable[..., Sampler], cls: type) -> None:
    """Make ``name`` a sampler backend: ``make_sampler("name[:option]", model_path, threads=t, **kw)`` calls
    ``build(EngineSpec(name, quant=option), model_path, threads=t, **kw)``; ``cls`` answers the trainer's
    questions (``can_resume``). ``model_path`` is None for the built-in model. Learners stay hf."""
    if not isinstance(name, str) or not name.isidentifier() or name in BACKENDS:
        raise ValueError(
            f"sampler backend name must be a new identifier (not one of {BACKENDS}), got {name!r}"
        )
    REGISTERED[name.lower()] = RegisteredSampler(build, cls)


@dataclass(frozen=True)
class EngineSpec:
    """A parsed spec: backend plus the options it understood (None = backend default)."""

    backend: str
    dtype: str | None = None
    attn: str | None = None
    quant: str | None = None
    mode: str | None = None  # vllm: "batch-invariant"

    def __str__(self) -> str:
        return ":".join([self.backend] + [o for o in (self.quant or self.dtype, self.attn, self.mode) if o])


def parse_spec(spec: str) -> EngineSpec:
    """ "hf:bf16:sdpa" → EngineSpec("hf", dtype="bf16", attn="sdpa"); ValueError naming anything unknown."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"engine spec must be a non-empty string like 'hf:bf16', got {spec!r}")
    backend, *options = spec.strip().lower().split(":")
    if backend in REGISTERED:
        if len(options) > 1:
            raise ValueError(f"{backend} takes at most one option, got {spec!r}")
        return EngineSpec(backend, quant=options[0] if options and options[0] else None)
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown engine backend {backend!r} in {spec!r}; use one of {BACKENDS + tuple(REGISTERED)}"
        )
    if backend == "llamacpp":
        if len(options) > 1:
            raise ValueError(f"llamacpp takes one option (the GGUF quantisation), got {spec!r}")
        return EngineSpec("llamacpp", quant=options[0] if options and options[0] else None)
    dtype = attn = quant = mode = None
    allowed_dtypes = HF_DTYPES + HF_AMP + (HF_EXACT,) if backend == "hf" else VLLM_DTYPES
    for opt in options:
        if (opt in allowed_dtypes or (backend == "hf" and opt in HF_RTN)) and dtype is None and quant is None:
            if opt == "int8" or opt in HF_RTN:
                quant, dtype = opt, "fp32"
            else:
                dtype = opt
        elif backend == "hf" and opt in ATTNS and attn is None:
            attn = opt
        elif backend == "vllm" and opt == VLLM_BATCH_INVARIANT and mode is None:
            mode = opt
        else:
            known = allowed_dtypes + ((HF_RTN[0] + "…" + HF_RTN[-1][3:], *ATTNS) if backend == "hf" else (VLLM_BATCH_INVARIANT,))
            raise ValueError(
                f"unknown or repeated option {opt!r} in engine spec {spec!r}; {backend} accepts {known}"
            )
    if backend == "hf":
        return EngineSpec("hf", dtype=dtype or "fp32", attn=attn or "eager", quant=quant)
    return EngineSpec("vllm", dtype=dtype or VLLM_DEFAULT_DTYPE, mode=mode)


def parse_learner_spec(spec: str) -> EngineSpec:
    """``parse_spec`` plus the learner's rule: hf with float weights (int8 and rtn<k> are for samplers);
    ValueError else."""
    parsed = parse_spec(spec)
    if parsed.backend != "hf":
        raise ValueError(f"learners exist for the hf backend only, got {spec!r}")
    if parsed.quant is not None:
        raise ValueError(f"{spec!r}: {parsed.quant} quantisation is for samplers; a learner trains float weights "
                         "(use hf or hf:bf16)")  # fmt: skip
    return parsed


def check_sampler_spec(parsed: EngineSpec) -> None:
    """ValueError for a learner-only spec given as a sampler (hf:amp-*: a sampler computes in one dtype)."""
    if parsed.backend == "hf" and parsed.dtype in HF_AMP:
        raise ValueError(f"hf:{parsed.dtype} is a learner (float32 master weights, {AMP_DTYPE[parsed.dtype]} "
                         f"compute under autocast); as a sampler use hf:{AMP_DTYPE[parsed.dtype]}")  # fmt: skip
