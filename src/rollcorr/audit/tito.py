"""The token-in-token-out check: what the learner would score if the conversations were re-tokenised.

rollcorr appends token ids (docs/multi-turn.md): the learner scores the ids the sampler drew, with each
observation's ids appended as its template renders it alone. A pipeline that keeps *messages* instead — each
model turn decoded, the environment's reply appended as a message, the chat template applied to the whole
conversation before training — scores other ids wherever the template does not give back the sampled ones: a
split the sampler drew that the tokenizer would not make, BPE merging across a turn boundary, a separator one
side adds and the other drops (verl PR 6921), whitespace a template trims. This check re-tokenises each
trajectory's conversation (``Renderer.conversation_ids`` of ``Episodes.messages``) and compares:

    s = the sampled ids: prompt, then every model turn and observation as appended
    r = template(prompt messages, turn 1 text, observation 1, …, turn K text)

s and r are aligned on their longest matching blocks (difflib): a token of s without a counterpart in r is a
*sampled* token that differs, a token of r without one in s a *re-tokenised* one. Tokens r adds after the last
sampled one (ChatML's "\\n" after the final <|im_end|>) change no score of a causal model and are not counted.
Then both sequences are scored by the learner and, on the model's tokens that have a counterpart in r,

    k3 = mean(ρ − 1 − ℓ),   ℓ = log π(token | its context in s, resp. in r) − log μ(token)

once with the sampled context (what rollcorr trains on) and once with the re-tokenised one (what that pipeline
would train on); a trajectory that re-tokenises to its own ids gives both the same ℓ. The model's tokens without
a counterpart are counted apart: that pipeline trains other tokens in their place.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rollcorr.config.correction import LOG_RATIO_CLAMP
from rollcorr.rollout import Rollout

EXAMPLE_TOKENS = 8  # tokens shown on each side of the first difference
ROWS_LISTED = 50  # differing trajectories listed in the summary


def sequences(rollout: Rollout) -> list[tuple[list[int], list[bool], int]]:
    """Per row: the sampled ids s (prompt, then every real response-side token), whether each is the model's, and
    the prompt's length."""
    out = []
    model = rollout.response_mask.bool()
    for i in range(rollout.batch_size):
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist()
        real = rollout.token_mask[i]
        out.append((prompt + rollout.response_ids[i][real].tolist(), [False] * len(prompt) + model[i][real].tolist(),
                    len(prompt)))
    return out


def align(s: list[int], r: list[int]) -> dict[str, Any]:
    """How r re-tokenises s: ``match`` (s index → r index of the matched tokens), the unmatched ``sampled`` and
    ``retokenized`` counts (r's tokens after its counterpart of s's last token not counted), ``first`` (the first
    index where they differ; None when r is s, or s followed by more tokens) and ``trailing`` (those tokens)."""
    if r[: len(s)] == s:
        return {"match": {j: j for j in range(len(s))}, "sampled": 0, "retokenized": 0, "first": None,
                "trailing": len(r) - len(s)}
    blocks = difflib.SequenceMatcher(None, s, r, autojunk=False).get_matching_blocks()
    match = {a + k: b + k for a, b, n in blocks for k in range(n)}
    end = match[len(s) - 1] + 1 if len(s) - 1 in match else len(r)  # r's tokens after s's last one: trailing
    first = next((j for j, (x, y) in enumerate(zip(s, r)) if x != y), min(len(s), len(r)))
    return {"match": match, "sampled": len(s) - len(match), "retokenized": end - sum(1 for b in match.values() if b < end),
            "first": first, "trailing": len(r) - end}


def rescored(rows: list[tuple[list[int], list[int]]], score: Callable[[Rollout], Tensor]) -> list[list[float]]:
    """The learner's log-prob of each scored position of each (r, positions) pair: r as one sequence (its first
    token the prompt, every other attended), ``positions`` (indices into r, ≥ 1) scored. ``score(rollout)`` is
    the learner's (B, T) log-probs of a Rollout."""
    width = max(len(r) for r, _ in rows) - 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attended = torch.zeros(len(rows), width, dtype=torch.bool)
    scored = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (r, positions) in enumerate(rows):
        ids[i, : len(r) - 1] = torch.tensor(r[1:])
        attended[i, : len(r) - 1] = True
        scored[i, [p - 1 for p in positions]] = True
    rollout = Rollout(prompt_ids=torch.tensor([[r[0]] for r, _ in rows]), prompt_mask=torch.ones(len(rows), 1, dtype=torch.bool),
                      response_ids=ids, response_mask=scored, observation_mask=attended & ~scored,
                      rollout_log_prob=None, version=torch.zeros_like(ids), group_ids=torch.arange(len(rows)))
    log_p = score(rollout).double()
    return [[float(log_p[i, p - 1]) for p in positions] for i, (_, positions) in enumerate(rows)]


def _k3(lr: Tensor) -> float:
    lr = lr.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return float((lr.exp() - 1.0 - lr).mean()) if lr.numel() else 0.0


def tito_check(rollout: Rollout, messages: list[list[dict[str, str]]], renderer, log_mu: Tensor, log_old: Tensor,
               score: Callable[[Rollout], Tensor], batch_size: int = 8) -> dict[str, Any]:
    """The module docstring's check of ``rollout`` (its rows' conversations ``messages``, re-tokenised by
    ``renderer``), against the sampler's ``log_mu`` and the learner's ``log_old`` of its sampled tokens ((B, T)
    response positions); ``score`` scores re-tokenised sequences ``batch_size`` at a time. Returns the summary."""
    model_mask = rollout.response_mask.bool()
    rows, drift = [], []
    lr_sampled: list[Tensor] = []
    for i, (s, is_model, p) in enumerate(sequences(rollout)):
        r = renderer.conversation_ids(messages[i], getattr(messages[i], "tools", None))  # an episode's tools too
        a = align(s, r)
        cols = rollout.token_mask[i].nonzero().squeeze(1)  # s index p + k ↔ response column cols[k]
        mu_i, old_i = log_mu[i].double(), log_old[i].double()
        pairs = [(j, a["match"][j]) for j in range(p, len(s)) if is_model[j] and j in a["match"] and a["match"][j] > 0]
        columns = [int(cols[j - p]) for j, _ in pairs]
        lr_sampled.append(old_i[columns] - mu_i[columns])
        turn = rollout.turn[i][rollout.token_mask[i]] if rollout.turn is not None else None
        rows.append({"row": i, "align": a, "pairs": pairs, "columns": columns, "s": s, "r": r, "prompt": p,
                     "model_tokens": int(model_mask[i].sum()), "is_model": is_model, "turn": turn})
        if a["first"] is not None:
            drift.append(len(rows) - 1)
    retok = {k: lr for k, lr in enumerate(lr_sampled)}  # the same ids, the same scores
    for start in range(0, len(drift), batch_size):
        part = [rows[k] for k in drift[start : start + batch_size]]
        scores = rescored([(x["r"], [b for _, b in x["pairs"]]) for x in part], score)
        for k, x, lp in zip(drift[start : start + batch_size], part, scores):
            retok[k] = torch.tensor(lp, dtype=torch.float64) - log_mu[x["row"]].double()[x["columns"]]
    return _summary(rows, drift, torch.cat(lr_sampled), torch.cat([retok[k] for k in range(len(rows))]),
                    renderer)


def _where(x: dict[str, Any], j: int) -> str:
    """Which part of the trajectory s index ``j`` is in: the prompt, a model turn, an observation, or its end."""
    if j >= len(x["s"]):
        return "after the last sampled token"
    if j < x["prompt"]:
        return "the prompt"
    k = int(x["turn"][j - x["prompt"]]) + 1 if x["turn"] is not None else 1
    return f"model turn {k}" if x["is_model"][j] else f"the observation after turn {k}"


def _summary(rows: list[dict], drift: list[int], lr_sampled: Tensor, lr_retok: Tensor, renderer) -> dict[str, Any]:
    listed = []
    for k in drift[:ROWS_LISTED]:
        x = rows[k]
        listed.append({"row": x["row"], "first_position": x["align"]["first"] - x["prompt"],
                       "first_in": _where(x, x["align"]["first"]),
                       "sampled_tokens_differing": x["align"]["sampled"],
                       "retokenized_tokens_differing": x["align"]["retokenized"]})
    model_tokens = sum(x["model_tokens"] for x in rows)
    aligned = sum(len(x["pairs"]) for x in rows)
    return {
        "template": "the chat template" if renderer.chat else "plain text (no chat template)",
        "trajectories": len(rows), "trajectories_differing": len(drift),
        "sampled_tokens": sum(len(x["s"]) for x in rows),
        "sampled_tokens_differing": sum(x["align"]["sampled"] for x in rows),
        "retokenized_tokens_differing": sum(x["align"]["retokenized"] for x in rows),
        "model_tokens": model_tokens, "model_tokens_without_counterpart": model_tokens - aligned,
        "trailing_tokens": sum(max(x["align"]["trailing"], 0) for x in rows),
        "k3_sampled": _k3(lr_sampled), "k3_retokenized": _k3(lr_retok), "tokens_compared": aligned,
        "rows": listed, "example": _example(rows[drift[0]], renderer.tokenizer) if drift else None,
    }


def _example(x: dict[str, Any], tokenizer) -> dict[str, Any]:
    """The first difference of one trajectory as text: the tokens before it, then each side's tokens from it."""
    j = x["align"]["first"]

    def text(ids: list[int]) -> str:
        return "".join(tokenizer.decode([t]) for t in ids).replace("\n", "⏎")

    lo = max(0, j - EXAMPLE_TOKENS)
    return {"row": x["row"], "position": j - x["prompt"], "in": _where(x, j), "before": text(x["s"][lo:j]),
            "sampled": text(x["s"][j : j + EXAMPLE_TOKENS]), "retokenized": text(x["r"][j : j + EXAMPLE_TOKENS]),
            "sampled_ids": x["s"][j : j + EXAMPLE_TOKENS], "retokenized_ids": x["r"][j : j + EXAMPLE_TOKENS]}
