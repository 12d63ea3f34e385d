"""Gather what an audit measures: the same tokens' log-probs under the sampler (μ) and the learner (π_old).

Two sources:
- live: ``collect`` samples responses with a sampler in batches and scores the same tokens with a learner;
- a rollout dump written by any framework: ``from_log`` (through ``rollcorr.dumps.read_dump``).
Both end in an ``AuditData``: (B, T) tensors plus, when known, the text of each token for the report.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rollcorr.rollout import Rollout

SAMPLER_DISTS = ("full", "processed", "keep_mask")


@dataclass
class AuditData:
    """The audited tokens.

    rollout_log_prob  (B, T) log μ(y_t) of the sampled tokens
    old_log_prob      (B, T) log π_old(y_t), the learner scoring the same tokens
    response_mask     (B, T) bool, True on valid tokens
    tokens            per row, the text of the token at each response position (None when unknown)
    prompts           per row, the prompt text (None when unknown)
    source            how the data was made (engines, model, sampling parameters, or the dump file)
    routed_experts    (B, T, L, k) the sampler's experts per token and MoE layer (MoE models; else None)
    learner_routed_experts  (B, T, L, k) the experts the learner's own routers pick for the same tokens
                      (without replay: the routing mismatch; rollcorr.moe)
    diagnosis         "localization" and "whatif" when asked (rollcorr.audit.localize, rollcorr.audit.whatif)
    tito              the token-in-token-out check of trajectories played through an environment
                      (rollcorr.audit.tito), or None
    turn              (B, T) int64 the model turn of each token (multi-turn trajectories), or None: then a turn is
                      a run of valid tokens (rollcorr.turns)
    """

    rollout_log_prob: Tensor
    old_log_prob: Tensor
    response_mask: Tensor
    tokens: list[list[str]] | None = None
    prompts: list[str] | None = None
    source: dict[str, Any] = field(default_factory=dict)
    routed_experts: Tensor | None = None
    learner_routed_experts: Tensor | None = None
    diagnosis: dict[str, Any] = field(default_factory=dict)  # --localize / --whatif results (audit.localize, .whatif)
    turn: Tensor | None = None
    tito: dict[str, Any] | None = None


def load_prompts(path: str | Path) -> list[str]:
    """Prompts from JSONL (``{"prompt": ...}`` per line) or plain text (one prompt per line).

    JSONL when the file ends in .jsonl/.json or its first non-blank line starts with ``{``. Blank lines are
    skipped. Raises FileNotFoundError / ValueError naming the file and line of the first invalid entry.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {str(path)!r} does not exist")
    lines = path.read_text(encoding="utf-8").splitlines()
    first = next((line for line in lines if line.strip()), "")
    as_jsonl = path.suffix in (".jsonl", ".json") or first.lstrip().startswith("{")
    prompts = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if not as_jsonl:
            prompts.append(line)
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
        if not isinstance(item, dict) or "prompt" not in item:
            raise ValueError(
                f'{path}:{lineno}: expected an object with a "prompt" key, got {line.strip()[:60]!r}'
            )
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise ValueError(f'{path}:{lineno}: "prompt" must be a non-empty string')
        prompts.append(item["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def builtin_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` held-out prompts of the built-in addition task."""
    from rollcorr.tasks import make_task

    return [item["prompt"] for item in make_task("addition").sample(n, seed, split="test")]


def collect(
    sampler,
    learner,
    prompts: list[str],
    params,
    *,
    n: int = 1,
    batch_size: int = 8,
    on_batch: Callable[[str, int], None] | None = None,
) -> Rollout:
    """Sample ``n`` responses per prompt, ``batch_size`` prompts at a time, and score them with the learner.

    Returns the concatenated Rollout with ``old_log_prob`` set (the learner's log-probs of the sampled
    tokens at the sampling temperature). ``on_batch(stage, rows)`` is called after each batch is sampled
    ("sample") and scored ("score") — the CLI advances its progress bars with it. With ``params.seed`` set,
    batch i samples with seed ``seed + i``, so the whole run is reproducible.
    """
    if not prompts:
        raise ValueError("no prompts to sample")
    if n < 1 or batch_size < 1:
        raise ValueError(f"n and batch_size must be >= 1, got n={n}, batch_size={batch_size}")
    parts = []
    for i, start in enumerate(range(0, len(prompts), batch_size)):
        batch_params = params if params.seed is None else replace(params, seed=params.seed + i)
        rollout = sampler.generate(prompts[start : start + batch_size], batch_params, n=n)
        parts.append(_scored(sampler, learner, rollout, params, on_batch))
    return _joined(learner, parts)


def _scored(sampler, learner, rollout: Rollout, params, on_batch: Callable[[str, int], None] | None) -> Rollout:
    """A sampled batch with the learner's log-probs of its tokens (``old_log_prob``), at the sampling temperature."""
    if rollout.rollout_log_prob is None:
        raise ValueError(f"sampler {type(sampler).__name__} returned no rollout log-probs: nothing to audit")
    if on_batch:
        on_batch("sample", rollout.batch_size)
    with torch.no_grad():
        # greedy (temperature 0) compares against the untempered distribution (log kept mass, docs/spec.md §8)
        old = learner.log_prob(rollout, temperature=params.temperature or 1.0)
    if on_batch:
        on_batch("score", rollout.batch_size)
    return rollout.replace(old_log_prob=old.detach().float().cpu())


def _joined(learner, parts: list[Rollout]) -> Rollout:
    pad = getattr(getattr(learner, "tokenizer", None), "pad_token_id", None) or 0
    return Rollout.concat(parts, pad_token_id=pad)


def collect_episodes(sampler, learner, env, items: list[dict[str, Any]], renderer, params, *, limits=None,
                     batch_size: int = 8, on_batch: Callable[[str, int], None] | None = None,
                     ) -> tuple[Rollout, list[list[dict[str, str]]]]:
    """``collect`` through an environment: ``batch_size`` items at a time, each item's episode played turn by
    turn to its end (``rollcorr.envs.Episodes``, within ``limits``), the trajectories scored by the learner.
    Returns the Rollout (``old_log_prob`` and the rewards set) and each row's conversation as messages
    (``Episodes.messages``: what the token-in-token-out check re-tokenises). Seeds as ``collect``'s."""
    from rollcorr.envs import Episodes, Limits

    if not items:
        raise ValueError("no items to play")
    parts, conversations = [], []
    for i, start in enumerate(range(0, len(items), batch_size)):
        batch_params = params if params.seed is None else replace(params, seed=params.seed + i)
        episodes = Episodes(env, items[start : start + batch_size], renderer, limits or Limits(),
                            params.max_new_tokens, rows="the audit's items")
        rollout = episodes.play(sampler, batch_params)
        conversations += [episodes.messages(rollout, j) for j in range(rollout.batch_size)]
        parts.append(_scored(sampler, learner, rollout, params, on_batch))
    return _joined(learner, parts), conversations


def learner_routing(learner, rollout: Rollout, batch_size: int = 64) -> Tensor | None:
    """(B, T, L, k) the experts the learner's own routers (no replay) pick for the rollout's response tokens,
    ``batch_size`` rows per forward; None when the rollout carries no sampler routing or the learner cannot
    report its own (a dense model, another engine)."""
    if rollout.routed_experts is None or not hasattr(learner, "routed_experts"):
        return None
    mode, learner.routing_replay = learner.routing_replay, None  # the learner's own choice
    try:
        parts = [learner.routed_experts(rollout.select(range(i, min(i + batch_size, rollout.batch_size))))
                 for i in range(0, rollout.batch_size, batch_size)]
    finally:
        learner.routing_replay = mode
    return torch.cat(parts)


def from_rollout(
    rollout: Rollout,
    tokenizer=None,
    *,
    sampler_dist: str = "full",
    source: dict[str, Any] | None = None,
    learner_routed_experts: Tensor | None = None,
) -> AuditData:
    """AuditData from a scored Rollout (``old_log_prob`` set).

    ``sampler_dist="full"`` compares the learner with the sampler's distribution before top-k / top-p
    truncation (log μ + log kept mass, docs/spec.md §8), so truncation does not count as mismatch; "processed"
    compares with the renormalised distribution actually drawn from; "keep_mask" compares it with the learner
    renormalised over the same kept sets (a rollout with ``kept_ids``, scored over them). Without truncation
    they are equal.
    """
    if sampler_dist not in SAMPLER_DISTS:
        raise ValueError(f"unknown sampler_dist {sampler_dist!r}; use one of {SAMPLER_DISTS}")
    if rollout.old_log_prob is None or rollout.rollout_log_prob is None:
        raise ValueError("the rollout needs both rollout_log_prob and old_log_prob")
    if sampler_dist == "keep_mask" and rollout.kept_ids is None and rollout.log_kept_mass is not None \
            and bool((rollout.log_kept_mass != 0).any()):
        raise ValueError("sampler_dist='keep_mask' needs a rollout sampled with its kept sets (Rollout.kept_ids)")
    log_mu = rollout.rollout_log_prob
    mask = rollout.response_mask.bool()
    if sampler_dist == "full" and rollout.log_kept_mass is not None:
        log_mu = log_mu + rollout.log_kept_mass.masked_fill(~mask, 0.0)
    tokens = prompts = None
    if tokenizer is not None:  # every real token's text (the environment's too), by column
        lengths = rollout.token_mask.sum(dim=1).tolist()  # responses are right-padded: real tokens come first
        tokens = [
            tokenizer.batch_decode([[t] for t in ids[:n].tolist()])
            for ids, n in zip(rollout.response_ids, lengths)
        ]
        prompts = [
            tokenizer.decode(ids[m].tolist())
            for ids, m in zip(rollout.prompt_ids, rollout.prompt_mask.bool())
        ]
    return AuditData(
        rollout_log_prob=log_mu,
        old_log_prob=rollout.old_log_prob,
        response_mask=mask,
        tokens=tokens,
        prompts=prompts,
        source=dict(source or {}, sampler_dist=sampler_dist),
        routed_experts=rollout.routed_experts,
        learner_routed_experts=learner_routed_experts,
        turn=rollout.turn,
    )


def from_log(
    path: str | Path,
    *,
    rollout_field: str = "rollout_log_probs",
    learner_field: str = "old_log_probs",
    mask_field: str = "response_mask",
) -> AuditData:
    """AuditData from a rollout dump (JSONL / Parquet) written by any framework; verl field names by default.

    Malformed rows are skipped by the reader and listed in ``source["malformed"]``.
    """
    from rollcorr.dumps import read_dump

    dump = read_dump(path, rollout_field=rollout_field, learner_field=learner_field, mask_field=mask_field)
    return from_dump(dump, path=path, fields=(rollout_field, learner_field, mask_field))


def from_dump(dump, *, path: str | Path, fields: tuple[str, str, str]) -> AuditData:
    """Adapt a ``rollcorr.dumps.Dump`` to AuditData (token text and prompts when the dump has them; the
    sampler's and the learner's routed experts when it has both, for the routing section)."""
    prompts = dump.extras.get("prompt")
    if prompts is not None and not all(isinstance(p, str) for p in prompts):
        prompts = None
    return AuditData(
        rollout_log_prob=dump.rollout_log_prob,
        old_log_prob=dump.learner_log_prob,
        response_mask=dump.response_mask,
        tokens=dump.token_text,
        prompts=prompts,
        source={
            "log": str(path),
            "fields": dump.fields,
            "rows_read": dump.total_rows,
            "malformed_rows": [f"line {m.line}: {m.reason}" for m in dump.malformed],
        },
        routed_experts=dump.routed_experts,
        learner_routed_experts=dump.learner_routed_experts,
        turn=dump.turn,
    )
