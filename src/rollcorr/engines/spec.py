"""Engine specs (``backend[:option[:option]]``) and the one registry of backends: the door every engine comes in by.

A backend is a ``Backend``. It owns its spec grammar, its refusals, how its sampler (and learner) is built, and
the answers to every question the apps ask about an engine — as class attributes with defaults, so no code
outside a backend's own module compares backend names. The built-in backends hf (``engines/hf.py``), llamacpp
(``engines/llamacpp.py``) and vllm (``engines/vllm.py``) register themselves with ``register_backend`` when their
module is imported (``rollcorr.engines`` imports them), exactly as a backend from outside the package does; those
modules import nothing heavy, so parsing and checking a spec loads nothing (transformers' models, ``llama_cpp``
and ``vllm`` load when an engine is built). The hooks, in the order they are called, with their defaults::

    backend = backend_of(spec)                              # BACKENDS[name]; ValueError naming an unknown one
    parsed = backend.parse(spec, options)                   # → EngineSpec (default: at most one option → quant)
    backend.check_spec(parsed, spec, role)                  # refusals before anything loads (default: no learner)
    backend.check_model(parsed, spec, model_path, gguf_file)    # after the model folder's own checks (default: none)
    backend.sampler_class(parsed)                           # what make_sampler builds (``can_resume``), unbuilt
    backend.make_sampler(parsed, model_path, threads=t, **kwargs)
    backend.make_learner(parsed, model_path, **kwargs)      # default: refuses, as ``check_spec`` does
    backend.check_trainable(parsed, spec)                   # a learner that cannot take optimizer steps (none)
    backend.with_dtype(parsed, dtype)                       # the same sampler in another dtype (``precisions``)
    backend.audit_kwargs(parsed, rows=, tokens=, gguf_file=)    # extra make_sampler kwargs an audit needs ({})
    backend.no_kept_mass(parsed)                            # why its sampler reports no top-k/top-p kept mass (None)
    backend.no_kept_ids(parsed)                             # why its sampler cannot record its kept sets (None)
    backend.shown(parsed, spec)                             # the spec as reports name it (as the user wrote it)

Every hook raises ``ValueError`` with one line naming the problem; ``preflight`` turns those of ``check_spec`` and
``check_model`` into ``PreflightError(field="spec")``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollcorr.engines.base import Learner, Sampler
from rollcorr.models.builtin import BUILTIN

ROLES = ("sampler", "learner")
FLOAT_DTYPES = ("fp32", "bf16", "fp16")  # the dtype names specs use (``--whatif fp16`` etc.)
LONG_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class EngineSpec:
    """A parsed spec: backend plus the options it understood (None = backend default). A backend with one
    option of its own keeps it in ``quant``."""

    backend: str
    dtype: str | None = None
    attn: str | None = None
    quant: str | None = None
    mode: str | None = None  # vllm: "batch-invariant"

    def __str__(self) -> str:
        return ":".join([self.backend] + [o for o in (self.quant or self.dtype, self.attn, self.mode) if o])


class Backend:
    """An engine backend: every hook has a default, every question is a class attribute with a default.

    Class attributes (the questions the apps ask):
      name              the spec's first field (a lowercase identifier)
      builds_learner    ``make_learner`` builds a learner (``model.learner`` / ``--learner`` may name it)
      in_process        the sampler is torch modules in this process (``sampler.model``, placed with ``device=``):
                        ``rollcorr audit --localize`` hooks them, ``--whatif lm_head_fp32`` builds one with
                        ``head_fp32=True``, ``--whatif batch`` reruns its forward; ``model.device`` reaches it
      captures_routing  the sampler records a mixture of experts' routing (``model.routing_replay=r3``)
      precisions        the dtypes (of ``FLOAT_DTYPES``) ``with_dtype`` can switch its sampler to
      extra             the pyproject extra its engines need (a key of ``preflight.EXTRAS``), or None
    """

    name: str = "base"
    builds_learner: bool = False
    in_process: bool = False
    captures_routing: bool = False
    precisions: tuple[str, ...] = ()
    extra: str | None = None

    @property
    def module(self) -> str:
        """The module whose import registers this backend: a sampler built in a fresh interpreter
        (``trainer.mode=async``'s sampler process, Ray workers) imports it there first. Default: the class's."""
        return type(self).__module__

    # ---- the spec ---------------------------------------------------------------------------------------
    def parse(self, spec: str, options: list[str]) -> EngineSpec:
        """``options``: the lowercased fields after the name. Default: at most one, kept in ``quant``."""
        if len(options) > 1:
            raise ValueError(f"{self.name} takes at most one option, got {spec!r}")
        return EngineSpec(self.name, quant=options[0] if options and options[0] else None)

    def check_spec(self, parsed: EngineSpec, spec: str, role: str) -> None:
        """What this backend refuses for ``role`` ("sampler" or "learner") before anything loads. Default: a
        learner unless ``builds_learner``."""
        if role == "learner" and not self.builds_learner:
            raise ValueError(f"{learners_exist()}, got {spec!r}")

    def check_model(self, parsed: EngineSpec, spec: str, model_path: str | Path | None, gguf_file: str | None) -> None:
        """Checks of the model this backend needs beyond a loadable folder (read small files only); default none."""

    def check_trainable(self, parsed: EngineSpec, spec: str) -> None:
        """ValueError when this learner cannot take optimizer steps (checked by ``rollcorr train``); default none."""

    def can_shard(self, parsed: EngineSpec) -> bool:
        """Whether this learner may be sharded by FSDP2 (``trainer.data_parallel=shard``); default yes."""
        return True

    # ---- the engines ------------------------------------------------------------------------------------
    def sampler_class(self, parsed: EngineSpec) -> type:
        """The class ``make_sampler`` builds, without building it (the trainer asks it ``can_resume``)."""
        raise NotImplementedError(f"{type(self).__name__}.sampler_class")

    def make_sampler(self, parsed: EngineSpec, model_path: str | Path, *, threads: int = 0, **kwargs: Any) -> Sampler:
        """A sampler on ``model_path`` ("builtin", "builtin:<name>" or an existing folder). ``threads`` > 0: CPU
        threads for an engine with its own pool; extra kwargs are the engine's own."""
        raise NotImplementedError(f"{type(self).__name__}.make_sampler")

    def make_learner(self, parsed: EngineSpec, model_path: str | Path, **kwargs: Any) -> Learner:
        """A learner on ``model_path``; default: refuses."""
        raise ValueError(f"{learners_exist()}, got {str(parsed)!r}")

    # ---- what the audit asks ----------------------------------------------------------------------------
    def with_dtype(self, parsed: EngineSpec, dtype: str) -> str:
        """The spec of the same sampler computing in ``dtype`` (``rollcorr audit --whatif fp16``); ValueError when it
        cannot. Default: ``name:dtype`` for a dtype of ``precisions``."""
        if dtype not in self.precisions:
            raise ValueError(f"{self.name} samplers take no dtype option ({dtype} is not one they compute in)")
        return f"{self.name}:{dtype}"

    def audit_kwargs(self, parsed: EngineSpec, *, rows: int, tokens: int, gguf_file: str | None) -> dict[str, Any]:
        """Extra ``make_sampler`` kwargs for an audit that samples ``rows`` sequences at a time, ``tokens`` long at
        most (prompt + response), of a model given as ``gguf_file`` (a path, or None). Default: none."""
        return {}

    def shown(self, parsed: EngineSpec, spec: str) -> str:
        """The spec as reports and the terminal name it; default: as the user wrote it."""
        return spec

    def no_truncation(self, parsed: EngineSpec) -> str | None:
        """Why this sampler cannot sample with top-k / top-p, or None (default) when it can."""
        return None

    def no_kept_mass(self, parsed: EngineSpec) -> str | None:
        """Why this sampler cannot report the probability mass top-k / top-p kept (``Rollout.log_kept_mass``),
        which a comparison with its distribution before truncation needs; None (default) when it reports it."""
        return None

    def no_kept_ids(self, parsed: EngineSpec) -> str | None:
        """Why this sampler cannot record the token ids top-k / top-p kept at each step (``Rollout.kept_ids``,
        ``SamplingParams.record_kept_ids``), which the keep mask needs; None (default) when it records them."""
        return None


def check_truncation(spec: str, top_k: int, top_p: float, keys: tuple[str, str]) -> None:
    """ValueError (one line, naming the key of ``keys`` = (top-k's, top-p's) that asks for it) when top-k / top-p
    sampling meets a sampler that cannot do it (``Backend.no_truncation``), before anything loads."""
    reason = backend_of(spec).no_truncation(parse_spec(spec)) if top_k or top_p < 1.0 else None
    if reason is not None:
        key, value = (keys[0], top_k) if top_k else (keys[1], top_p)
        raise ValueError(f"{key}: {value} asks {spec} to truncate its distribution, and {reason}; sample with "
                         "top_k 0 and top_p 1.0, or use another sampler")


def check_kept_mass(spec: str, truncated: bool, needs_full: bool, key: str) -> None:
    """ValueError (one line, naming ``key``) when a comparison with the sampler's distribution before top-k /
    top-p (``needs_full``) meets truncated sampling on a sampler that does not report the mass it kept."""
    if not (truncated and needs_full):
        return
    reason = backend_of(spec).no_kept_mass(parse_spec(spec))
    if reason is not None:
        raise ValueError(f"{key}: comparing with {spec}'s distribution before top-k/top-p needs the probability "
                         f"mass they kept, and {reason}; compare with the distribution it drew from instead, or "
                         "sample without top-k/top-p")


def check_kept_ids(spec: str, records: bool, key: str, instead: str) -> None:
    """ValueError (one line, naming ``key``) when the keep mask (``records``: the sampler is asked for its kept sets
    under top-k / top-p) meets a sampler that cannot record them; ``instead``: the setting that does without."""
    if not records:
        return
    reason = backend_of(spec).no_kept_ids(parse_spec(spec))
    if reason is not None:
        raise ValueError(f"{key}: the keep mask replays {spec}'s top-k/top-p kept sets in the learner, and {reason}; "
                         f"sample without top-k/top-p, or use an hf or llamacpp sampler, or {instead}")


# ---- the registry -----------------------------------------------------------------------------------------

BACKENDS: dict[str, Backend] = {}  # name -> backend, in registration order (hf, llamacpp, vllm, then outside ones)


def register_backend(backend: Backend) -> Backend:
    """Make ``backend`` the engine of specs ``<backend.name>[:...]``: parsing, preflight, ``make_sampler`` /
    ``make_learner``, ``rollcorr train`` and ``rollcorr audit`` then know it. Returns it."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend needs a Backend instance, got {backend!r}")
    name = backend.name
    if not isinstance(name, str) or not name.isidentifier() or name != name.lower() or name == Backend.name:
        raise ValueError(f"engine backend name must be a lowercase identifier, got {name!r}")
    if name in BACKENDS and BACKENDS[name] is not backend:
        raise ValueError(f"engine backend name must be a new identifier (not one of {tuple(BACKENDS)}), got {name!r}")
    BACKENDS[name] = backend
    return backend


class RegisteredSampler(Backend):
    """A sampler backend from ``register_sampler``: ``build(spec, model_path, threads=..., **kwargs)`` makes one,
    ``cls`` is its class (asked for capabilities such as ``can_resume`` before anything is built)."""

    def __init__(self, name: str, build: Callable[..., Sampler], cls: type) -> None:
        self.name, self.build, self.cls = name, build, cls

    @property
    def module(self) -> str:
        return self.build.__module__

    def sampler_class(self, parsed: EngineSpec) -> type:
        return self.cls

    def make_sampler(self, parsed: EngineSpec, model_path: str | Path, *, threads: int = 0, **kwargs: Any) -> Sampler:
        return self.build(parsed, None if model_path == BUILTIN else model_path, threads=threads, **kwargs)


def register_sampler(name: str, build: Callable[..., Sampler], cls: type) -> None:
    """Make ``name`` a sampler backend: ``make_sampler("name[:option]", model_path, threads=t, **kw)`` calls
    ``build(EngineSpec(name, quant=option), model_path, threads=t, **kw)``; ``cls`` answers the trainer's
    questions (``can_resume``). ``model_path`` is None for the built-in model. Registering a name again replaces
    an earlier ``register_sampler``; a ``Backend`` (``register_backend``) can do more: its own options and
    refusals, a learner, capabilities."""
    taken = tuple(n for n, b in BACKENDS.items() if not isinstance(b, RegisteredSampler))
    if not isinstance(name, str) or not name.isidentifier() or name.lower() in taken:
        raise ValueError(f"sampler backend name must be a new identifier (not one of {taken}), got {name!r}")
    BACKENDS.pop(name.lower(), None)
    register_backend(RegisteredSampler(name.lower(), build, cls))


def backend_of(spec: str) -> Backend:
    """The backend a spec names (its first field); ValueError for an empty or unknown one."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"engine spec must be a non-empty string like 'hf:bf16', got {spec!r}")
    name = spec.strip().lower().split(":")[0]
    if name not in BACKENDS:
        raise ValueError(f"unknown engine backend {name!r} in {spec!r}; use one of {tuple(BACKENDS)}")
    return BACKENDS[name]


def parse_spec(spec: str) -> EngineSpec:
    """ "hf:bf16:sdpa" → EngineSpec("hf", dtype="bf16", attn="sdpa"); ValueError naming anything unknown."""
    backend = backend_of(spec)
    return backend.parse(spec, spec.strip().lower().split(":")[1:])


def check_role(spec: str, role: str) -> EngineSpec:
    """``parse_spec`` plus the backend's refusals for ``role`` ("sampler" or "learner"); ValueError else."""
    if role not in ROLES:
        raise ValueError(f"role must be 'sampler' or 'learner', got {role!r}")
    parsed = parse_spec(spec)
    BACKENDS[parsed.backend].check_spec(parsed, spec, role)
    return parsed


def learners_exist() -> str:
    """ "learners exist for the hf backend only": the backends that build learners, said in one clause."""
    names = [name for name, backend in BACKENDS.items() if backend.builds_learner]
    return f"learners exist for the {', '.join(names)} backend{'s' if len(names) > 1 else ''} only"


def backends_that(question: str) -> list[str]:
    """The names of the registered backends whose class attribute ``question`` is true (for messages that say
    which engines can do something, e.g. ``backends_that("in_process")`` → ["hf"])."""
    return [name for name, backend in BACKENDS.items() if getattr(backend, question)]
