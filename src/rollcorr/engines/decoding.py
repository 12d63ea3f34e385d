"""What every token-by-token sampler shares: batching prompts into rows, n responses per prompt, partial
rollouts (``max_steps`` / ``resume``), and packing the result into a ``Rollout``.

A backend subclasses ``DecodingSampler`` and supplies ``encode`` (prompts → token ids), ``_decode`` (the
decode loop: per row, the sampled tokens, their log μ under the processed distribution, the log kept mass,
and whether the row finished) and ``_check_open``; it holds ``tokenizer``, ``pad_id`` and ``version``. A
backend that records the kept sets (``SamplingParams.record_kept_ids``) hands them over through
``_take_kept_ids`` after its ``_decode``, as one that captures routing does through ``_take_routing``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from rollcorr.engines.base import SamplingParams, resume_seed
from rollcorr.rollout import Rollout


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Token lists → (ids (B, L) int64, mask (B, L) bool), left-padded."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.as_tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = True
    return ids.to(device), mask.to(device)


def right_pad(
    rows: Sequence[Sequence[float]], value: float, dtype: torch.dtype, width: int | None = None
) -> Tensor:
    width = max([len(r) for r in rows] + [0]) if width is None else width
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def pad_kept_ids(rows: Sequence[Tensor], width: int | None = None) -> Tensor:
    """Per-row kept sets (n_i, K_i) → (B, T, K) int32, −1 on padded positions and after each set's count."""
    width = max([r.shape[0] for r in rows] + [0]) if width is None else width
    kept = max([r.shape[1] for r in rows if r.numel()] + [1])
    out = torch.full((len(rows), width, kept), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        out[i, : r.shape[0], : r.shape[1]] = r
    return out


def stack_kept(sets: Sequence[Tensor]) -> Tensor:
    """One row's kept sets, one (K_t,) int32 tensor per token → (n_tokens, K) int32, −1 padded."""
    kept = max([ids.shape[0] for ids in sets] + [1])
    out = torch.full((len(sets), kept), -1, dtype=torch.int32)
    for t, ids in enumerate(sets):
        out[t, : ids.shape[0]] = ids
    return out


def kept_rows(step_ids: list[Tensor], valid: Tensor) -> list[Tensor]:
    """A decode loop's kept sets, one (B, K_s) int32 tensor per step, and ``valid`` (B, steps) → per row, the
    (n_tokens, K) kept sets of its valid steps (K: the largest of the loop)."""
    kept = max(ids.shape[1] for ids in step_ids)
    steps = torch.stack([torch.nn.functional.pad(ids, [0, kept - ids.shape[1]], value=-1) for ids in step_ids], 1)
    return [steps[i, : valid.shape[1]][valid[i]] for i in range(valid.shape[0])]


def finished_rows(rollout: Rollout) -> Tensor:
    """(B,) bool: True where the response is complete (EOS or token cap), from ``meta[i]["finished"]``.

    Rows without the flag (a Rollout not made by a partial-rollout-aware sampler) count as finished.
    """
    if not rollout.meta:
        return torch.ones(rollout.batch_size, dtype=torch.bool)
    return torch.tensor([bool(m.get("finished", True)) for m in rollout.meta], dtype=torch.bool)


def encode_prompts(tokenizer, prompts: Sequence[str] | Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Prompts (strings or token id lists) → token id lists with the tokenizer's own special-token rule (BOS
    for Llama-style models; nothing for the built-in), each checked non-empty and inside [0, vocab_size)."""
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    rows = []
    for i, p in enumerate(prompts):
        ids = [int(t) for t in (tokenizer(p)["input_ids"] if isinstance(p, str) else p)]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        rows.append(ids)
    return rows


class DecodingSampler:
    """``generate`` / ``_resume`` on top of a backend's ``_decode``; see the module docstring."""

    can_resume = True  # max_steps / resume= are implemented here, for every backend built on it
    tokenizer: Any
    pad_id: int
    version: int

    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        raise NotImplementedError

    def _check_open(self) -> None:
        raise NotImplementedError

    def _take_routing(self) -> tuple[list[Tensor], list[Tensor]] | None:
        """The last ``_decode``'s mixture-of-experts routing, per row: (context (len, L, k), response tokens
        (n, L, k)); None for an engine or model without it (the default)."""
        return None

    def _take_kept_ids(self) -> list[Tensor] | None:
        """The last ``_decode``'s kept sets, per row (n_tokens, K) int32 (−1 padded); None when it recorded
        none (the default: not asked for, nothing truncated, or an engine that cannot)."""
        return None

    def _expert_dtype(self) -> torch.dtype:
        return torch.uint8

    def _routing_fields(self, routing, width_p: int | None = None, width_t: int | None = None) -> dict:
        """``prompt_routed_experts`` (left-padded) and ``routed_experts`` (right-padded) from per-row routing."""
        if routing is None:
            return {}
        prompt_rows, response_rows = routing
        dtype = self._expert_dtype()
        width_p = width_p or max(r.shape[0] for r in prompt_rows)
        width_t = width_t if width_t is not None else max([r.shape[0] for r in response_rows] + [0])
        shape = prompt_rows[0].shape[1:]
        prompt = torch.zeros((len(prompt_rows), width_p, *shape), dtype=dtype)
        response = torch.zeros((len(response_rows), width_t, *shape), dtype=dtype)
        for i, (pr, rr) in enumerate(zip(prompt_rows, response_rows)):
            prompt[i, width_p - pr.shape[0] :] = pr.to(dtype)
            response[i, : rr.shape[0]] = rr.to(dtype)
        return {"prompt_routed_experts": prompt, "routed_experts": response}

    def _decode(
        self, contexts: list[list[int]], budgets: list[int], params: SamplingParams, max_steps: int | None
    ) -> tuple[list[list[int]], list[list[float]], list[list[float]], list[bool]]:
        raise NotImplementedError

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        n: int = 1,
        meta: list[dict[str, Any]] | None = None,
        group_ids: Sequence[int] | Tensor | None = None,
        resume: Rollout | None = None,
        max_steps: int | None = None,
    ) -> Rollout:
        """n responses per prompt (consecutive rows, same group id), or continue ``resume``'s unfinished rows.

        ``meta`` (one dict per prompt) and ``group_ids`` (one per prompt, default 0..len-1) are repeated n
        times. ``max_steps`` caps the decode steps of this call; rows stopped by it have
        ``meta[i]["finished"] = False`` and can be continued with ``generate(..., resume=rollout)`` (prompts
        are then ignored), whose new tokens carry the current ``version``.
        """
        self._check_open()
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps!r}")
        if resume is not None:
            return self._resume(resume, params, max_steps)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        rows = self.encode(prompts)
        if meta is not None and len(meta) != len(rows):
            raise ValueError(f"meta has {len(meta)} entries for {len(rows)} prompts")
        groups = (
            torch.arange(len(rows)) if group_ids is None else torch.as_tensor(group_ids, dtype=torch.long)
        )
        if tuple(groups.shape) != (len(rows),):
            raise ValueError(f"group_ids has shape {tuple(groups.shape)}, expected ({len(rows)},)")

        rows = [r for r in rows for _ in range(n)]
        tokens, log_mu, log_kept, finished = self._decode(
            rows, [params.max_new_tokens] * len(rows), params, max_steps
        )
        routing = self._routing_fields(self._take_routing())
        kept = self._take_kept_ids()
        prompt_ids, prompt_mask = left_pad(rows, self.pad_id, torch.device("cpu"))
        metas = [dict(m) for m in meta for _ in range(n)] if meta is not None else [{} for _ in rows]
        for m, tok, done in zip(metas, tokens, finished):
            m["finished"] = done
            m["response_text"] = self.tokenizer.decode(tok, skip_special_tokens=True)
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=right_pad(tokens, self.pad_id, torch.long),
            response_mask=right_pad([[1] * len(t) for t in tokens], 0, torch.bool),
            rollout_log_prob=right_pad(log_mu, 0.0, torch.float32),
            log_kept_mass=right_pad(log_kept, 0.0, torch.float32),
            kept_ids=None if kept is None else pad_kept_ids(kept, max(len(t) for t in tokens)),
            version=right_pad([[self.version] * len(t) for t in tokens], 0, torch.long),
            group_ids=groups.repeat_interleave(n),
            meta=metas,
            **routing,
        )

    def _resume(self, rollout: Rollout, params: SamplingParams, max_steps: int | None) -> Rollout:
        """Continue the unfinished rows of ``rollout`` with the current weights; finished rows untouched.

        A row's context is its prompt and every real token after it — the model's and the environment's
        (``Rollout.token_mask``), as they are: nothing is re-tokenised. ``max_new_tokens`` caps each model turn:
        the budget of a row is what its current turn has not used (all of it after an observation)."""
        done = finished_rows(rollout)
        todo = (~done).nonzero().flatten().tolist()
        if not todo:
            return rollout
        prompt_mask, valid = rollout.prompt_mask.bool(), rollout.token_mask
        old = [rollout.response_ids[i][valid[i]].tolist() for i in range(rollout.batch_size)]
        contexts = [rollout.prompt_ids[i][prompt_mask[i]].tolist() + old[i] for i in todo]
        next_turn = rollout.next_turn()
        budgets = [params.max_new_tokens - self._turn_tokens(rollout, i, next_turn[i]) for i in todo]
        if min(budgets) < 1:
            raise ValueError(
                "an unfinished row already holds max_new_tokens tokens: resume with the same params"
            )
        if rollout.rollout_log_prob is None:
            raise ValueError("cannot resume a rollout without rollout_log_prob")
        params = replace(params, seed=resume_seed(params.seed, int(valid.sum())))
        tokens, log_mu, log_kept, finished = self._decode(contexts, budgets, params, max_steps)
        routing = self._take_routing()
        kept = self._take_kept_ids()
        merged = [old[i] + (tokens[todo.index(i)] if i in todo else []) for i in range(rollout.batch_size)]
        width = max(len(r) for r in merged)

        def extend(field: Tensor | None, new_rows: list[list], value: float, dtype: torch.dtype) -> Tensor:
            """Row i: its valid old entries, then (if resumed) its new ones; right-padded to ``width``."""
            field = torch.zeros_like(rollout.version, dtype=dtype) if field is None else field
            rows = [field[i][valid[i]].tolist() for i in range(rollout.batch_size)]
            for j, i in enumerate(todo):
                rows[i] = rows[i] + list(new_rows[j])
            return right_pad(rows, value, dtype, width)

        def constant(values: list) -> list[list]:
            """Per resumed row, its value repeated over its new tokens."""
            return [[values[j]] * len(t) for j, t in enumerate(tokens)]

        routed = self._resumed_routing(rollout, routing, todo, width)
        turns = {}
        if rollout.turn is not None:  # a trajectory: the new tokens are the model's, in the turn they continue
            turns = {"observation_mask": extend(rollout.observation_mask, constant([False] * len(todo)), False,
                                                torch.bool),
                     "turn": extend(rollout.turn, constant([next_turn[i] for i in todo]), 0, torch.long)}
        kept_ids = None
        if kept is not None and rollout.kept_ids is not None:  # old tokens keep the sets they were drawn from
            rows = [rollout.kept_ids[i][valid[i]] for i in range(rollout.batch_size)]
            for j, i in enumerate(todo):
                k = max(rows[i].shape[1], kept[j].shape[1])
                rows[i] = torch.cat([torch.nn.functional.pad(part, [0, k - part.shape[1]], value=-1)
                                     for part in (rows[i], kept[j])])
            kept_ids = pad_kept_ids(rows, width)
        metas = [dict(m) for m in rollout.meta] if rollout.meta else [{} for _ in merged]
        for j, i in enumerate(todo):
            metas[i]["finished"] = finished[j]
            metas[i]["response_text"] = self.tokenizer.decode(merged[i], skip_special_tokens=True)
        return rollout.replace(
            response_ids=right_pad(merged, self.pad_id, torch.long, width),
            response_mask=extend(rollout.response_mask.bool(), constant([True] * len(todo)), False, torch.bool),
            rollout_log_prob=extend(rollout.rollout_log_prob, log_mu, 0.0, torch.float32),
            log_kept_mass=extend(rollout.log_kept_mass, log_kept, 0.0, torch.float32),
            kept_ids=kept_ids,
            version=extend(rollout.version, constant([self.version] * len(todo)), 0, torch.long),
            meta=metas,
            **routed,
            **turns,
            # anything computed from the unfinished rows is stale now
            rewards=None,
            old_log_prob=None,
            ref_log_prob=None,
            is_weights=None,
            kept_mask=None,
            advantages=None,
        )

    def _resumed_routing(self, rollout: Rollout, routing, todo: list[int], width: int) -> dict:
        """``routed_experts`` / ``prompt_routed_experts`` of a resumed batch: the old tokens keep the routing they
        had, the resumed rows' new tokens add theirs (None fields for a dense model)."""
        if routing is None or rollout.routed_experts is None:
            return {"routed_experts": None, "prompt_routed_experts": None}
        valid, prompt_mask = rollout.token_mask, rollout.prompt_mask.bool()
        old_rows = [rollout.routed_experts[i][valid[i]] for i in range(rollout.batch_size)]
        for j, i in enumerate(todo):
            old_rows[i] = torch.cat([old_rows[i], routing[1][j].to(old_rows[i].dtype)])
        prompt_rows = [rollout.prompt_routed_experts[i][prompt_mask[i]] if rollout.prompt_routed_experts
                       is not None else rollout.routed_experts[i, :0] for i in range(rollout.batch_size)]
        return self._routing_fields((prompt_rows, old_rows), rollout.prompt_ids.shape[1], width)

    @staticmethod
    def _turn_tokens(rollout: Rollout, row: int, turn: int) -> int:
        """How many tokens the model wrote in ``turn`` of ``row`` (its whole response for a single turn)."""
        mask = rollout.response_mask[row].bool()
        if rollout.turn is None:
            return int(mask.sum())
        return int((mask & (rollout.turn[row] == turn)).sum())
