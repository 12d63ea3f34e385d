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
that straddles it, and the report says so. A share with no hit at all (or every token a hit) has no bootstrap
spread — every resample gives 0 — so its interval is the exact binomial one (Clopper-Pearson over the valid
tokens): [0, 1 − 0.025^(1/N)], about 3.7/N (the rule of three's 3/N is the one-sided bound).

"Is this level normal?" places the audit's k3 of KL(μ ‖ π_old) among the levels published for other models
(``K3_BANDS``). The token mean of k3 is heavy-tailed: one off-distribution token (|Δp| 0.53 among 594 tokens of
the built-in hf:bf16 audit at -n 128, k3 0.63) moved it from 2.3e-4 (n = 32) to 1.5e-3 (n = 128) and back to
5.7e-4 (n = 512), across the dense/MoE boundary. The placement reads the **median of means** instead
(``k3_level``): the responses split into ``K3_GROUPS`` consecutive groups, each group's token-mean k3, their
median — an estimator of the same token mean (as the groups grow, each group's mean converges to it) that one
token cannot move further than to a neighbouring group's mean (1.5e-4, 3.2e-4, 2.9e-4 on those three audits).
The token mean itself is kept, with its 95 % percentile-bootstrap interval over responses, and drawn beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def bootstrap_means(sums: dict[str, Tensor], counts: Tensor, n: int = BOOTSTRAP, seed: int = STAT_SEED
                    ) -> dict[str, list[float]]:
    """95 % percentile-bootstrap intervals of token means over responses: for each name, Σ sums[picks] /
    Σ counts[picks] over ``n`` resamples of the responses with a token (a response's tokens kept together).

    ``sums`` {name: (B,)} per-response sums, ``counts`` (B,) valid tokens per response. The resamples are drawn in
    blocks of at most ``PICK_BLOCK`` indices (the same draws as one (n, B) tensor, which at 10⁵ responses took
    1.6 GB); every name is read on the same resamples.
    """
    rows = counts > 0
    counts = counts[rows]
    sums = {name: x[rows] for name, x in sums.items()}
    g = torch.Generator().manual_seed(seed)
    per_block = max(1, PICK_BLOCK // max(counts.numel(), 1))
    total, drawn = [], {name: [] for name in sums}
    for start in range(0, n, per_block):
        picks = torch.randint(0, counts.numel(), (min(per_block, n - start), counts.numel()), generator=g)
        total.append(counts[picks].sum(dim=1))
        for name, x in sums.items():
            drawn[name].append(x[picks].sum(dim=1))
    total_t = torch.cat(total)
    probs = torch.tensor([0.025, 0.975], dtype=torch.float64)
    return {name: torch.quantile(torch.cat(drawn[name]) / total_t, probs).tolist() for name in sums}


def exact_interval(hits: float, tokens: float) -> list[float] | None:
    """The exact (Clopper-Pearson) 95 % interval of a share with no hit or only hits among ``tokens``:
    [0, 1 − 0.025^(1/N)] or [0.025^(1/N), 1]; None otherwise (the bootstrap's spread is then the interval)."""
    if tokens <= 0 or 0 < hits < tokens:
        return None
    bound = 0.025 ** (1.0 / tokens)
    return [0.0, 1.0 - bound] if hits == 0 else [bound, 1.0]


def share_intervals(hits: dict[str, Tensor], counts: Tensor, n: int = BOOTSTRAP, seed: int = STAT_SEED) -> dict[str, Any]:
    """Each share of valid tokens at or above a threshold, with its 95 % interval: the percentile bootstrap over
    responses (``bootstrap_means``), or for a share of no hit (or all hits) the exact one (``exact_interval``:
    a bootstrap of zero hits is [0, 0], which claims a certainty 145 tokens do not give).

    ``hits`` {name: (B,)} and ``counts`` (B,) from ``row_hits``. Returns {name: {"share", "ci95"}}.
    """
    ci = bootstrap_means({name: hits[name] for name in THRESHOLDS}, counts, n, seed)
    tokens = float(counts[counts > 0].sum())
    out = {}
    for name in THRESHOLDS:
        h = float(hits[name][counts > 0].sum())
        out[name] = {"share": h / tokens, "ci95": exact_interval(h, tokens) or ci[name]}
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


# ---- "Is this level normal?": the audit's k3 among published levels ------------------------------------------------

K3_GROUPS = 5  # the median of this many group means (fewer when there are fewer responses)


@dataclass(frozen=True)
class Measured:
    """One measured k3 of KL(μ ‖ π_old) between two engines holding one model, with where it was published."""

    label: str
    k3: float
    source: str


@dataclass(frozen=True)
class Band:
    """Where the k3 of one kind of model sits: the range a source states (``quoted``) and the pairs measured on
    such models (``measured``); its ``edges`` are the widest those sources go, so a measured pair of its kind is
    never drawn outside its own band."""

    name: str
    quoted: tuple[float, float]
    quoted_source: str
    measured: tuple[Measured, ...]

    @property
    def edges(self) -> tuple[float, float]:
        values = [*self.quoted, *(m.k3 for m in self.measured)]
        return min(values), max(values)


MILES = "Miles / LMSYS write-up 'Let Speed Be With Stability' (2026): K3 KL 'typically'"
R3 = "R3 paper (Ma et al., arXiv 2510.11370): SGLang vs Megatron"
OURS = "rollcorr audit, experiments/results/audit_diagnosis (temperature 0.7, learner hf:fp32)"
K3_BANDS = (
    Band("dense models", (1e-5, 1e-3), f"{MILES} 1e-5 to 1e-3 for dense models", (
        Measured("Qwen3-8B", 6.4e-4, R3),
        Measured("SmolLM2-135M, vllm:bf16 (CPU build)", 1.487e-3, OURS),
        Measured("SmolLM2-135M, hf:bf16", 1.801e-3, OURS),
    )),
    Band("MoE models", (1e-3, 1e-1), f"{MILES} 1e-3 to 1e-1 for mixture-of-experts models", (
        Measured("Qwen3-30B-A3B", 1.535e-3, R3),
        Measured("DeepSeek-V4, no alignment", 5.2e-3, "verl PR #7242"),
    )),
)


def bands_of(k3: float) -> list[str]:
    """The names of the bands (``K3_BANDS``) whose edges hold ``k3``: none, one, or two where bands overlap."""
    return [band.name for band in K3_BANDS if band.edges[0] <= k3 <= band.edges[1]]


def row_k3(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """(B,) float64 Σ_t (e^ℓ − 1 − ℓ) over each response's valid tokens; ``log_ratio`` (B, T) ℓ = log π_old − log μ
    (clamped), ``mask`` (B, T)."""
    lr = log_ratio.double()
    return ((lr.exp() - 1 - lr) * mask).sum(dim=1)


def median_of_means(sums: Tensor, counts: Tensor, groups: int = K3_GROUPS) -> float:
    """The median over ``groups`` consecutive groups of responses of each group's token mean Σ sums / Σ counts
    (responses without a token left out; as many groups as responses when there are fewer)."""
    rows = counts > 0
    sums, counts = sums[rows].double(), counts[rows].double()
    k = min(groups, counts.numel())
    group = torch.arange(counts.numel()) * k // counts.numel()
    means = torch.zeros(k, dtype=torch.float64).index_add_(0, group, sums) / torch.zeros(k, dtype=torch.float64).index_add_(0, group, counts)
    return float(torch.quantile(means, 0.5))


def k3_level(row_k3: Tensor, counts: Tensor) -> dict[str, Any]:
    """The audit's k3 of KL(μ ‖ π_old) for "Is this level normal?": ``robust`` (``median_of_means``, what places
    it: ``bands``), the token ``mean`` with its 95 % bootstrap interval over responses (``ci95``), ``groups``.

    ``row_k3`` (B,) each response's Σ_t (ρ_t − 1 − ℓ_t), ``counts`` (B,) its valid tokens.
    """
    rows = counts > 0
    robust = median_of_means(row_k3, counts)
    return {"robust": robust, "mean": float(row_k3[rows].sum() / counts[rows].sum()),
            "ci95": bootstrap_means({"k3": row_k3.double()}, counts.double())["k3"],
            "groups": min(K3_GROUPS, int(rows.sum())), "bands": bands_of(robust)}
