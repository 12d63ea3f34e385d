"""vLLM sampler for GPU machines: ``vllm.LLM`` → Rollout with the log-probs of the distribution sampled from.

μ (docs/spec.md §8) is what vLLM calls ``processed_logprobs``: the engine is built with
``logprobs_mode="processed_logprobs"``, which vLLM documents as "the values after applying all processors,
including temperature and top_k/top_p" (``ModelConfig.logprobs_mode`` in ``vllm/config/model.py``), and each
request asks for ``logprobs=0`` (the sampled token's log-prob only). vLLM does not report the mass top-k /
top-p kept, so ``log_kept_mass`` is None unless nothing is truncated (then it is 0) — see docs/vllm.md.

Weight updates go through vLLM's worker-extension RPC: the engine is built with
``worker_extension_cls="rollcorr.engines.vllm.RollcorrWorkerExtension"`` and ``load_weights`` calls
``llm.collective_rpc("rollcorr_load_weights", args=(named_tensors,))``, which runs
``worker.model_runner.model.load_weights(weights=...)`` in every worker (the pattern of vLLM's
``examples/offline_inference/rlhf_utils.py``).

vLLM is imported lazily: importing this module never needs it; constructing a ``VLLMSampler`` without it
raises ``RuntimeError``. ``vllm_outputs_to_rollout`` is a pure function on objects shaped like vLLM's
``RequestOutput`` and is tested on CPU.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rollcorr.engines.base import SamplingParams
from rollcorr.rollout import Rollout

WORKER_EXTENSION = "rollcorr.engines.vllm.RollcorrWorkerExtension"
INSTALL_HINT = "vLLM is not installed; pip install rollcorr[vllm] on a GPU machine"


def import_vllm():
    """``import vllm`` or RuntimeError with the install hint."""
    try:
        import vllm
    except ImportError as err:
        raise RuntimeError(INSTALL_HINT) from err
    return vllm


class RollcorrWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); methods are reached by ``collective_rpc``."""

    def rollcorr_load_weights(self, weights: list[tuple[str, Tensor]]) -> int:
        """Load HF-named tensors into the worker's model (vLLM shards / fuses them itself)."""
        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        return len(weights)


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


def vllm_outputs_to_rollout(
    outputs: Sequence[Any],
    *,
    version: int,
    pad_token_id: int,
    greedy: bool = False,
    truncated: bool = False,
    group_ids: Sequence[int] | Tensor | None = None,
    meta: Sequence[Mapping[str, Any]] | None = None,
) -> Rollout:
    """Convert ``LLM.generate`` results (one ``RequestOutput`` per prompt, n completions each) to a Rollout.

    Reads ``output.prompt_token_ids`` and, per completion, ``token_ids``, ``logprobs`` (with the sampled
    token in each step's dict), ``finish_reason`` ("stop" / "length", None if unfinished) and ``text``.
    Rows are prompt-major: the n completions of prompt i are rows i·n … i·n+n−1 and share group id i
    (or ``group_ids[i]``); ``meta[i]`` is copied to each of them with ``finished`` / ``finish_reason``.

    greedy     temperature 0: μ is a point mass, so rollout_log_prob = 0 and vLLM's value (the untempered
               log p of the argmax) becomes log_kept_mass, as ``process_logits`` defines it
    truncated  top-k / top-p was on: vLLM's processed log-prob is already renormalised over the kept set
               but the kept mass is unknown → log_kept_mass is None; without truncation it is 0
    """
    if not outputs:
        raise ValueError("no vLLM outputs to convert")
    if group_ids is not None and len(group_ids) != len(outputs):
        raise ValueError(f"{len(group_ids)} group ids for {len(outputs)} prompts")
    if meta is not None and len(meta) != len(outputs):
        raise ValueError(f"{len(meta)} meta entries for {len(outputs)} prompts")
    prompts, responses, log_probs, groups, metas = [], [], [], [], []
    for i, request in enumerate(outputs):
        prompt = list(request.prompt_token_ids or [])
        if not prompt:
            raise ValueError(f"vLLM output {i} has no prompt_token_ids")
        if not request.outputs:
            raise ValueError(f"vLLM output {i} has no completions")
        for completion in request.outputs:
            tokens = list(completion.token_ids)
            prompts.append(prompt)
            responses.append(tokens)
            log_probs.append(sampled_log_probs(tokens, completion.logprobs))
            groups.append(int(group_ids[i]) if group_ids is not None else i)
            reason = getattr(completion, "finish_reason", None)
            item = dict(meta[i]) if meta is not None else {}
            item.update(finished=reason is not None, finish_reason=reason)
            if getattr(completion, "text", None) is not None:
                item["response_text"] = completion.text
            metas.append(item)

    b = len(responses)
    p = max(len(x) for x in prompts)
    t = max(1, max(len(x) for x in responses))
    prompt_ids = torch.full((b, p), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((b, p), dtype=torch.bool)
    response_ids = torch.full((b, t), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((b, t), dtype=torch.bool)
    vllm_lp = torch.zeros((b, t), dtype=torch.float32)
    for row, (prompt, tokens, lps) in enumerate(zip(prompts, responses, log_probs)):
        prompt_ids[row, p - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[row, p - len(prompt) :] = True
        if tokens:
            response_ids[row, : len(tokens)] = torch.tensor(tokens)
            response_mask[row, : len(tokens)] = True
            vllm_lp[row, : len(tokens)] = torch.tensor(lps)
    if not torch.isfinite(vllm_lp).all():
        raise ValueError("vLLM returned a non-finite log-prob for a sampled token")

    if greedy:
        rollout_log_prob, log_kept_mass = torch.zeros_like(vllm_lp), vllm_lp
    else:
        rollout_log_prob = vllm_lp
        log_kept_mass = None if truncated else torch.zeros_like(vllm_lp)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        rollout_log_prob=rollout_log_prob,
        log_kept_mass=log_kept_mass,
        version=torch.where(response_mask, version, 0).long(),
        group_ids=torch.tensor(groups, dtype=torch.long),
        meta=metas,
    )


class VLLMSampler:
    """A ``Sampler`` backed by an in-process ``vllm.LLM`` (GPU).

    model_path  local HF model directory (weights, config, tokenizer)
    dtype       vLLM's ``dtype`` ("bfloat16", "float16", "float32", "auto")
    seed        engine seed; per-request seeds come from ``SamplingParams.seed``
    llm_kwargs  passed to ``vllm.LLM`` (e.g. ``gpu_memory_utilization``, ``tensor_parallel_size``)
    """

    def __init__(self, model_path: str | Path, dtype: str = "bfloat16", *, seed: int = 0, **llm_kwargs: Any):
        vllm = import_vllm()
        self._vllm = vllm
        for fixed in ("logprobs_mode", "worker_extension_cls", "model", "dtype"):
            if fixed in llm_kwargs:
                raise ValueError(f"VLLMSampler sets {fixed!r} itself; do not pass it")
        self.llm = vllm.LLM(
            model=str(model_path),
            dtype=dtype,
            seed=seed,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            **llm_kwargs,
        )
        self.tokenizer = self.llm.get_tokenizer()
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self.version = 0

    def _prompt_ids(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        if not prompts:
            raise ValueError("no prompts given")
        if all(isinstance(x, str) for x in prompts):
            return [self.tokenizer.encode(x, add_special_tokens=False) for x in prompts]
        if all(isinstance(x, list | tuple) and all(isinstance(t, int) for t in x) for x in prompts):
            return [list(x) for x in prompts]
        raise TypeError("prompts must be all strings or all lists of token ids")

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams,
        *,
        n: int = 1,
        meta: list[dict[str, Any]] | None = None,
        group_ids: list[int] | Tensor | None = None,
        resume: Rollout | None = None,
        max_steps: int | None = None,
    ) -> Rollout:
        """n responses per prompt (consecutive rows, one group id per prompt), log μ from vLLM."""
        if resume is not None or max_steps is not None:
            raise NotImplementedError(
                "VLLMSampler does not do partial rollouts (max_steps / resume); use the hf or llamacpp sampler "
                "for interrupt-and-resume, or vLLM's AsyncLLM abort / resume in your own loop"
            )
        if n < 1:
            raise ValueError(f"n must be ≥ 1, got {n}")
        ids = self._prompt_ids(prompts)
        request = self._vllm.SamplingParams(
            n=n,
            temperature=params.temperature,
            top_k=params.top_k,  # 0 = off in vLLM ≥ 0.10 as in rollcorr
            top_p=params.top_p,
            seed=params.seed,
            max_tokens=params.max_new_tokens,
            logprobs=0,
        )
        outputs = self.llm.generate([{"prompt_token_ids": x} for x in ids], request, use_tqdm=False)
        return vllm_outputs_to_rollout(
            outputs,
            version=self.version,
            pad_token_id=self.pad_token_id,
            greedy=params.greedy,
            truncated=params.top_k > 0 or params.top_p < 1.0,
            group_ids=group_ids,
            meta=meta,
        )

    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> int:
        """Push HF-named weights into every worker, drop cached prefixes, and take ``version``."""
        weights = [(name, t.detach()) for name, t in state_dict.items()]
        self.llm.collective_rpc("rollcorr_load_weights", args=(weights,))
        self.llm.reset_prefix_cache()
        self.version = int(version)
        return self.version

    def close(self) -> None:
        self.llm = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
