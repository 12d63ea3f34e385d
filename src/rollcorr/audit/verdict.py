"""The audit's verdict in words: how far apart the engines are against reference levels, and what to do.

Two reference levels, the one place their numbers live (the report, the terminal and docs/audit.md use them):

- the built-in model, bf16 sampler vs fp32 learner: pure numerics on a 1 M-parameter model, measured with
  ``rollcorr audit`` (command and machine below);
- ABEJA's measurement of vLLM vs Hugging Face transformers on Qwen3-4B (both bf16, same weights): the
  published |Δp| shares of what "two engines, same model" looks like at production scale.

The suggestion follows the size of the gap. IS weights ρ = π_old / μ correct a gap whose ratios stay near 1
(token ESS near 1: truncated token IS costs almost nothing); when sequence products exp(Σℓ) already spread
(sequence ESS well below 1) a sequence-level mask (geometric mean of ρ) guards the long responses; when many
tokens move by ≥ 0.05 the two sides hold different models and masking (IcePop) or fixing the sampler beats
reweighting, whose variance grows like χ².
"""

from __future__ import annotations

import math
from typing import Any

# |Δp| shares and max, the keys of ``summary["probability"]``
SHARE_KEYS = (
    "prob_diff_frac_lt_1e-3",
    "prob_diff_frac_ge_0.01",
    "prob_diff_frac_ge_0.05",
    "prob_diff_frac_ge_0.1",
)
REFERENCES: dict[str, dict[str, Any]] = {
    "builtin_bf16": {
        "label": "built-in model, hf:bf16 vs hf:fp32",
        "source": "rollcorr audit --out runs/audit-builtin  (64 responses, 294 tokens; 2-core x86_64, AVX2)",
        "prob_diff_frac_lt_1e-3": 0.548,
        "prob_diff_frac_ge_0.01": 0.095,
        "prob_diff_frac_ge_0.05": 0.0,
        "prob_diff_frac_ge_0.1": 0.0,
        "prob_diff_max": 0.0397,
    },
    "abeja_vllm_hf": {
        "label": "ABEJA: vLLM vs transformers, Qwen3-4B bf16",
        "source": "ABEJA Tech Blog, measurement of vLLM vs Hugging Face token probabilities on Qwen3-4B",
        "prob_diff_frac_lt_1e-3": 0.811,
        "prob_diff_frac_ge_0.01": 0.109,
        "prob_diff_frac_ge_0.05": 0.020,
        "prob_diff_frac_ge_0.1": 0.003,
        "prob_diff_max": 0.215,
    },
}
SAME_MODEL_MAX = 1e-4  # max |Δp| below this: the engines compute the same thing up to float noise
BF16_LEVEL = REFERENCES["abeja_vllm_hf"]  # a gap no larger than this is "two engines, same model"
WIDE_FACTOR = 3.0  # ≥ 3× the reference share at ≥ 0.05, or a max |Δp| above 3× its max: beyond bf16 numerics
SEQ_ESS_GUARD = 0.9  # sequence ESS below this: long responses' weights spread; guard at sequence level
SEQ_ESS_BROKEN = 0.1  # sequence ESS below this: no reweighting recovers the learner's expectation
ROUTING_DOMINATES = 0.5  # MoE: flipped tokens carry more than this share of Σ|Δp|: routing is the main gap


def level(summary: dict[str, Any]) -> str:
    """ "same" | "bf16" | "beyond": where this audit's gap sits against the reference levels."""
    p = summary["probability"]
    if p["prob_diff_max"] < SAME_MODEL_MAX:
        return "same"
    ref = BF16_LEVEL
    wide = p["prob_diff_frac_ge_0.05"] > WIDE_FACTOR * ref["prob_diff_frac_ge_0.05"]
    wide |= p["prob_diff_max"] > min(1.0, WIDE_FACTOR * ref["prob_diff_max"]) - 1e-12
    return "beyond" if wide else "bf16"


def _pct(x: float) -> str:
    return f"{100 * x:.2g} %" if x < 0.1 else f"{100 * x:.1f} %"


def _compare(p: dict[str, Any]) -> str:
    refs = "; ".join(
        f"{r['label']}: {_pct(r['prob_diff_frac_ge_0.01'])} and {_pct(r['prob_diff_frac_ge_0.05'])}, "
        f"max {r['prob_diff_max']:.3g}"
        for r in REFERENCES.values()
    )
    return (
        f"{_pct(p['prob_diff_frac_ge_0.01'])} of the sampled tokens move by |Δp| ≥ 0.01 and "
        f"{_pct(p['prob_diff_frac_ge_0.05'])} by ≥ 0.05, max {p['prob_diff_max']:.3g} (references — {refs})."
    )


def verdict(summary: dict[str, Any]) -> list[str]:
    """A few sentences: how far apart the engines are, the correction the numbers suggest and why, and
    what a negative Monte-Carlo estimate means when one appears."""
    p, d = summary["probability"], summary["divergence"]
    ess_tok, ess_seq = d["ess_token"], d["ess_seq"]
    where = level(summary)
    out = []
    if where == "same":
        out.append(
            f"The engines agree to float noise: max |Δp| {p['prob_diff_max']:.2g} over {summary['n_tokens']} "
            "tokens. No correction is needed (preset disabled); any mismatch during training comes from "
            "staleness, not from the engines."
        )
    elif where == "bf16":
        out.append(
            "The engines are as far apart as bf16 numerics usually put two engines holding the same model: "
            + _compare(p)
        )
        if ess_seq >= SEQ_ESS_GUARD:
            out.append(
                f"Suggested correction: token-level truncated IS (preset tis, C = 2). Token ESS/N "
                f"{ess_tok:.3g} and sequence ESS/N {ess_seq:.3g} are near 1, so the weights barely spread: "
                "reweighting removes the bias at almost no variance cost, and nothing needs to be rejected."
            )
        else:
            out.append(
                f"Suggested correction: sequence-level IS with a mask (preset seq_mis: each response is "
                f"weighted by ρ(y) = Π ρ_t and dropped when ρ(y) > 2). Per token the weights are tight (ESS/N "
                f"{ess_tok:.3g}), but over a response they multiply: sequence ESS/N is {ess_seq:.3g}, so the "
                "token weights miss the bias of the response as a whole, and the few responses whose product drifts "
                "far are better dropped than reweighted."
            )
    else:
        out.append(
            "The engines are further apart than bf16 numerics put two engines holding the same model — the two "
            "sides most likely hold different weights (quantisation, another checkpoint or tokenizer, a "
            "temperature applied on one side only): " + _compare(p)
        )
        if ess_seq < SEQ_ESS_BROKEN:
            out.append(
                f"Fix the sampler before training (a finer quantisation, the same checkpoint): sequence ESS/N "
                f"is {ess_seq:.3g}, so a handful of responses would carry all the weight and no IS or rejection "
                "recovers the learner's expectation from this sample."
            )
        else:
            out.append(
                f"Suggested correction: mask rather than reweight (preset icepop: tokens with ρ outside "
                f"[0.5, 5] get weight 0), or seq_mis at sequence level. Token ESS/N is {ess_tok:.3g} and "
                f"sequence ESS/N {ess_seq:.3g}: reweighting every token would let the rare large ratios "
                "dominate the gradient (its variance grows like χ²)."
            )
    out += routing_sentences(summary)
    negative = [
        name
        for name, key in (
            ("KL k1", "kl"),
            ("reverse KL k1", "policy_kl_k1"),
            ("χ² token", "chi2_token"),
            ("χ² sequence", "chi2_seq"),
        )  # fmt: skip
        if isinstance(d.get(key), float) and math.isfinite(d[key]) and d[key] < 0
    ]
    if negative:
        out.append(
            f"Some estimates came out negative ({', '.join(negative)}): they are Monte-Carlo estimates over the "
            f"{summary['n_tokens']} sampled tokens (the engines give one log-prob per token, not the whole "
            "vocabulary), unbiased but noisy, so a true value near 0 can be estimated below 0. Read it as "
            '"about zero"; k3 and JS are non-negative by construction.'
        )
    return out


def routing_sentences(summary: dict[str, Any]) -> list[str]:
    """Mixture of experts (``summary["routing"]``): how often the two sides chose different experts, and,
    when the flipped tokens carry most of Σ|Δp|, that routing is the gap to fix first (replay, R3)."""
    r = summary.get("routing")
    if not r or r["routing_flip_share"] == 0:
        return []
    text = (
        f"Routing: {_pct(r['routing_flip_share'])} of token × layer router decisions differ between the sampler "
        f"and the learner ({_pct(r['routing_flip_token_share'])} of tokens have at least one flipped layer); "
        f"those tokens carry {_pct(r['abs_dp_share_flipped'])} of Σ|Δp| (mean |Δp| "
        f"{r['abs_dp_mean_flipped']:.3g} vs {r['abs_dp_mean_unflipped']:.3g} on the others)."
    )
    if r["abs_dp_share_flipped"] > ROUTING_DOMINATES:
        text += (
            " Routing flips dominate the mismatch: replay the sampler's experts in the learner "
            "(model.routing_replay=r3, Rollout Routing Replay) before reweighting."
        )
    return [text]
