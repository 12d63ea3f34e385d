"""The audit's verdict level, decided by shares of tokens, not by a maximum: the same engines give the same
level whatever the number of responses audited.

A maximum grows with the sample (the largest |Δp| of 2,048 responses is larger than that of 64), so a level
set by a max on 64 responses calls the same pair of engines something else on 2,048 (the dense built-in
model's hf:bf16 had max 0.70 on 2,048 responses: "beyond"; hf:fp16 max 0.085: "bf16"). A share of tokens
converges to a number as the sample grows. The level is read from three shares of the sampled tokens' |Δp| =
|μ(y_t) − π_old(y_t)|, each with a percentile-bootstrap 95 % interval over responses (a response's tokens
resampled together):

    same    share(|Δp| ≥ 1e-3) < SAME_SHARE (0.1 %)          the engines compute the same thing up to float noise
    fp16    share(|Δp| ≥ 0.01) < FP16_SHARE (2 %)            fp16-level numerics (built-in fp16: 0–0.55 %;
                                                              SmolLM2-135M fp16: 0.26–0.39 %)
    bf16    share(|Δp| ≥ 0.05) ≤ BF16_WIDE_SHARE (5 %)       bf16-level numerics: 0.3–0.8 % at ≥ 0.05 on the
                                                              built-in models, 2.1–2.6 % on SmolLM2-135M (hf and
                                                              vLLM), ABEJA's vLLM bf16 on Qwen3-4B 2.0 %
    beyond  otherwise                                         more than numerics: different weights (int8 on
                                                              the dense built-in model: 13.5 % at ≥ 0.05)

The share at ≥ 0.01 does not separate bf16 from the rest across models — 10–19 % on the built-in models, 30–32 %
on SmolLM2-135M's 30 layers, 41 % for int8 on the dense model — so the bf16/beyond boundary reads the share at
≥ 0.05 (it read ≥ 0.01 ≤ 25 % until the SmolLM2 audits showed a plain bf16 engine at 31 %). The boundaries sit in
the gaps between the precisions measured (docs/audit.md has the table); a pair near a boundary has an interval
that straddles it, and the report says so.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

SAME_SHARE, FP16_SHARE, BF16_WIDE_SHARE = 1e-3, 0.02, 0.05
LEVELS = ("same", "fp16", "bf16", "beyond")
THRESHOLDS = {"ge_1e-3": 1e-3, "ge_0.01": 0.01, "ge_0.05": 0.05}
BOOTSTRAP, STAT_SEED = 1_000, 0


def level_of(shares: dict[str, float]) -> str:
    """The module docstring's rule on {"ge_1e-3", "ge_0.01", "ge_0.05"} shares."""
    if shares["ge_1e-3"] < SAME_SHARE:
        return "same"
    if shares["ge_0.01"] < FP16_SHARE:
        return "fp16"
    if shares["ge_0.05"] <= BF16_WIDE_SHARE:
        return "bf16"
    return "beyond"


def row_hits(abs_diff: Tensor, mask: Tensor) -> tuple[dict[str, Tensor], Tensor]:
    """Per response: the number of valid tokens at or above each of THRESHOLDS, and of valid tokens.

    ``abs_diff`` (B, T) |Δp|, ``mask`` (B, T) valid tokens. Returns ({name: (B,) float64}, (B,) float64); what
    ``verdict_level_from_rows`` needs, so a dump read in chunks keeps three numbers a response, not its tokens.
    """
    mask = mask.bool()
    hits = {name: ((abs_diff >= threshold) & mask).sum(dim=1).double() for name, threshold in THRESHOLDS.items()}
    return hits, mask.sum(dim=1).double()


PICK_BLOCK = 1 << 20  # bootstrap indices drawn at once (8 MB: blocks the allocator reuses)


def share_intervals(hits: dict[str, Tensor], counts: Tensor, n: int = BOOTSTRAP, seed: int = STAT_SEED) -> dict[str, Any]:
    """Each share of valid tokens at or above a threshold, with a 95 % percentile-bootstrap interval over
    responses (``n`` resamples of the responses with a token, each response's tokens kept together).

    ``hits`` {name: (B,)} and ``counts`` (B,) from ``row_hits``. Returns {name: {"share", "ci95"}}. The
    resamples are drawn in blocks of at most ``PICK_BLOCK`` indices (the same draws as one (n, B) tensor, which
    at 10⁵ responses took 1.6 GB).
    """
    rows = counts > 0
    counts = counts[rows]
    hits = {name: hits[name][rows] for name in THRESHOLDS}
    g = torch.Generator().manual_seed(seed)
    per_block = max(1, PICK_BLOCK // max(counts.numel(), 1))
    total, hit_sums = [], {name: [] for name in THRESHOLDS}
    for start in range(0, n, per_block):
        picks = torch.randint(0, counts.numel(), (min(per_block, n - start), counts.numel()), generator=g)
        total.append(counts[picks].sum(dim=1))
        for name in THRESHOLDS:
            hit_sums[name].append(hits[name][picks].sum(dim=1))
    total_t = torch.cat(total)
    probs = torch.tensor([0.025, 0.975], dtype=torch.float64)
    out = {}
    for name in THRESHOLDS:
        h = hits[name]
        lo, hi = torch.quantile(torch.cat(hit_sums[name]) / total_t, probs).tolist()
        out[name] = {"share": float(h.sum() / counts.sum()), "ci95": [lo, hi]}
    return out


def verdict_level_from_rows(hits: dict[str, Tensor], counts: Tensor) -> dict[str, Any]:
    """{"level", "shares" (each with its interval), "straddles": the other levels an interval's ends give}."""
    shares = share_intervals(hits, counts)
    level = level_of({k: v["share"] for k, v in shares.items()})
    ends = {level_of({k: v["ci95"][i] for k, v in shares.items()}) for i in (0, 1)}
    return {"level": level, "shares": shares, "straddles": sorted(ends - {level}, key=LEVELS.index)}


def verdict_level(abs_diff: Tensor, mask: Tensor) -> dict[str, Any]:
    """``verdict_level_from_rows`` of a (B, T) |Δp| and its (B, T) mask."""
    return verdict_level_from_rows(*row_hits(abs_diff, mask))
