"""The verdict of every study's claims by the study's written rule, computed from its results.json.

    PYTHONPATH=. .venv/bin/python -m experiments.summary           # print the summary table
    PYTHONPATH=. .venv/bin/python -m experiments.summary --write   # rewrite the generated blocks of the docs
    PYTHONPATH=. .venv/bin/python -m experiments.summary --check   # exit 1 when a block differs (tests do this)

The rule (docs/results.md, "How to read the numbers"): a claim counts as reproduced only when two means over
seeds differ by more than the sum of their sample standard deviations (``experiments.common.separated``), in
the claimed direction; separated the other way is **opposite**; otherwise **not reproduced**. Studies with
their own protocol are read by it: study 6 by its verdict list, studies 7 and 8 by Holm-adjusted permutation
tests. What no written rule decides is labelled "observation, not a verdict of the rule"; arms and criteria
added after results were seen say so where the claim is made.

One function per study (``STUDIES``) maps its results.json to ``Row``s; the generated blocks (``BLOCKS``) sit
between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in docs/results.md and README.md. Adding a study is
one function, one ``STUDIES`` entry (``Study(rows, page=...)`` when its verdict list lives on another page)
and an empty ``<!-- verdicts:<folder>:begin -->`` / ``<!-- verdicts:<folder>:end -->`` pair on that page;
``--write`` fills it and its summary rows.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from experiments.common import RESULTS, code_label, curve, separated
from experiments.power import fisher_greater

REPO = RESULTS.parents[1]
REPRODUCED, NOT_REPRODUCED, OPPOSITE = "reproduced", "not reproduced", "opposite"
# an equivalence claim ("the same band") that the spread rule does not separate: the rule cannot show equality,
# and it passes the more easily the noisier the seeds, so the row says what it could have seen instead
NOT_SEPARATED = "not separated (equality not shown)"
POST_HOC = "a comparison picked after the results were seen"  # the note of every "(new)" claim
MDE_LABEL = "minimum detectable effect (80 % power)"
OBSERVATION = "observation, not a verdict of the rule"


def unseen(mde: float, what: str = "an effect") -> str:
    """What a minimum detectable effect means, in words: the test had 80 % power at that size; an effect below it
    could easily go unseen, and a "not reproduced" verdict does not rule out one of that size either."""
    return f"the test had an 80 % chance to detect {what} of {mde:.3f}; a smaller one could easily go unseen"


@dataclass(frozen=True)
class Row:
    """One claim of one study: what it says, what the rule gives, the numbers the rule compared."""

    study: str  # "6", or "6 (q4_0)" for one part of a study
    claim: str  # the claim and its source
    verdict: str  # REPRODUCED | NOT_REPRODUCED | OPPOSITE | OBSERVATION | a qualified form ("… at q4_0")
    numbers: str  # the means ± std, difference and spread behind the verdict
    note: str = ""  # post-hoc marks and caveats, shown with the numbers
    mde: float | None = None  # the effect the row's seeds could have seen (``mde``); shown with "not reproduced"

    def shown_numbers(self) -> str:
        """The numbers, with the minimum detectable effect when the verdict is (partly) "not reproduced": a
        verdict of no effect says nothing about effects smaller than that."""
        if (NOT_REPRODUCED not in self.verdict and self.verdict != NOT_SEPARATED) or self.mde is None:
            return self.numbers
        return f"{self.numbers}; {MDE_LABEL} {self.mde:.3g}"


# ---------------------------------------------------------------- the rule


def ms(s: dict[str, Any], fmt: str = ".3f") -> str:
    """'mean ± std' of a ``common.summary``."""
    return f"{s['mean']:{fmt}} ± {s['std']:{fmt}}"


def direction(high: dict[str, Any], low: dict[str, Any]) -> str:
    """The rule on the claim "``high`` is above ``low``": reproduced, opposite (separated the other way) or not."""
    if not separated(high, low):
        return NOT_REPRODUCED
    return REPRODUCED if high["mean"] > low["mean"] else OPPOSITE


def compared(high_name: str, high: dict[str, Any], low_name: str, low: dict[str, Any]) -> str:
    """'a m ± s vs b m ± s (difference d, spread s)': the numbers the rule reads for "high above low"."""
    return (f"{high_name} {ms(high)} vs {low_name} {ms(low)} (difference {high['mean'] - low['mean']:+.3f}, "
            f"spread {high['std'] + low['std']:.3f})")


def mde(*arms: dict[str, Any], family: int = 1) -> float | None:
    """The minimum detectable effect of a comparison between the row's arms (``common.summary`` results): the
    two-sample formula of ``experiments.power`` at α = 0.05 (α / ``family``: Holm's first step) and 80 % power,
    with the standard deviation pooled over the arms and their seeds (``power.mde_of_arms``)."""
    from experiments.power import mde_of_arms

    return mde_of_arms([(a["std"], len(a["values"]) - a["n_nonfinite"]) for a in arms if a["std"] is not None],
                       family=family)


def mde_protocol(*arms: dict[str, Any], family: int) -> float | None:
    """``mde`` of a protocol study's arms (their ``final_score_std`` and ``seeds``) in a Holm family of
    ``family`` comparisons."""
    from experiments.power import mde_of_arms

    return mde_of_arms([(a["final_score_std"], a["seeds"]) for a in arms], family=family)


def first_cell(cells: dict[str, Any]) -> Any:
    """The first grid point of an arm (the training studies keep {arm: {grid label: …}})."""
    return next(iter(cells.values()))


def pct(x: float) -> str:
    """A share as a percentage: one decimal, two below 1 %."""
    return f"{100 * x:.2f} %" if 100 * x < 1 else f"{100 * x:.1f} %"


# ---------------------------------------------------------------- one function per study


def mismatch_anatomy(r: dict[str, Any], vllm: dict[str, Any] | None = None) -> list[Row]:
    """Study 1: the |Δp| table against ABEJA's numbers, the length claim, batch variance."""
    samplers = {name: s["table"] for name, s in r["samplers"].items()}
    low = [n for n in samplers if n != "hf:fp32"]
    ge01 = {n: samplers[n]["prob_diff_frac_ge_0.01"]["mean"] for n in low}
    bf16 = samplers["hf:bf16"]
    vb = (vllm or {}).get("results", {}).get("builtin vllm:bf16")
    # ABEJA's Qwen3-4B measurement (vLLM bf16 vs transformers, GPU), quoted, not measured here
    abeja = {"prob_diff_frac_lt_1e-3": 0.811, "prob_diff_frac_ge_0.01": 0.109, "prob_diff_frac_ge_0.05": 0.020,
             "prob_diff_frac_ge_0.1": 0.003, "prob_diff_max": 0.215}
    names = {"prob_diff_frac_lt_1e-3": "< 1e-3", "prob_diff_frac_ge_0.01": "≥ 0.01", "prob_diff_frac_ge_0.05": "≥ 0.05",
             "prob_diff_frac_ge_0.1": "≥ 0.1", "prob_diff_max": "max"}
    inside = [names[k] for k, v in abeja.items() if abs(bf16[k]["mean"] - v) <= bf16[k]["std"]]
    shown = lambda k, x: f"{x:.3f}" if k == "prob_diff_max" else pct(x)  # noqa: E731
    ours = "; ".join(f"{names[k]} {shown(k, bf16[k]['mean'])}" + (f" (vLLM bf16 {shown(k, vb[k]['mean'])})" if vb else "")
                     + f" vs ABEJA {shown(k, v)}" for k, v in abeja.items())
    rows = [Row("1", "bf16 / quantised samplers disagree with an fp32 learner on a sizeable share of tokens "
                "(ABEJA's vLLM-vs-transformers measurement)", OBSERVATION,
                "≥ 0.01 on " + ", ".join(f"{pct(v)} ({n})" for n, v in ge01.items()) + " of tokens; hf bf16 against "
                f"ABEJA's bf16 (Qwen3-4B, GPU): {ours} — ABEJA's figure is inside our seed spread for "
                f"{', '.join(inside) or 'none'} of the five")]
    claims = r["claims"]
    grows = [n for n in low if claims[n]["max_grows"] and claims[n]["max_ratio_long_over_short"] > 1]
    mean_up = [n for n in low if claims[n]["mean_changes"] and claims[n]["mean_ratio_long_over_short"] > 1]
    ok = [n for n in grows if n not in mean_up]
    ratios = [r["claims"][n]["max_ratio_long_over_short"] for n in ok]
    c0 = claims[low[0]]
    verdict = REPRODUCED if len(ok) == len(low) else f"{REPRODUCED} for {', '.join(ok) or 'none'}"
    rows.append(Row("1", "max mismatch grows with response length, the mean does not (TIS paper)", verdict,
                    f"max over the first {c0['prefix_long']} vs {c0['prefix_short']} tokens separated upwards for "
                    f"{len(grows)} of {len(low)} low-precision samplers (×{min(ratios):.1f}–{max(ratios):.1f}); "
                    f"the mean separated upwards for {len(mean_up)} of them"))
    changes = [
        c["mean_change_vs_alone"] for name, c in r["batch_composition"]["int8"].items() if name != "alone"
    ]
    rows.append(Row("1", "— (new) int8 dynamic quantisation is batch-variant", OBSERVATION,
                    f"one set of targets, no seed spread: μ moves by {min(changes):.3f}–{max(changes):.3f} on "
                    f"average with batch composition; fp32 by ≤ "
                    f"{max(c['max_change_vs_alone'] for c in r['batch_composition']['fp32'].values()):.1e}"))
    return rows


def quantised_rollouts(r: dict[str, Any]) -> list[Row]:
    """Study 2: the TIS paper's three claims at 4–5-token answers, per learning rate of the grid."""
    rows = []
    claims = [("int8 rollouts without correction learn worse (TIS paper)", "fp32/ppo", "int8/ppo"),
              ("TIS recovers the uncorrected int8 gap (TIS paper)", "int8/tis", "int8/ppo"),
              ("untruncated (vanilla) IS is unstable: worse than TIS (TIS paper)", "int8/tis", "int8/vanilla_is"),
              ("— (new) PPO-IS (π_old := μ) learns worse than decoupled PPO", "fp32/ppo", "int8/ppo_is"),
              ("— (new) verl's Geo-RS band [0.999, 1.001] collapses int8 runs", "fp32/ppo", "int8/geo_rs")]
    for claim, high, low in claims:
        verdicts, numbers, compared_arms = {}, [], []
        for label, arms in _by_label(r["final"]).items():
            a, b = arms[high]["eval/accuracy"], arms[low]["eval/accuracy"]
            lr = label.split("=")[1]
            if max(a["mean"], b["mean"]) < 0.05:  # both collapsed at this lr: a comparison says nothing
                numbers.append(
                    f"lr {lr}: both collapsed ({high} {a['mean']:.3f}, {low} {b['mean']:.3f}), left out"
                )
                continue
            verdicts[lr] = direction(a, b)
            compared_arms += [a, b]
            numbers.append(f"lr {lr}: {compared(high, a, low, b)}")
        rows.append(Row("2", claim, _joined(verdicts, "lr"), "; ".join(numbers), POST_HOC if "(new)" in claim else "",
                        mde(*compared_arms)))
    return rows


def staleness(r: dict[str, Any]) -> list[Row]:
    """Study 3: old logits under lag with and without a train/infer discrepancy (Guan et al.; Hilton et al.)."""
    acc = {arm: first_cell(c)["eval/accuracy"] for arm, c in r["final"].items()}
    resets = {arm: first_cell(c)["proximal/ewma_resets"] for arm, c in r["final"].items()}
    rows = [Row("3", "with lag *and* a train/infer discrepancy, exact old logits (snapshot) beat recomputed ones "
                "(Guan et al.)", direction(acc["int8lag4/snapshot"], acc["int8lag4/recompute"]),
                compared("snapshot", acc["int8lag4/snapshot"], "recompute", acc["int8lag4/recompute"]) +
                " (int8 sampler, lag 4)", code_versions(r, ["int8lag4/snapshot", "int8lag4/recompute"]),
                mde(acc["int8lag4/snapshot"], acc["int8lag4/recompute"]))]
    above = direction(acc["int8lag4/ewma"], acc["int8lag4/recompute"])
    below = direction(acc["int8lag4/snapshot"], acc["int8lag4/ewma"])
    between = REPRODUCED if above == below == REPRODUCED else (
        OPPOSITE if OPPOSITE in (above, below) else NOT_REPRODUCED)
    rows.append(Row("3", "EWMA old logits fall between snapshot and recompute (Guan et al.)", between,
                    f"{compared('EWMA', acc['int8lag4/ewma'], 'recompute', acc['int8lag4/recompute'])}: {above}; "
                    f"{compared('snapshot', acc['int8lag4/snapshot'], 'EWMA', acc['int8lag4/ewma'])}: {below}",
                    code_versions(r, ["int8lag4/ewma", "int8lag4/recompute", "int8lag4/snapshot"]),
                    mde(acc["int8lag4/ewma"], acc["int8lag4/recompute"], acc["int8lag4/snapshot"])))
    reset_arms = [a for a in acc if a.startswith("int8lag4/ewma_reset")]
    verdicts = {a.split("/")[1]: direction(acc[a], acc["int8lag4/ewma"]) for a in reset_arms}
    rows.append(Row("3", "EWMA's auto-reset helps, with few reset events (Guan et al.)", _joined(verdicts, ""),
                    "; ".join(f"{a.split('/')[1]} {ms(acc[a])} ({resets[a]['mean']:.1f} resets in {r['steps']} steps)"
                              f" vs ewma {ms(acc['int8lag4/ewma'])}: {verdicts[a.split('/')[1]]}"
                              for a in reset_arms),
                    _noted("the 0.5 threshold is one extra arm outside the grid, added after the 0.9 arm was seen",
                           code_versions(r, ["int8lag4/ewma", *reset_arms])),
                    mde(acc["int8lag4/ewma"], *(acc[a] for a in reset_arms))))
    lags = sorted({a.split("/")[0] for a in acc if a.startswith("lag") and a != "lag0/recompute"})
    verdicts = {lag: direction(acc["lag0/recompute"], acc[f"{lag}/recompute"]) for lag in lags}
    rows.append(Row("3", "lag alone hurts (async RL folklore)", _joined(verdicts, ""),
                    "recompute + token IS, fp32 sampler: lag 0 " + ms(acc["lag0/recompute"]) + "; " +
                    ", ".join(f"{lag} {ms(acc[f'{lag}/recompute'])}" for lag in lags),
                    code_versions(r, ["lag0/recompute", *(f"{lag}/recompute" for lag in lags)]),
                    mde(acc["lag0/recompute"], *(acc[f"{lag}/recompute"] for lag in lags))))
    return rows


def oapl_lag(r: dict[str, Any]) -> list[Row]:
    """Study 4: OAPL with a sampler synced every N learner steps, against GRPO + token TIS."""
    acc = {arm: first_cell(c)["eval/accuracy"] for arm, c in r["final"].items()}
    oapl = [a for a in acc if a.startswith("oapl_sync")]
    runs = {a: first_cell(r["runs"][a])["runs"] for a in oapl}
    start = first_cell(r["runs"][oapl[0]])["runs"][0]["initial_accuracy"]
    worst = min(run["final_accuracy"] for a in oapl for run in runs[a])
    lagged = oapl[-1]
    rows = [Row("4", "OAPL stays stable with a sampler 100s of steps behind (OAPL, Ritter et al.)", OBSERVATION,
                f"{'every' if worst > start else 'not every'} run of every sync interval ends above the start "
                f"({start:.3f}; lowest final {worst:.3f}); "
                f"{compared(oapl[0], acc[oapl[0]], lagged, acc[lagged])}: {_gap(acc[oapl[0]], acc[lagged], lagged)}")]
    verdicts = {a.removeprefix("oapl_sync"): direction(acc[a], acc["grpo_tis"]) for a in oapl}
    rows.append(Row("4", "OAPL beats GRPO + IS (OAPL)", _joined(verdicts, "sync"),
                    f"grpo_tis {ms(acc['grpo_tis'])}; " + ", ".join(f"{a} {ms(acc[a])}" for a in oapl), "",
                    mde(acc["grpo_tis"], *(acc[a] for a in oapl))))
    return rows


def _gap(first: dict[str, Any], lagged: dict[str, Any], name: str) -> str:
    """An observation's comparison in words (not a verdict): separated or not by the spread rule, and which way."""
    if not separated(first, lagged):
        return "not separated"
    return f"separated: {name} ends {'lower' if lagged['mean'] < first['mean'] else 'higher'}"


def throughput(r: dict[str, Any]) -> list[Row]:
    """Study 5: samples per second and time to the target accuracy, sync against async executors."""
    speed = {arm: first_cell(c) for arm, c in r["speed"].items()}
    rows = []
    verdicts = {a: direction(speed[a]["samples_per_s"], speed["sync"]["samples_per_s"])
                for a in speed if a != "sync"}
    rows.append(Row("5", "async is faster per sample than sync", _joined(verdicts, ""),
                    "samples/s: " + ", ".join(f"{a} {ms(s['samples_per_s'], '.0f')}" for a, s in speed.items()),
                    code_versions(r, list(speed)), mde(*(s["samples_per_s"] for s in speed.values()))))
    verdicts = {a: direction(speed["sync"]["time_to_target_s"], speed[a]["time_to_target_s"])
                for a in speed if a != "sync"}
    rows.append(Row("5", f"async reaches greedy accuracy {r['target_accuracy']} sooner (wall clock)",
                    _joined(verdicts, ""),
                    "seconds: " + ", ".join(f"{a} {ms(s['time_to_target_s'], '.1f')}" for a, s in speed.items()), "",
                    mde(*(s["time_to_target_s"] for s in speed.values()))))
    return rows


def long_mismatch(r: dict[str, Any], retest: dict[str, Any] | None = None) -> list[Row]:
    """Study 6: the protocol's verdicts 1–5 (docs/results.md, study 6), per mismatched sampler; ``retest``:
    study 7's results, whose early-warning counts follow the early-warning rows (they contradict them)."""
    acc = {arm: first_cell(c)["eval/reward"] for arm, c in r["final"].items()}
    warn = r["early_warning"]
    samplers = [s for s in ("bf16", "int8", "q4_0") if f"{s}/ppo" in acc]
    late = {"q4_0/icepop", "q4_0/geo_rs", "q4_0/seq_mis_mean"}  # added after seeds 0–1 of q4_0 were seen
    late_note = "q4_0's icepop, geo_rs and seq_mis_mean arms were added after seeds 0–1 of its ppo, tis and seq_mis arms had been seen"
    rows = []
    # 1: fp32/ppo above <s>/ppo; collapses are counted (the protocol defines them but lets them decide nothing)
    fp32 = acc["fp32/ppo"]
    n_fp32 = warn["fp32/ppo"]["collapsed"] + warn["fp32/ppo"]["steady"]
    for s in samplers:
        w = warn[f"{s}/ppo"]
        n = w["collapsed"] + w["steady"]
        p = fisher_greater(w["collapsed"], n, warn["fp32/ppo"]["collapsed"], n_fp32)
        dips = "; ".join(
            _dip(first_cell(r["runs"][f"{s}/ppo"])["runs"], run) for run in w["runs"] if run["collapse_step"]
        )
        rows.append(Row(f"6 ({s})", "a low-precision sampler makes uncorrected GRPO learn worse on 70-token answers "
                        "(TIS paper; \"When Speed Kills Stability\")", direction(fp32, acc[f"{s}/ppo"]),
                        compared("fp32/ppo", fp32, f"{s}/ppo", acc[f"{s}/ppo"]),
                        f"collapses {w['collapsed']} of {n} vs fp32 {warn['fp32/ppo']['collapsed']} of {n_fp32} "
                        f"(one-sided Fisher p = {p:.2f}; the protocol defines a collapse but lets it decide no verdict)"
                        + (f"; the dips: {dips}" if dips else ""), mde(fp32, acc[f"{s}/ppo"])))
    # 2: <s>/<m> above <s>/ppo, and not separated below fp32/ppo
    for s in samplers:
        verdicts, numbers = {}, []
        for m in ("tis", "geo_rs", "icepop", "seq_mis", "seq_mis_mean"):
            arm = f"{s}/{m}"
            if arm not in acc:
                continue
            up = direction(acc[arm], acc[f"{s}/ppo"])
            not_below = direction(fp32, acc[arm]) != REPRODUCED
            verdicts[m] = (
                REPRODUCED
                if up == REPRODUCED and not_below
                else (OPPOSITE if up == OPPOSITE else NOT_REPRODUCED)
            )
            numbers.append(f"{m}{'*' if arm in late else ''} {acc[arm]['mean'] - acc[f'{s}/ppo']['mean']:+.3f} "
                           f"(spread {acc[arm]['std'] + acc[f'{s}/ppo']['std']:.3f})")
        uncorrected_ok = direction(fp32, acc[f"{s}/ppo"]) != REPRODUCED
        rows.append(Row(f"6 ({s})", "a correction recovers it: above uncorrected, not below fp32 (TIS; IcePop; Geo-RS)",
                        _joined(verdicts, ""), f"against {s}/ppo {ms(acc[f'{s}/ppo'])}: " + ", ".join(numbers),
                        ("not separated below fp32/ppo holds for the uncorrected arm too" if uncorrected_ok else "")
                        + (f"; * {late_note}" if s == "q4_0" else ""),
                        mde(acc[f"{s}/ppo"], *(acc[f"{s}/{m}"] for m in verdicts))))
    # 3: <s>/seq_mis above <s>/tis
    verdicts = {s: direction(acc[f"{s}/seq_mis"], acc[f"{s}/tis"]) for s in samplers}
    rows.append(Row("6", "sequence-level MIS repairs it better than token TIS (\"When Speed Kills Stability\")",
                    _joined(verdicts, ""), "; ".join(compared(f"{s}/seq_mis", acc[f"{s}/seq_mis"], f"{s}/tis",
                                                              acc[f"{s}/tis"]) for s in samplers), "",
                    mde(*(acc[f"{s}/{m}"] for s in samplers for m in ("seq_mis", "tis")))))
    # 4: early warning, by the protocol's rule; false alarms are a criterion added after results were seen
    collapsed = {a: w for a, w in warn.items() if w["collapsed"] and a.split("/")[1] == "ppo"}
    steady = sum(w["steady"] for w in warn.values())
    for key, name in (
        ("rollout_corr/k3_kl", "k3 KL"),
        ("rollout_corr/prob_diff_seq_max_mean", "max |Δp| per sequence"),
    ):
        ok = bool(collapsed) and all(w["warned_first"][key] for w in collapsed.values())
        fired = "; ".join(
            f"{a}: "
            + ", ".join(
                f"fired {p[key]} before collapse {p['collapse_step']}"
                for p in w["runs"]
                if p["collapse_step"]
            )
            for a, w in collapsed.items()
        )
        alarms = sum(w["false_alarms"][key] for w in warn.values())
        negative = _negative_threshold_alarms(r, key)
        rows.append(Row("6", f"{name} above 3× its median over the first 10 steps warns before a collapse (early warning)",
                        REPRODUCED if ok else NOT_REPRODUCED, fired or "no run collapsed",
                        f"post-hoc criterion (not in the protocol; added after q4_0 runs had been seen): fired in "
                        f"{alarms} of {steady} runs that did not collapse"
                        + (f", {negative} of them because the median is ≤ 0 (signed k3 ≈ −1e-9 at fp32)" if negative else "")
                        + "; the evaluations are 25 steps apart, so \"before\" is on that grid"
                        + _retested_warning(retest, key)))
    # 5: sum vs mean (diagnostic: the protocol names what to compare, no rule)
    parts = []
    for s in samplers:
        if f"{s}/seq_mis_mean" in acc:
            rej = _run_mean(r, f"{s}/seq_mis_mean", "rollout_corr/rollout_is_seq_fraction_high")
            rej_sum = _run_mean(r, f"{s}/seq_mis", "rollout_corr/rollout_is_seq_fraction_high")
            parts.append(f"{s}: masked {rej:.3f} vs {rej_sum:.3f}; " + compared(
                "seq_mis_mean", acc[f"{s}/seq_mis_mean"], "seq_mis", acc[f"{s}/seq_mis"]))
    rows.append(Row("6", "sum vs mean: TRL's sequence mask on the geometric mean instead of the product (diagnostic)",
                    OBSERVATION, "; ".join(parts),
                    "q4_0's seq_mis_mean arm was added after seeds 0–1 of q4_0 had been seen"))
    return rows


CONFIRM_CLAIMS = {  # the confirmatory study's primary comparisons (docs/confirm-collapse.md), in its words
    "fp32/ppo vs q4_0/ppo": "a 4-bit sampler makes uncorrected GRPO learn worse on 70-token answers",
    "q4_0/tis vs q4_0/ppo": "token TIS repairs it",
    "q4_0/icepop vs q4_0/ppo": "IcePop repairs it",
    "fp16/ppo vs bf16/ppo": 'an fp16 sampler trains better than a bf16 one ("Defeating the Training-Inference Mismatch via FP16")',
}


def confirm_collapse(r: dict[str, Any]) -> list[Row]:
    """Study 7 is read by its own protocol (docs/confirm-collapse.md): Holm-adjusted permutation tests over ten
    seeds per arm, verdicts only once every arm has its ten seeds; the secondary endpoints as an observation;
    rung 2's two comparisons when rung 1's first is not reproduced (its stress ladder)."""
    from experiments.confirm_collapse import COMPARISONS, PROTOCOL, RUNGS, SEEDS

    s = r["summary"]
    out = protocol_rows("7", s, CONFIRM_CLAIMS, "confirmatory: ", PROTOCOL, len(RUNGS[1][1]) * len(SEEDS),
                        "rung-1 runs")
    if not s["complete"]:
        return out
    out.append(Row("7", "confirmatory: every arm's final score, the secondary comparisons and the early warning "
                   "(reported, not decided by the protocol)", OBSERVATION,
                   confirm_secondary(s, r["rung1"]["early_warning"])))
    if s["rung2_called"]:
        steps = RUNGS[2][0]
        rung2 = _rung2(s)
        claims = {key: CONFIRM_CLAIMS[key] for key in ("{} vs {}".format(*pair) for pair in COMPARISONS[2])}
        rows2 = protocol_rows(f"7 (rung 2: {steps} steps)", rung2, claims, "confirmatory: ", PROTOCOL,
                              len(RUNGS[2][1]) * len(SEEDS), "rung-2 runs")
        called = f"rung 2 {'ran' if rung2['complete'] else 'runs'} because rung 1's first comparison is {_ladder_verdict(s)}"
        out += [Row(row.study, row.claim, row.verdict, row.numbers, called, row.mde) for row in rows2]
        if rung2["complete"]:
            out.append(Row(rows2[0].study, "confirmatory: every arm's final score, the secondary comparison and the "
                           "early warning (reported, not decided by the protocol)", OBSERVATION,
                           confirm_secondary(rung2, rung2["early_warning"])))
        answer = study_answer(s)
        if answer is not None:
            first = rung2["arms"]  # the ladder's comparison: rung 2's first, fp32/ppo vs q4_0/ppo
            hi, lo = (COMPARISONS[2][0])
            out.append(Row("7 (its answer)", f"confirmatory: the central claim, {CENTRAL_CLAIM}", answer,
                           LADDER_ANSWER, mde=mde_protocol(first[hi], first[lo], family=len(COMPARISONS[2]))))
    return out


CENTRAL_CLAIM = "a low-precision sampler breaks uncorrected RL on long responses; the correction repairs it"
LADDER_ANSWER = ("neither rung separates fp32/ppo from q4_0/ppo, so by the protocol's stress ladder the claim is not "
                 "reproduced on this task at 150 and at 300 steps, and that is the study's answer")


def study_answer(s: dict[str, Any]) -> str | None:
    """Study 7's answer as its protocol defines one: "not reproduced" when rung 2 has run in full and does not
    separate its first comparison either; None otherwise (then each rung's verdicts are the report)."""
    from experiments.confirm_collapse import COMPARISONS

    rung2 = _rung2(s)
    if not (s["complete"] and s["rung2_called"] and rung2["complete"]):
        return None
    first = rung2["tests"]["{} vs {}".format(*COMPARISONS[2][0])]["verdict"]
    return "not reproduced" if first == "not reproduced" else None


def _ladder_verdict(s: dict[str, Any]) -> str:
    """The verdict of rung 1's first comparison: the one the stress ladder reads to call rung 2."""
    from experiments.confirm_collapse import COMPARISONS

    return s["tests"]["{} vs {}".format(*COMPARISONS[1][0])]["verdict"]


def _rung2(s: dict[str, Any]) -> dict[str, Any]:
    """Study 7's rung-2 summary; an empty, incomplete one before its first run has finished."""
    return s.get("rung2", {"complete": False, "arms": {}})


def confirm_secondary(s: dict[str, Any], warning: dict[str, Any]) -> str:
    """Study 7's secondary endpoints in one cell: per-arm scores, the two "does the correction reach fp32?"
    differences, and the early-warning rule's call per metric."""
    alarms = "; ".join(f"{key.split('/')[-1]}: {m['verdict']} (warned {m['hits']} of {m['collapsed']} collapsed "
                       f"runs, fired in {m['false_alarms']} of {m['steady']} others)"
                       for key, m in warning["metrics"].items())
    return f"{arm_scores(s)}. Secondary: {secondary_differences(s)}. Early warning: {alarms}"


def arm_scores(s: dict[str, Any]) -> str:
    """Every arm of a protocol study's summary: mean ± std [bootstrap 95 % interval], sustained collapses."""
    return "; ".join(f"{arm} {a['final_score_mean']:.3f} ± {a['final_score_std']:.3f} [{a['final_score_ci95'][0]:.3f}, "
                     f"{a['final_score_ci95'][1]:.3f}], {a['collapses']} collapse{'' if a['collapses'] == 1 else 's'}"
                     for arm, a in s["arms"].items())


def secondary_differences(s: dict[str, Any]) -> str:
    """A protocol study's secondary comparisons: difference [bootstrap 95 % interval], no verdict."""
    return "; ".join(f"{key}: {t['difference']:+.3f} [{t['ci95'][0]:+.3f}, {t['ci95'][1]:+.3f}]"
                     for key, t in s["secondary"].items())


def finished_runs(s: dict[str, Any]) -> int:
    """The finished runs of a protocol study's summary (or one rung's): its arms' seeds, summed."""
    return sum(a["seeds"] for a in s["arms"].values())


def protocol_rows(study: str, s: dict[str, Any], claims: dict[str, str], prefix: str, protocol: str, total: int,
                  runs: str) -> list[Row]:
    """The rows of a study read by its own protocol (studies 7 and 8): one per primary comparison, "pending"
    until every arm has its ten seeds, then the Holm-adjusted permutation test's verdict with its numbers."""
    if not s["complete"]:
        done = finished_runs(s)
        return [Row(study, f"{prefix}{claim}", "pending",
                    f"{done} of {total} {runs} finished; the protocol ({protocol}) gives a verdict only when every "
                    "arm has its ten seeds")
                for claim in claims.values()]
    out = []
    for key, claim in claims.items():
        t = s["tests"][key]
        hi, lo = key.split(" vs ")
        a, b = s["arms"][hi], s["arms"][lo]
        seeds = (
            f"{a['seeds']} seeds each" if a["seeds"] == b["seeds"] else f"{a['seeds']} and {b['seeds']} seeds"
        )
        numbers = (f"{hi} {a['final_score_mean']:.3f} vs {lo} {b['final_score_mean']:.3f} ({seeds}): "
                   f"difference {t['difference']:+.3f}, 95 % CI [{t['ci95'][0]:+.3f}, {t['ci95'][1]:+.3f}], "
                   f"permutation p = {t['p_value']:.3g}, Holm p = {t['p_holm']:.3g}; sustained collapses "
                   f"{t['collapses'][0]} vs {t['collapses'][1]}")
        out.append(Row(study, f"{prefix}{claim}", t["verdict"], numbers, mde=mde_protocol(a, b, family=len(claims))))
    return out


DOSE_CLAIMS = {  # study 9's two tests (docs/dose-study.md), in its words
    "H1": "harm: uncorrected GRPO's final score falls as the sampler's mismatch grows (fp32, rtn4, rtn3, rtn2)",
    "H2": "repair: token TIS scores above uncorrected GRPO at the same mismatch (over rtn4, rtn3, rtn2)",
}


def dose_response(r: dict[str, Any]) -> list[Row]:
    """Study 9 is read by its own protocol (docs/dose-study.md): H1 (slope of the uncorrected arms' final score on
    the dose rank) and H2 (TIS − uncorrected within doses), permutation tests, Holm over the two; verdicts only
    once every arm has its ten seeds; each with the effect it could have seen."""
    s = r["summary"]
    if not s["complete"]:
        done = finished_runs(s)
        return [Row("9", f"dose-response: {claim}", "pending",
                    f"{done} of 70 runs finished; the protocol (docs/dose-study.md) gives a verdict only when every "
                    "arm has its ten seeds") for claim in DOSE_CLAIMS.values()]
    h1, h2 = s["tests"]["H1"], s["tests"]["H2"]
    scores = "; ".join(f"{arm} {a['final_score_mean']:.3f}" for arm, a in s["arms"].items())
    rows = [  # the protocol asks every verdict with its MDE: said whatever the verdict
        Row("9", f"dose-response: {DOSE_CLAIMS['H1']}", h1["verdict"],
            f"slope {h1['slope']:+.4f} per dose rank, 95 % CI [{h1['ci95'][0]:+.4f}, {h1['ci95'][1]:+.4f}], "
            f"permutation p = {h1['p_value']:.3g}, Holm p = {h1['p_holm']:.3g} (10 seeds an arm; {scores}); "
            f"{MDE_LABEL} {h1['mde_slope']:.4f} per dose rank ({3 * h1['mde_slope']:.4f} from fp32 to rtn2)",
            "the ranks 0-3 are unequal steps in k3 (rtn2 is 41× q4_0's k3, rtn3 4.5×)"),
        Row("9", f"dose-response: {DOSE_CLAIMS['H2']}", h2["verdict"],
            f"TIS − uncorrected {h2['difference']:+.3f} (mean over the doses), 95 % CI [{h2['ci95'][0]:+.3f}, "
            f"{h2['ci95'][1]:+.3f}], permutation p = {h2['p_value']:.3g}, Holm p = {h2['p_holm']:.3g}; "
            f"{MDE_LABEL} {h2['mde']:.4f}", "above uncorrected is not recovered: at rtn2 TIS still ends "
            f"{s['secondary']['rtn2/tis vs fp32/ppo']['difference']:+.3f} against fp32"),
    ]
    if s.get("answer"):
        rows.append(Row("9 (its answer)", "dose-response: how much mismatch uncorrected RL tolerates on this task",
                        h1["verdict"], s["answer"].rstrip(".")))
    return rows


CORRECTION_PREFIX = "which correction at rtn2 (a sampler with 2-bit rounded weights, 300 steps): "
CORRECTION_CLAIMS = {  # study 11's primary family (docs/correction-study.md), each alternative against token TIS
    "rtn2/seq_mis vs rtn2/tis": "sequence-level MIS (w = ρ_seq · 1[ρ_seq ≤ 2], TRL's mask) against token TIS",
    "rtn2/icepop vs rtn2/tis": "IcePop (w_t = ρ_t · 1[0.5 ≤ ρ_t ≤ 5]) against token TIS",
    "rtn2/seq_is_rs vs rtn2/tis": "sequence-level IS + rejection (verl's decoupled_seq_is_rs) against token TIS",
    "rtn2/removed vs rtn2/tis": "removing the mismatch (an hf:rtn2 learner, straight-through gradient to float32 "
    "masters) against token TIS",
}


def correction_study(r: dict[str, Any]) -> list[Row]:
    """Study 11 read by its own protocol (docs/correction-study.md): each alternative against token TIS at rtn2,
    exact permutation p with Holm over four, every verdict with its MDE; "pending" until each of the primary
    block's seven arms has its 15 seeds; then the study's answer."""
    from experiments.correction_study import PRIMARY_ARMS, PRIMARY_SEEDS

    s = r["summary"]
    if not s["complete"]:
        done = sum(s["arms"].get(arm, {}).get("seeds", 0) for arm in PRIMARY_ARMS)
        total = len(PRIMARY_ARMS) * len(PRIMARY_SEEDS)
        return [Row("11", f"{CORRECTION_PREFIX}{claim}", "pending",
                    f"{done} of {total} runs of the primary block finished; the protocol (docs/correction-study.md) "
                    f"gives a verdict only when each of its {len(PRIMARY_ARMS)} arms has its {len(PRIMARY_SEEDS)} "
                    "seeds") for claim in CORRECTION_CLAIMS.values()]
    out = []
    for key, claim in CORRECTION_CLAIMS.items():
        t, alt = s["tests"][key], key.split(" vs ")[0]
        a, tis = s["arms"][alt], s["arms"]["rtn2/tis"]
        fisher = s["secondary"][f"{alt} vs rtn2/tis: collapses"]["fisher_p"]
        numbers = (f"{alt} {a['final_score_mean']:.3f} vs rtn2/tis {tis['final_score_mean']:.3f} ({a['seeds']} seeds "
                   f"each): difference {t['difference']:+.3f}, 95 % CI [{t['ci95'][0]:+.3f}, {t['ci95'][1]:+.3f}], "
                   f"permutation p = {t['p_value']:.3g}, Holm p = {t['p_holm']:.3g}; sustained collapses "
                   f"{a['collapses']} vs {tis['collapses']} (Fisher p = {fisher:.3g}); {MDE_LABEL} {t['mde']:.3f}")
        out.append(Row("11", f"{CORRECTION_PREFIX}{claim}", t["verdict"], numbers))
    better = [k.split(" vs ")[0] for k, t in s["tests"].items() if t["verdict"] == "better than token TIS"]
    verdict = f"{', '.join(better)} better than token TIS" if better else "nothing separated from token TIS"
    out.append(Row("11 (its answer)", "which correction where uncorrected GRPO collapses (rtn2)", verdict,
                   correction_answer(s)))
    return out


def correction_answer(s: dict[str, Any]) -> str:
    """Study 11's answer as its protocol's code writes it (``summary["answer"]``), its minimum detectable effect said
    as power ("could not have been seen" overstates what 80 % power means)."""
    said = s["answer"].rstrip(".")
    found = re.search(r"; a difference below (\d+\.\d+) could not have been seen", said)
    if found is None:
        return said
    return said.replace(found.group(0), "") + f"; {unseen(float(found.group(1)), 'a difference')}"


def correction_reading(r: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """Study 11's secondary comparisons (reported, not decided: each with its interval and, for differences, its
    MDE at m = 1), the per-arm figures and the runs' wall times; empty until the primary block is complete."""
    s = r["summary"]
    if not s["complete"]:
        return ""
    arms, sec = s["arms"], s["secondary"]
    ppo = sec["rtn2/ppo vs rtn2/tis"]

    def recovered(arm: str) -> str:
        g = sec["gap_recovered"][arm]
        return f"{arm.split('/')[1]} {g['share']:.0%} [{g['ci95'][0]:.0%}, {g['ci95'][1]:.0%}]"

    def figures(arm: str) -> str:
        a = arms[arm]
        served = "" if a["served_score_mean"] is None else f", served {a['served_score_mean']:.3f}"
        kept = ("" if a["kept_sequence_share_median"] is None
                else f", sequences kept by a rejection rule {a['kept_sequence_share_median']:.0%}")
        k3 = "" if a["training_k3_median"] is None else f", training k3 {a['training_k3_median']:.3g}"
        return (f"{arm} {a['final_score_mean']:.3f} ± {a['final_score_std']:.3f}{served}{k3}{kept}, "
                f"{a['collapses']} of {a['seeds']} collapsed")

    def shares(dose: str, fp32_from: str = "") -> str:
        """The share of the gap each arm of ``dose`` recovers, its denominator beside it (the per-arm means)."""
        fp32, ppo = arms["fp32/ppo"]["final_score_mean"], arms[f"{dose}/ppo"]["final_score_mean"]
        said = "; ".join(recovered(a) for a in arms if a.startswith(f"{dose}/") and a in sec.get("gap_recovered", {}))
        return (f"The share of the fp32 − uncorrected gap each arm recovers at {dose} (95 % bootstrap interval; "
                f"{fp32_from}the gap itself: fp32 {fp32:.3f} − {dose}/ppo {ppo:.3f} = {fp32 - ppo:.3f}): {said}.")

    rtn2 = [a for a in arms if a.startswith("rtn2/")]
    collapses = "; ".join(f"{k.split(' vs ')[0].split('/')[1]} {v['collapses'][0]} vs {v['collapses'][1]} "
                          f"(Fisher p = {v['fisher_p']:.3g})" for k, v in sec.items() if k.endswith(": collapses"))
    seconds = sorted(run["seconds"] for run in runs)
    text = [
        "**Secondary, reported, not decided (the protocol's list).** Uncorrected against token TIS at rtn2: "
        f"{ppo['difference']:+.3f}, 95 % CI [{ppo['ci95'][0]:+.3f}, {ppo['ci95'][1]:+.3f}], permutation p = "
        f"{ppo['p_value']:.3g}, {MDE_LABEL} {ppo['mde']:.3f}. Sustained collapses against token TIS's: {collapses}. "
        f"{shares('rtn2')} Per arm (final score mean "
        "± sd; served: the final weights' greedy score through the rounded sampler; medians over the runs): "
        f"{'; '.join(figures(a) for a in ['fp32/ppo', *rtn2])}.",
    ]
    if s["complete_secondary"]:
        rtn3 = "; ".join(f"{k.split(' vs ')[0].split('/')[1]} {t['difference']:+.3f} [{t['ci95'][0]:+.3f}, "
                         f"{t['ci95'][1]:+.3f}], p = {t['p_value']:.3g}, MDE {t['mde']:.3f}, collapses "
                         f"{t['collapses'][0]} vs {t['collapses'][1]} (Fisher p = {t['collapse_fisher_p']:.3g})"
                         for k, t in sec.items() if k.startswith("rtn3/"))
        rtn3_arms = [a for a in arms if a.startswith("rtn3/")]
        text.append(f"The rtn3 block, each arm against rtn3/tis (10 seeds each): {rtn3}. "
                    f"{shares('rtn3', 'fp32 from the primary block; ')} "
                    f"Per arm: {'; '.join(figures(a) for a in rtn3_arms)}.")
    else:
        done = sum(a["seeds"] for k, a in arms.items() if k.startswith("rtn3/"))
        text.append(f"The rtn3 block: {done} of 60 runs finished; reported when all are in.")
    text.append(f"Wall time: {len(seconds)} runs of {seconds[0]:.0f}–{seconds[-1]:.0f} s each, median "
                f"{statistics.median(seconds):.0f} s (their run files' `seconds`: one niced process per core, two at "
                f"a time, beside other work, over several sessions){_machines(runs)}.")
    return " ".join(text) + "\n\n" + served_exploratory(arms, runs)


def _machines(runs: list[dict[str, Any]]) -> str:
    """", on <cpu> (n runs) and …" from the run files' ``machine`` (CPU and torch's capability), where recorded."""
    cpus: dict[str, int] = {}
    for run in runs:
        if run.get("machine"):
            key = f"{run['machine']['cpu']} ({run['machine']['capability']})"
            cpus[key] = cpus.get(key, 0) + 1
    return ", on " + " and ".join(f"{cpu}: {n} runs" for cpu, n in cpus.items()) if cpus else ""


def served_exploratory(arms: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """Study 11's served scores compared with token TIS's at rtn2 (difference, bootstrap interval, exact permutation
    p): a comparison chosen after the results were seen, labelled so."""
    from experiments.correction_study import versus

    served = {arm: [r["served_score"] for r in runs if r["arm"] == arm and r.get("served_score") is not None]
              for arm in ("rtn2/tis", "rtn2/removed", "rtn2/ppo")}

    def against_tis(arm: str) -> str:
        t = versus(served[arm], served["rtn2/tis"], 1)
        return (f"{arm} {statistics.fmean(served[arm]):.3f} ({t['difference']:+.3f}, 95 % CI [{t['ci95'][0]:+.3f}, "
                f"{t['ci95'][1]:+.3f}], exact permutation p = {t['p_value']:.3g})")

    return ("**Exploratory (" + POST_HOC + "; not one of the protocol's tests).** The protocol's endpoint and "
            "collapse rule read every arm's greedy evaluations of the float32 master weights; the `removed` arm "
            "trains their rounding, which the served score evaluates (the final weights through the 2-bit sampler). "
            f"Served scores at rtn2 against token TIS's {statistics.fmean(served['rtn2/tis']):.3f}: "
            f"{against_tis('rtn2/removed')}; {against_tis('rtn2/ppo')}. fp32/ppo's final score, through the float32 "
            f"sampler: {arms['fp32/ppo']['final_score_mean']:.3f}.")


def readme_correction(results: Path = RESULTS) -> str:
    """The README's verdict on study 11 once its primary block is complete: each alternative's verdict against
    token TIS with its difference, interval, Holm p and MDE, then the study's answer; empty before."""
    s = load("correction_study", results)["summary"]
    if not s["complete"]:
        return ""
    parts = []
    for key, claim in CORRECTION_CLAIMS.items():
        t = s["tests"][key]
        parts.append(f"{claim.split(' (')[0]}: **{t['verdict']}** ({key.replace(' vs ', ' − ')} = "
                     f"{t['difference']:+.3f}, 95 % CI [{t['ci95'][0]:+.3f}, {t['ci95'][1]:+.3f}], Holm p = "
                     f"{t['p_holm']:.3g}, MDE {t['mde']:.3f})")
    return ("Study 11 (which correction where mismatch hurts: a sampler with 2-bit rounded weights, 15 seeds an arm, "
            f"exact permutation tests with Holm, [protocol](docs/correction-study.md)): {'; '.join(parts)}. Its answer: "
            f"{correction_answer(s)}.")


def _correction_runs(results: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((results / "correction_study" / "runs").glob("*.json"))]


FP16_CLAIM = 'fp16 on both sides lowers the mismatch ≥ 10× against bf16 ("Defeating the Training-Inference Mismatch via FP16")'
FP16_TRAIN_CLAIM = "fp16 on both sides trains better than bf16 on both sides (the same paper)"


def fp16_study(r: dict[str, Any]) -> list[Row]:
    """Study 10 by its protocol (docs/fp16-study.md): part A per model (the k3 ratio's interval against 10×), part B
    (a permutation test); "pending" until each part has all its audits or runs."""
    from experiments.fp16_study import MODELS, SEEDS

    s = r["summary"]
    rows = []
    for model in MODELS:
        t = s["tests"].get(f"A:{model}")
        claim = f"{FP16_CLAIM} — audit, {model}"
        if not s["complete_a"] or t is None:
            rows.append(Row("10 (A)", claim, "pending", f"{len(s['tests'])} of {len(MODELS)} models audited; the "
                            "protocol (docs/fp16-study.md) gives each verdict when part A is complete"))
            continue
        rows.append(Row("10 (A)", claim, t["verdict"],
                        f"k3 bf16 pair {t['k3']['bf16']:.3g} vs fp16 pair {t['k3']['fp16']:.3g}: ratio {t['ratio']:.1f}, "
                        f"95 % CI [{t['ci95'][0]:.1f}, {t['ci95'][1]:.1f}]; |Δp| ≥ 0.01: {100 * t['share_ge_0.01']['bf16']:.1f} % "
                        f"vs {100 * t['share_ge_0.01']['fp16']:.2f} %", _exploratory_ratio(t)))
    b = s["tests"].get("B")
    done = sum(a["seeds"] for a in s["arms"].values())
    if not s["complete_b"] or b is None:
        rows.append(Row("10 (B)", FP16_TRAIN_CLAIM, "pending", f"{done} of {2 * len(SEEDS)} runs finished"))
    else:
        a, c = s["arms"]["fp16/ppo"], s["arms"]["bf16/ppo"]
        rows.append(Row("10 (B)", FP16_TRAIN_CLAIM, b["verdict"],
                        f"fp16/ppo {a['final_score_mean']:.3f} vs bf16/ppo {c['final_score_mean']:.3f} (10 seeds each): "
                        f"difference {b['difference']:+.3f}, 95 % CI [{b['ci95'][0]:+.3f}, {b['ci95'][1]:+.3f}], "
                        f"permutation p = {b['p_value']:.3g}; overflow skips {a['overflow_skips']:.0f}", mde=b["mde"]))
    return rows


def _exploratory_ratio(t: dict[str, Any]) -> str:
    """Part A's detectable ratio, added with the results (study 10's protocol has no MDE for a ratio): a note,
    labelled so, for a "not reproduced" model only."""
    from experiments.fp16_study import CLAIM_RATIO
    from experiments.power import detectable_ratio

    if t["verdict"] != NOT_REPRODUCED:
        return ""
    seen = detectable_ratio(t["ratio"], t["ci95"][0], CLAIM_RATIO)
    return (f"exploratory, not in the protocol: an interval this wide shows ≥ {CLAIM_RATIO:.0f}× with 80 % power only "
            f"for a true ratio near {seen:.1f}×")


MOE_CLAIMS = {  # study 8's primary comparisons (docs/moe-study.md), in its words
    "moe-fp32/ppo vs moe-int8/ppo": "MoE: an int8 sampler's mismatch (router flips included) hurts uncorrected GRPO",
    "moe-int8/r3 vs moe-int8/ppo": "MoE: routing replay (R3) repairs it",
    "moe-int8/r3+tis vs moe-int8/tis": "MoE: routing replay adds to token TIS",
    "moe-int8/lag2-ewma+r3 vs moe-int8/lag2-ewma": "MoE: routing replay joined with the EWMA old-logit strategy helps at lag 2",
}


def moe(r: dict[str, Any]) -> list[Row]:
    """Study 8 is read by its own protocol (docs/moe-study.md): part A's yes/no rules on the audits, part B's
    Holm-adjusted permutation tests over ten seeds per arm (verdicts only once every arm has its ten seeds)."""
    s, audits = r["summary"], r["audits"]
    out = []
    rules = s["mismatch"]
    if "A1_fp32_flips_nothing" in rules:
        flips = audits["moe/fp32"]["routing"]["routing_flip_share"]
        out.append(Row("8", "MoE: an fp32 sampler against the fp32 learner flips no router decision (A1)",
                       REPRODUCED if rules["A1_fp32_flips_nothing"] else NOT_REPRODUCED,
                       f"flip share {flips:.2%} of token × layer pairs, {audits['moe/fp32']['tokens']} tokens"))
    if "A2_lower_precisions_flip" in rules:
        a2 = rules["A2_lower_precisions_flip"]
        numbers = "; ".join(f"{p}: {audits[f'moe/{p}']['routing']['routing_flip_share']:.2%} of pairs, "
                            f"{audits[f'moe/{p}']['routing']['routing_flip_token_share']:.2%} of tokens" for p in a2)
        out.append(Row("8", "MoE: a lower-precision sampler flips router decisions (A2; R3 paper)",
                       _qualified(a2), numbers))
    if "A3_replay_shrinks_the_gap" in rules:
        a3 = rules["A3_replay_shrinks_the_gap"]
        numbers = "; ".join(f"{p}: mean |Δp| {audits[f'moe/{p}']['prob_diff_mean']:.5f} → "
                            f"{audits[f'moe/{p}+r3']['prob_diff_mean']:.5f}, k3 {audits[f'moe/{p}']['k3_kl']:.2e} → "
                            f"{audits[f'moe/{p}+r3']['k3_kl']:.2e}" for p in a3)
        out.append(Row("8", "MoE: replaying the sampler's experts shrinks the sampler–learner gap (A3)",
                       _qualified(a3), numbers))
    if rules.get("A4_moe_over_dense"):
        numbers = "; ".join(f"{p}: k3 {audits[f'moe/{p}']['k3_kl']:.2e} vs {audits[f'dense/{p}']['k3_kl']:.2e} "
                            f"(× {ratio['k3_kl']:.2f}), mean |Δp| × {ratio['prob_diff_mean']:.2f}"
                            for p, ratio in rules["A4_moe_over_dense"].items())
        out.append(Row("8", "MoE against the dense built-in model at the same sampler precision (A4, descriptive)",
                       OBSERVATION, numbers,
                       "int8 dynamic quantisation converts nn.Linear layers: the dense model's MLPs, not the MoE "
                       "experts, which are parameters and stay float32"))
    from experiments.moe_study import ARMS, SEEDS

    out += protocol_rows("8", s, MOE_CLAIMS, "", "docs/moe-study.md", len(ARMS) * len(SEEDS), "training runs")
    if not s["complete"]:
        return out
    out.append(Row("8", "MoE: every arm's final greedy accuracy, and the secondary comparisons (no verdict by the protocol)",
                   OBSERVATION, f"{arm_scores(s)}. Secondary: {secondary_differences(s)}"))
    return out


def _qualified(by_precision: dict[str, bool]) -> str:
    """reproduced / not reproduced, or "reproduced at bf16, int8; not at fp16" when the precisions disagree."""
    yes = [p for p, ok in by_precision.items() if ok]
    no = [p for p, ok in by_precision.items() if not ok]
    if not no:
        return REPRODUCED
    if not yes:
        return NOT_REPRODUCED
    return f"{REPRODUCED} at {', '.join(yes)}; not at {', '.join(no)}"


def distributed_accuracy(r: dict[str, Any]) -> list[Row]:
    """The data-parallel learner's three-seed check (docs/distributed.md): N=2 in N=1's band by the studies' rule."""
    one, two = r["arms"]["ranks=1"], r["arms"]["ranks=2"]
    claim = "FSDP2: `rollcorr train trainer.ranks=2` ends in the same accuracy band as one process (default config)"
    if r["same_band"] is None:
        return [Row("check", claim, "pending", f"{len(r['runs'])} of 6 runs finished")]
    verdict = NOT_SEPARATED if r["same_band"] else "separated: N=2 is outside one process's band"
    return [Row("check", claim, verdict,
                compared("ranks=2", two, "ranks=1", one) + " (seeds 0–2, greedy accuracy at step 600)",
                "seed 0 of both arms had been run (commit 781df16: 0.905 at N=2, 0.965 at N=1) before the rule was "
                f"written (07ff832); the rule's spread grows with the seeds' noise (N=1's {one['std']:.3f} comes "
                f"from one seed at {one['min']:.2f}), so not separating is weak evidence of sameness",
                mde(two, one))]


def code_versions(r: dict[str, Any], arms: list[str]) -> str:
    """'a, b: code recorded in 887b1af; c: code 0e16377' when the runs behind a row ran on more than one code
    version (``code_commit`` per run, or ``recorded_in_commit`` for runs older than that field), else ''."""
    by: dict[str, list[str]] = {}
    for arm in arms:
        for run in first_cell(r["runs"][arm])["runs"]:
            label = code_label(run)
            label = (
                "code unrecorded"
                if label == "–"
                else label
                if label.startswith("recorded")
                else f"code {label}"
            )
            if arm not in by.setdefault(label, []):
                by[label].append(arm)
    if len(by) < 2:
        return ""
    return "arms run on different code: " + "; ".join(f"{', '.join(a)}: {label}" for label, a in by.items())


def _noted(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def _by_label(final: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for arm, cells in final.items():
        for label, metrics in cells.items():
            out.setdefault(label, {})[arm] = metrics
    return out


def _joined(verdicts: dict[str, str], prefix: str) -> str:
    """One verdict when every part agrees, else 'opposite at a, b; not reproduced at c'."""
    if not verdicts:
        return NOT_REPRODUCED
    kinds = list(dict.fromkeys(verdicts.values()))
    if len(kinds) == 1:
        return kinds[0]
    name = (lambda k: f"{prefix} {k}".strip()) if prefix else (lambda k: k)
    return "; ".join(f"{v} at {', '.join(name(k) for k, x in verdicts.items() if x == v)}" for v in kinds)


def _dip(runs: list[dict[str, Any]], p: dict[str, Any]) -> str:
    """'best → dip → final' of one collapsed run's greedy score."""
    (run,) = [x for x in runs if x["seed"] == p["seed"]]
    steps, scores = curve(run["records"], "eval/reward")
    i = steps.index(p["collapse_step"])
    return f"seed {p['seed']} best {max(scores[:i]):.3f} → {scores[i]:.3f} at step {steps[i]} → final {scores[-1]:.3f}"


def _retested_warning(retest: dict[str, Any] | None, key: str) -> str:
    """Study 7's count for one early-warning metric, in both rungs: how often it fired without a collapse and
    whether it warned before the collapses there were (study 7 retested this claim; its rule needs 3)."""
    if retest is None or not retest["summary"]["complete"]:
        return ""
    parts = []
    for label, s in (("rung 1", retest["rung1"]), ("rung 2", retest["summary"].get("rung2", {}))):
        m = s.get("early_warning", {}).get("metrics", {}).get(key)
        if m is not None:
            parts.append(f"{label}: fired in {m['false_alarms']} of {m['steady']} runs without a sustained collapse, "
                         f"warned {m['hits']} of {m['collapsed']} collapsed")
    return ("; study 7 (ten seeds an arm, its own protocol) contradicts this verdict's use as a warning — "
            + "; ".join(parts)) if parts else ""


def _negative_threshold_alarms(r: dict[str, Any], key: str) -> int:
    """False alarms of runs whose baseline median of ``key`` is ≤ 0 (3× a non-positive median is no threshold)."""
    n = 0
    for arm, w in r["early_warning"].items():
        runs = {x["seed"]: x for x in first_cell(r["runs"][arm])["runs"]}
        for p in w["runs"]:
            _, values = curve(runs[p["seed"]]["records"], key)
            if p["collapse_step"] is None and p[key] is not None and statistics.median(values[:10]) <= 0:
                n += 1
    return n


def _run_mean(r: dict[str, Any], arm: str, key: str) -> float:
    from experiments.common import run_mean

    return run_mean(first_cell(r["runs"][arm])["runs"], key)["mean"] or 0.0


# ---------------------------------------------------------------- the generated blocks


@dataclass(frozen=True)
class Study:
    """How one study's verdicts are made: ``rows(results, *extra results)`` and the page holding its
    ``<!-- verdicts:<folder>:begin -->`` block."""

    rows: Callable[..., list[Row]]
    extra: tuple[str, ...] = ()  # further results folders ``rows`` reads
    page: str = "docs/results.md"


# results folder → Study, in the summary's order. A new study: its rows function and one entry here.
STUDIES: dict[str, Study] = {
    "mismatch_anatomy": Study(mismatch_anatomy, ("vllm_mismatch",)),
    "quantised_rollouts": Study(quantised_rollouts),
    "staleness": Study(staleness),
    "oapl_lag": Study(oapl_lag),
    "throughput": Study(throughput),
    "long_mismatch": Study(long_mismatch, ("confirm_collapse",)),
    "confirm_collapse": Study(confirm_collapse),
    "moe": Study(moe),
    "dose_response": Study(dose_response),
    "correction_study": Study(correction_study),
    "fp16_study": Study(fp16_study, page="docs/precision.md"),
    "distributed_accuracy": Study(distributed_accuracy, page="docs/distributed.md"),
}


def load(name: str, results: Path = RESULTS) -> dict[str, Any]:
    path = results / name / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"{name}: no results file {path} (run its study first)")
    return json.loads(path.read_text())


def rows(study: str, results: Path = RESULTS) -> list[Row]:
    spec = STUDIES[study]
    return spec.rows(load(study, results), *(load(e, results) for e in spec.extra))


def summary_table(all_rows: list[Row]) -> str:
    lines = ["| study | claim (source) | verdict by the rule | the numbers |", "|---|---|---|---|"]
    for row in all_rows:
        verdict = row.verdict if row.verdict == OBSERVATION else f"**{row.verdict}**"
        numbers = row.shown_numbers() + (f" *({row.note})*" if row.note else "")
        lines.append(f"| {row.study} | {_cell(row.claim)} | {verdict} | {_cell(numbers)} |")
    return "\n".join(lines)


def verdict_list(study_rows: list[Row]) -> str:
    """A study section's generated verdicts: one bullet per claim."""
    out = []
    for row in study_rows:
        note = f" *{row.note}.*" if row.note else ""
        part = f" [{row.study.split('(')[1].rstrip(')')}]" if "(" in row.study else ""
        out.append(f"- {row.claim}{part}: **{row.verdict}** — {row.shown_numbers()}.{note}")
    return "\n".join(out)


def readme_sentence(results: Path = RESULTS) -> str:
    """The README's verdict on study 6's headline claims: the verdicts of its rows, with the numbers behind them."""
    r = load("long_mismatch", results)
    acc = {arm: first_cell(c)["eval/reward"] for arm, c in r["final"].items()}
    by_claim: dict[str, dict[str, str]] = {}
    for row in long_mismatch(r):
        by_claim.setdefault(row.claim, {})[row.study.split("(")[-1].rstrip(")")] = row.verdict
    worse, recovers, seq = list(by_claim.values())[:3]
    worse_row = next(row for row in long_mismatch(r) if row.study == "6 (q4_0)")
    w = r["early_warning"]["q4_0/ppo"]
    fp32 = r["early_warning"]["fp32/ppo"]
    n, n_fp32 = w["collapsed"] + w["steady"], fp32["collapsed"] + fp32["steady"]
    gap = acc["fp32/ppo"]["mean"] - acc["q4_0/ppo"]["mean"]
    tis = acc["q4_0/tis"]["mean"] - acc["q4_0/ppo"]["mean"]
    return (
        "Study 6 (70-token answers, `rollcorr train --config chain`) read by its protocol's rule (two means differ "
        'by more than the sum of their standard deviations): "a low-precision sampler makes uncorrected GRPO learn '
        f'worse" is **{_joined(worse, "")}** — with a 4-bit llama.cpp sampler it ends {gap:.3f} below fp32 against a '
        f"spread of {acc['fp32/ppo']['std'] + acc['q4_0/ppo']['std']:.3f} ({w['collapsed']} of {n} runs fall ≥ 10 "
        f"points below their best at an evaluation, {fp32['collapsed']} of {n_fp32} at fp32: one-sided Fisher p = "
        f'{fisher_greater(w["collapsed"], n, fp32["collapsed"], n_fp32):.2f}); "a correction recovers it" is '
        f"**{_joined(recovers, '')}** (token TIS +{tis:.3f} over uncorrected at q4_0, against a spread of "
        f'{acc["q4_0/tis"]["std"] + acc["q4_0/ppo"]["std"]:.3f}); "sequence-level MIS beats token TIS" is '
        f"**{_joined(seq, '')}** (token TIS above TRL's sequence mask beyond the spread). With three seeds an arm, "
        f"{unseen(worse_row.mde, 'a q4_0 cost')} (a t-test)."
    )


def readme_confirmatory(results: Path = RESULTS) -> str:
    """The README's verdict on study 7, the confirmatory retest: each primary comparison's verdict by the protocol
    with its difference, interval and Holm-adjusted p; per rung; "pending" while a rung lacks seeds."""
    from experiments.confirm_collapse import RUNGS, SEEDS

    s = load("confirm_collapse", results)["summary"]
    text = ("Study 7 (the confirmatory retest of study 6's claims, ten fresh seeds per arm, Holm-adjusted permutation "
            f"tests, [protocol](docs/confirm-collapse.md)), rung 1 ({RUNGS[1][0]} steps): "
            f"{_rung_verdicts(s, len(RUNGS[1][1]) * len(SEEDS))}.")
    if s["rung2_called"]:
        rung2 = _rung2(s)
        text += (f" Rung 2 ({RUNGS[2][0]} steps, run because the first comparison of rung 1 is {_ladder_verdict(s)}): "
                 f"{_rung_verdicts(rung2, len(RUNGS[2][1]) * len(SEEDS))}.")
    if study_answer(s) is not None:
        answer = next(row for row in confirm_collapse(load("confirm_collapse", results)) if "its answer" in row.study)
        text += (f" The study's answer: **{study_answer(s)}** — {LADDER_ANSWER}; with ten seeds "
                 f"{unseen(answer.mde, 'a final-score cost of the 4-bit sampler')}.")
    return text


def readme_dose(results: Path = RESULTS) -> str:
    """The README's verdict on study 9 (dose-response), once complete: each hypothesis's verdict with its
    estimate, interval and Holm-adjusted p, then the study's answer; empty while runs are missing."""
    s = load("dose_response", results)["summary"]
    if not s.get("complete"):
        return ""
    h1, h2 = s["tests"]["H1"], s["tests"]["H2"]
    return (f"Study 9 (dose-response: samplers whose weights are rounded to 4, 3 and 2 bits, ten seeds an arm, "
            f"[protocol](docs/dose-study.md)): \"{DOSE_CLAIMS['H1']}\" is **{h1['verdict']}** (slope "
            f"{h1['slope']:+.3f} per dose rank, 95 % CI [{h1['ci95'][0]:+.3f}, {h1['ci95'][1]:+.3f}], Holm p = "
            f"{h1['p_holm']:.2g}, MDE {h1['mde_slope']:.3f}); \"{DOSE_CLAIMS['H2']}\" is **{h2['verdict']}** "
            f"(TIS − uncorrected {h2['difference']:+.3f} over the doses, 95 % CI [{h2['ci95'][0]:+.3f}, "
            f"{h2['ci95'][1]:+.3f}], Holm p = {h2['p_holm']:.2g}, MDE {h2['mde']:.3f}). Its answer: {s['answer']} "
            "The per-dose reading is in docs/results.md.")


def readme_fp16(results: Path = RESULTS) -> str:
    """The README's verdict on study 10 (fp16 on both sides): part A per model with its ratio and interval, and
    part B — its verdict with the difference, interval, p and the effect it could have seen, the collapses, the
    fp16 overflow skips and each arm's training-time k3 — or how many of its runs are in."""
    from experiments.fp16_study import CLAIM_RATIO, MODELS, SEEDS
    from experiments.power import detectable_ratio

    s = load("fp16_study", results)["summary"]
    if not s["complete_a"]:
        return ""
    part_a = []
    for model in MODELS:
        t = s["tests"][f"A:{model}"]
        seen = detectable_ratio(t["ratio"], t["ci95"][0], CLAIM_RATIO)
        could = (f"; exploratory, not in the protocol: an interval this wide shows ≥ {CLAIM_RATIO:.0f}× with 80 % power "
                 f"only for a true ratio near {seen:.1f}×" if t["verdict"] == "not reproduced" and seen is not None
                 else "")
        part_a.append(f"{model} **{t['verdict']}** ({t['ratio']:.1f}×, 95 % CI [{t['ci95'][0]:.1f}, "
                      f"{t['ci95'][1]:.1f}]{could})")
    text = (f"Study 10 (fp16 on both sides, [protocol](docs/fp16-study.md)), part A — {FP16_CLAIM}, by the audit's "
            f"k3 ratio of the bf16 pair to the fp16 pair: {'; '.join(part_a)}. ")
    b, arms = s["tests"].get("B"), s["arms"]
    if not s["complete_b"] or b is None:
        done = sum(a["seeds"] for a in arms.values())
        return text + f"Part B — {FP16_TRAIN_CLAIM}: **pending** ({done} of {2 * len(SEEDS)} runs finished)."
    fp16, bf16 = arms["fp16/ppo"], arms["bf16/ppo"]
    could = f"; {unseen(b['mde'])}" if b["verdict"] == "not reproduced" else ""
    return text + (f"Part B — {FP16_TRAIN_CLAIM}: **{b['verdict']}** (fp16/ppo − bf16/ppo = "
                   f"{b['difference']:+.3f}, 95 % CI [{b['ci95'][0]:+.3f}, {b['ci95'][1]:+.3f}], permutation p = "
                   f"{b['p_value']:.3g}{could}); sustained collapses {fp16['collapses']} (fp16) and {bf16['collapses']} "
                   f"(bf16) of ten, {fp16['overflow_skips']:.0f} fp16 overflow skips, training-time k3 "
                   f"{fp16['k3_median']:.2g} (fp16) against {bf16['k3_median']:.2g} (bf16).")


def _rung_verdicts(s: dict[str, Any], total: int) -> str:
    if not s["complete"]:
        return f"**pending** — {finished_runs(s)} of {total} runs finished"
    parts = []
    for key, t in s["tests"].items():
        hi, lo = key.split(" vs ")
        seen = mde_protocol(s["arms"][hi], s["arms"][lo], family=len(s["tests"]))
        could = f"; {unseen(seen)}" if t["verdict"] == NOT_REPRODUCED else ""
        parts.append(f'"{CONFIRM_CLAIMS[key].split(" (")[0]}" is **{t["verdict"]}** ({key.replace(" vs ", " − ")} = '
                     f"{t['difference']:+.3f}, 95 % CI [{t['ci95'][0]:+.3f}, {t['ci95'][1]:+.3f}], Holm p = "
                     f"{t['p_holm']:.3g}{could})")
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _study_verdicts(study: str, results: Path = RESULTS) -> str:
    return verdict_list(rows(study, results))


BLOCKS: dict[str, tuple[str, Callable[[Path], str]]] = {
    "summary": ("docs/results.md", lambda res: summary_table([x for s in STUDIES for x in rows(s, res)])),
    **{f"verdicts:{s}": (spec.page, partial(_study_verdicts, s)) for s, spec in STUDIES.items()},
    "verdicts": ("README.md", lambda res: "\n\n".join(
        [readme_sentence(res), readme_confirmatory(res),
         *filter(None, [readme_dose(res), readme_fp16(res), readme_correction(res)])])),
    "exploratory:pooled": ("docs/results.md", lambda res: _pooled_paragraph(res)),
    "recipe:instruct": ("docs/tasks.md", lambda res: _recipe_text(res)),
    "multi-turn:results": ("docs/multi-turn.md", lambda res: _multi_turn_text(res)),
    "recipe:calculator": ("docs/multi-turn.md", lambda res: _calculator_text(res)),
    "bench:trl": ("docs/performance.md", lambda res: _bench_table(REPO / "benchmarks/results/bench_trl.txt")),
    "bench:multi_turn": ("docs/multi-turn.md",
                         lambda res: _bench_markdown(REPO / "benchmarks/results/bench_multi_turn.txt")),
    "perf:multi_turn": ("docs/performance.md",
                        lambda res: _bench_markdown(REPO / "benchmarks/results/bench_multi_turn.txt")),
    "audit:diagnosis": ("docs/audit.md", lambda res: _diagnosis_text(res)),
    "bench:exact": ("docs/precision.md", lambda res: _bench_table(REPO / "benchmarks/results/bench_exact.txt")),
    "bench:verl": ("docs/performance.md",
                   lambda res: _bench_table(REPO / "benchmarks/results/bench_correction_verl.txt")),
    "bench:verl_ratios": ("docs/performance.md",
                          lambda res: verl_ratio_text(REPO / "benchmarks/results/bench_correction_verl.txt")),
    "bench:speed": ("README.md", lambda res: readme_speed(REPO / "benchmarks/results/bench_correction_verl.txt")),
    "bench:scaling": ("docs/performance.md", lambda res: _bench_table(REPO / "benchmarks/results/bench_scaling.txt")),
    "bench:scaling_reading": ("docs/performance.md",
                              lambda res: scaling_text(REPO / "benchmarks/results/bench_scaling.txt")),
    "bench:steps": ("docs/performance.md",
                    lambda res: _bench_table(REPO / "benchmarks/results/bench_correction_steps.txt")),
    "bench:steps_reading": ("docs/performance.md",
                            lambda res: steps_text(REPO / "benchmarks/results/bench_correction_steps.txt")),
    "bench:analyze": ("docs/analyze.md", lambda res: analyze_bench_text(REPO / "benchmarks/results/bench_analyze.txt")),
    "bench:measure_engines": ("docs/training.md",
                              lambda res: _fenced(REPO / "benchmarks/results/measure_engines_builtin.txt")),
    "observation:sampler_vs_generate": ("docs/engines.md", lambda res: _sampler_vs_generate(res)),
    "exploratory:fp16_moe": ("docs/precision.md", lambda res: _fp16_moe_paragraph(res)),
    "reading:dose_response": ("docs/results.md", lambda res: dose_reading(load("dose_response", res))),
    "reading:correction_study": ("docs/results.md",
                                 lambda res: correction_reading(load("correction_study", res), _correction_runs(res))),
    "bench:startup": ("docs/performance.md",
                      lambda res: _bench_table(REPO / "benchmarks/results/bench_startup.txt")),
    "bench:read_ab": ("docs/performance.md",
                      lambda res: _bench_table(REPO / "benchmarks/results/bench_analyze_read_ab.txt")),
    "bench:distributed": ("docs/performance.md", lambda res: _fenced(REPO / "benchmarks/results/bench_distributed.txt")),
    "bench:distributed_reading": ("docs/performance.md",
                                  lambda res: distributed_text(REPO / "benchmarks/results/bench_distributed.txt")),
}


def dose_reading(results: dict) -> str:
    """Study 9's per-dose reading: the protocol's secondary comparisons (each arm against fp32/ppo), which carry
    no verdict, said with their intervals, collapses and minimum detectable effects (80 % power)."""
    s = results["summary"]
    if not s.get("complete"):
        return ""
    sec, arms = s["secondary"], s["arms"]
    fp32 = arms["fp32/ppo"]["final_score_mean"]

    def cost(arm: str) -> str:
        t = sec[f"{arm} vs fp32/ppo"]
        lo, hi = t["ci95"]
        return f"{t['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}], {t['collapses'][0]} of 10 collapsed, MDE {t['mde']:.3f}"

    def recovered(dose: str) -> str:
        lost = sec[f"{dose}/ppo vs fp32/ppo"]["difference"]
        kept = sec[f"{dose}/tis vs fp32/ppo"]["difference"]
        return f"{(kept - lost) / -lost:.0%}" if lost < 0 else "n/a"

    def by_rule(dose: str) -> str:
        above = arms[f"{dose}/tis"]["final_score_mean"] > arms[f"{dose}/ppo"]["final_score_mean"]
        below = sec[f"{dose}/tis vs fp32/ppo"]["ci95"][1] < 0
        return "recovers" if above and not below else "does not recover"

    k3 = {d: arms[f"{d}/ppo"]["training_mismatch_median"]["k3_kl"] for d in ("rtn4", "rtn3", "rtn2")}
    lines = [
        "**Reading by dose (the protocol's secondary comparisons, each arm against fp32/ppo at "
        f"{fp32:.3f}; no verdict).** Uncorrected: rtn4 {cost('rtn4/ppo')}; rtn3 {cost('rtn3/ppo')}; rtn2 "
        f"{cost('rtn2/ppo')}. Token TIS: rtn4 {cost('rtn4/tis')}; rtn3 {cost('rtn3/tis')}; rtn2 {cost('rtn2/tis')}. "
        f"Of the uncorrected loss, TIS recovered {recovered('rtn3')} at rtn3 and {recovered('rtn2')} at rtn2; by "
        f"study 6's rule (above uncorrected, and not below fp32: its interval against fp32 reaches 0) it "
        f"{by_rule('rtn4')} at rtn4, {by_rule('rtn3')} at rtn3 and {by_rule('rtn2')} at rtn2 (per-dose "
        "differences carry no test). "
        f"The training k3 (median over each arm's runs) was {k3['rtn4']:.4f} at rtn4, {k3['rtn3']:.4f} at rtn3 "
        f"and {k3['rtn2']:.3f} at rtn2.",
    ]
    return "\n".join(lines)


def analyze_bench_text(path: Path) -> str:
    """docs/analyze.md's large-dump paragraph: the committed bench_analyze output, and what it says."""
    import re

    text = path.read_text()
    rows = []
    for line in text.splitlines():
        m = re.match(r"^(jsonl|parquet)\s+([\d,]+)\s+[\d,]+\s+[\d.]+\s+(\d+)\s+([\d.]+)\s+([\d.]+) M\s+([\d.]+) M"
                     r"(?:\s+([\d.]+) M)?$", line)
        if m:  # format, tokens, peak RSS MB, analyze M tokens/s, reading M tokens/s (wall), (per CPU second)
            rows.append((m[1], int(m[2].replace(",", "")), int(m[3]), float(m[5]), float(m[6]),
                         float(m[7]) if m[7] else None))
    ratio = re.search(r"tokens: jsonl ([\d.]+), parquet ([\d.]+)", text)
    ceiling = re.search(r"orjson.loads alone .*?: ([\d.]+) M tokens/s", text)

    def span(fmt: str, i: int) -> str:
        values = [r[i] for r in rows if r[0] == fmt]
        return f"{min(values):.2f}–{max(values):.2f}"

    largest = max(r[1] for r in rows)
    peak = {fmt: next(r[2] for r in rows if r[0] == fmt and r[1] == largest) for fmt in ("jsonl", "parquet")}
    where = re.search(r"^machine: ([^;]+)", text, re.M)
    earlier = re.search(r"^not rerun: (\S+) tokens.*?machine: ([^;]+); the reader of commit (\w+)", text, re.M)
    note = ""
    if earlier:  # rows kept from an earlier run on another machine and reader, said so
        power = str(len(str(int(float(earlier[1])))) - 1).translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))
        note = (f" The 10{power}-token rows at the end are an earlier run's, not rerun here ({earlier[2]}, the reader "
                f"of commit {earlier[3]}): they show the memory bound at that size, not this reader's speed.")
    return (_fenced(path) + "\n\n"
            f"Peak memory grows {ratio[1]}× (JSONL) and {ratio[2]}× (Parquet) from 10⁶ to 10{str(len(str(largest)) - 1).translate(str.maketrans('0123456789', '⁰¹²³⁴⁵⁶⁷⁸⁹'))} tokens: "
            f"bounded, {peak['jsonl']} MB and {peak['parquet']} MB at the largest size. A whole `rollcorr analyze` "
            f"reads and corrects {span('jsonl', 3)} M tokens/s from JSONL and {span('parquet', 3)} M tokens/s from "
            f"Parquet (imports included); reading alone is {span('jsonl', 4)} M tokens/s (JSONL) and "
            f"{span('parquet', 4)} M tokens/s (Parquet), where decoding the JSON lines alone (orjson) reaches "
            f"{ceiling[1]} M tokens/s on this machine ({where[1] if where else 'see its first lines'})."
            + _reading_target(rows) + note)


def _reading_target(rows: list[tuple]) -> str:
    """#38's reading target (≥ 5 M tokens/s from 10⁶ tokens up), as the committed rows measured it."""
    big = [r for r in rows if r[1] >= 10**6]
    if not big:
        return ""
    slowest = {fmt: min(r[4] for r in big if r[0] == fmt) for fmt in ("jsonl", "parquet")}
    met = all(v >= 5.0 for v in slowest.values())
    return (f" From 10⁶ tokens up, reading is never slower than {slowest['jsonl']:.2f} M tokens/s (JSONL) and "
            f"{slowest['parquet']:.2f} M tokens/s (Parquet): {'at or above' if met else 'below'} the 5 M asked.")


def _fenced(path: Path) -> str:
    """A committed command output, verbatim in a code block."""
    return "```\n" + path.read_text().rstrip("\n") + "\n```"


def bench_rows(path: Path) -> list[dict[str, str]]:
    """A benchmark's committed ``a | b`` output as rows keyed by its header."""
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    header = [c.strip() for c in lines[0].split("|")]
    return [dict(zip(header, (c.strip() for c in line.split("|")))) for line in lines[1:]]


def distributed_text(path: Path) -> str:
    """docs/performance.md's reading of ``benchmarks/bench_distributed.py``'s committed output."""
    text = path.read_text()

    def number(pattern: str) -> float:
        found = re.search(pattern, text)
        if found is None:
            raise ValueError(f"{path}: no line matches {pattern!r}")
        return float(found.group(1))

    cases = ("N=1", "N=1, half the batch", "N=2 replicate", "N=2 replicate over gloo", "N=2 shard")
    ms = {case: number(rf"default run, {case}: [\d.]+ steps/s \((\d+) ms/step\)") for case in cases}
    ratio = {case: number(rf"default run, {case}: .*steps/s ratio to N=1 ([\d.]+)") for case in cases}
    parts = {case: [float(x) for x in re.search(rf"parts, {case} \| ([\d |]+)$", text, re.M).group(1).split(" | ")]
             for case in cases}  # generate, old_log_prob, correction, optimize, loss_forward, backward, optimizer,
    rest = {case: parts[case][7] for case in cases}  # optimize's rest (ms)
    steps = {case: number(rf"builtin model, {case}: ([\d.]+) steps/s") for case in ("N=1", "N=2 replicate", "N=2 shard")}
    wide = {case: number(rf"wide model, {case}: .*steps/s ratio ([\d.]+)") for case in ("N=2 replicate", "N=2 shard")}
    rss = {case: number(rf"wide model, {case}: peak RSS per rank \(max over ranks\) / N=1's ([\d.]+)")
           for case in ("N=2 replicate", "N=2 shard")}
    stall = number(r"every rank scoring every row [\d.]+; ratio ([\d.]+)")
    met = ratio["N=2 replicate"] >= 1.3
    half, gloo = "N=1, half the batch", "N=2 replicate over gloo"
    return "\n".join([
        f"- **The default run at N = 2{'' if met else ' is not 1.3× faster here'}.** The built-in model's step is "
        f"{ms['N=2 replicate']:.0f} ms replicated against {ms['N=1']:.0f} ms in one process "
        f"({ratio['N=2 replicate']:.2f}× the steps/s; sharded {ratio['N=2 shard']:.2f}×): the target (≥ 1.3) is "
        f"{'met' if met else 'not met'} on this model. One process on half the batch — one rank's work without any "
        f"communication — takes {ms[half]:.0f} ms ({ratio[half]:.2f}×), the most N = 2 could reach here: on a "
        "1 M-parameter model a step's per-operation costs do not halve with the rows. The rest is the collectives "
        f"and the waits between the ranks (\"optimize's rest\" {rest['N=2 replicate']:.0f} ms against "
        f"{rest[half]:.0f} ms on half the batch). With the same collectives over gloo's sockets instead of shared "
        f"memory the step is {ms[gloo]:.0f} ms ({ratio[gloo]:.2f}×; \"optimize's rest\" {rest[gloo]:.0f} ms).",
        f"- **Where compute dominates, data-parallel pays.** `train_step` alone on the built-in model through "
        f"transformers' decoder forward: {steps['N=2 replicate'] / steps['N=1']:.2f}× replicated, "
        f"{steps['N=2 shard'] / steps['N=1']:.2f}× sharded; the wide model: {wide['N=2 replicate']:.2f}× "
        f"replicated, {wide['N=2 shard']:.2f}× sharded.",
        f"- **Memory.** Sharded, parameters and AdamW state per rank are exactly 1/N and the peak resident memory "
        f"per rank after a step is {rss['N=2 shard']:.2f} of one process's; replicated it is "
        f"{rss['N=2 replicate']:.2f} (every rank holds everything, which `auto` allows only while the training "
        "state fits a quarter of a rank's memory).",
        f"- **The `interrupt` stall** (sharded): scoring the in-flight rows every rank holds, split over the ranks "
        f"and gathered (`proximal.scoring.score_split`), costs each rank {stall:.2f} of the CPU seconds of every "
        "rank scoring every row.",
    ])


def verl_ratios(path: Path) -> dict[str, dict[str, tuple[float, float]]]:
    """Per shape of ``benchmarks/bench_correction.py``'s committed output, the (min, max) over its cases of
    verl / rollcorr, verl / plain (when the file has it), verl / drop-in, rollcorr / floor and exp / floor (when the
    file has it)."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for row in bench_rows(path):
        cells = out.setdefault(row["shape"], {})
        for key in ("verl / rollcorr", "verl / plain", "verl / drop-in", "rollcorr / floor", "exp / floor"):
            if key not in row:
                continue
            lo, hi = cells.get(key, (math.inf, -math.inf))
            cells[key] = (min(lo, float(row[key])), max(hi, float(row[key])))
    return out


def _span(pair: tuple[float, float], digits: int = 1) -> str:
    lo, hi = pair
    return f"{lo:.{digits}f}×" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else f"{lo:.{digits}f}–{hi:.{digits}f}×"


def verl_ratio_text(path: Path) -> str:
    """docs/performance.md's reading of the verl table: the ratios per shape, the drop-in's, the floor's."""
    ratios = verl_ratios(path)
    shapes = list(ratios)
    per_shape = "; ".join(f"{_span(ratios[s]['verl / rollcorr'])} at {s}" for s in shapes)
    drop_in = "; ".join(f"{_span(ratios[s]['verl / drop-in'])} at {s}" for s in shapes)
    floor = "; ".join(f"{_span(ratios[s]['rollcorr / floor'], 0)} at {s}" for s in shapes)
    plain = "; ".join(f"{_span(ratios[s]['verl / plain'])} at {s}" for s in shapes if "verl / plain" in ratios[s])
    plain = f"Without the built kernel (the plain-torch pass): {plain}. " if plain else ""
    exp = "; ".join(f"{_span(ratios[s]['exp / floor'])} at {s}" for s in shapes if "exp / floor" in ratios[s])
    exp = (f"One exponential a position (`torch.exp` of the log-probs into a buffer, SLEEF's 1-ulp `exp`) over one "
           f"read of the inputs: {exp}. " if exp else "")
    return (f"verl's CPU time over the default's, per shape (the three cases): {per_shape}. {plain}The verl drop-in "
            f"(verl's signature, floats out): {drop_in}. The default's time over one read of its inputs: {floor}. "
            + exp + verl_ops_text(path) + verl_targets_text(ratios))


def verl_ops_text(path: Path) -> str:
    """The tensor operations a call dispatches at the smallest shape (the table's ``ops`` columns), per case."""
    rows = bench_rows(path)
    if not rows or "rollcorr ops" not in rows[0]:
        return ""
    small = [r for r in rows if r["shape"] == rows[0]["shape"]]
    cases = ", ".join(f"{r['case']} {r['rollcorr ops']} against {r['verl ops']}" for r in small)
    return f"Tensor operations a call dispatches at {small[0]['shape']}, the default's against verl's: {cases}. "


VERL_TARGETS = (1.0, 3.0, 3.0)  # #51: verl / default ≥ 1× at the smallest shape, ≥ 3× above; default ≤ 3× the floor


def verl_targets_text(ratios: dict[str, dict[str, tuple[float, float]]]) -> str:
    """Issue #51's targets against the table, shape by shape: verl / default at least 1× at the smallest shape and
    3× from the second up, the default within 3× of the read floor from the second up (every case must meet it)."""
    small_ratio, large_ratio, floor_ratio = VERL_TARGETS
    shapes = list(ratios)
    speed = []
    for i, shape in enumerate(shapes):
        want = small_ratio if i == 0 else large_ratio
        lo = ratios[shape]["verl / rollcorr"][0]
        speed.append(f"{shape} {'met' if lo >= want else 'not met'} (≥ {want:g}×; lowest case {lo:.2f}×)")
    floor = []
    for shape in shapes[1:]:
        hi = ratios[shape]["rollcorr / floor"][1]
        floor.append(f"{shape} {'met' if hi <= floor_ratio else 'not met'} (≤ {floor_ratio:g}×; highest case {hi:.0f}×)")
    return (f"Issue #51's targets, per shape (every case): verl / default — {'; '.join(speed)}. Default / read floor — "
            f"{'; '.join(floor)}.")


def readme_speed(path: Path) -> str:
    """The README's speed sentence, from the verl table: verl's CPU time over the default's from the second shape
    up, and at the smallest shape (said as slower where it is below 1, in every case or in one)."""
    ratios = verl_ratios(path)
    shapes = list(ratios)
    small, large = shapes[0], shapes[1:]
    lo = min(ratios[s]["verl / rollcorr"][0] for s in large)
    hi = max(ratios[s]["verl / rollcorr"][1] for s in large)
    at_small = ratios[small]["verl / rollcorr"]
    slower = (" (slower: each call's fixed cost dominates there)" if at_small[1] < 1 else
              " (below 1×, slower, in a case: each call's fixed cost dominates there)" if at_small[0] < 1 else "")
    return (f"With every metric on and nothing compiled during the run, verl's own helper takes {lo:.1f}–{hi:.1f}× "
            "the CPU time of "
            f"`compute_correction` on batches from {large[0]} to {large[-1]} positions, and "
            f"{_span(at_small, 2)} at {small}{slower} (one thread, one run on a shared machine whose load the file "
            "states: [benchmarks/results/bench_correction_verl.txt](benchmarks/results/bench_correction_verl.txt), "
            "[docs/performance.md](docs/performance.md#the-correction-compute_correction)).")


def scaling_tables(path: Path) -> dict[str, list[dict[str, str]]]:
    """``benchmarks/bench_scaling.py``'s committed output: each sweep's rows keyed by its header, by swept key."""
    tables: dict[str, list[dict[str, str]]] = {}
    header: list[str] = []
    for line in (x for x in path.read_text().splitlines() if x and not x.startswith("#")):
        cells = [c.strip() for c in line.split("|")]
        if not cells[1].isdigit():
            header = cells
            tables[cells[0]] = []
        else:
            tables[header[0]].append(dict(zip(header, cells)))
    return tables


def scaling_text(path: Path) -> str:
    """docs/performance.md's reading of the step-time sweeps: CPU per token and growth over linear per sweep."""
    names = {"rollout.prompts_per_step": "prompts per step", "rollout.max_new_tokens": "max_new_tokens",
             "rollout.group_size": "group size"}
    parts, worst = [], 0.0
    for key, rows in scaling_tables(path).items():
        per_token = [float(r["CPU ms / token"]) for r in rows]
        growth = [float(r["growth / linear"]) for r in rows[1:]]
        worst = max(worst, *growth)
        parts.append(f"{names.get(key, key)} {rows[0][key]} → {rows[-1][key]}: {per_token[0]:.2f} → {per_token[-1]:.2f} "
                     f"CPU ms per response token, growth / linear {min(growth):.2f}–{max(growth):.2f}")
    verdict = "no sweep grew super-linearly" if worst <= 1.0 else f"the largest growth / linear is {worst:.2f}"
    return (f"{'; '.join(parts)}: {verdict} (1.0 is linear; below it the per-step costs that do not grow with the "
            "batch — orchestration, the optimizer update, metrics and logging — are shared by more tokens).")


def steps_text(path: Path) -> str:
    """docs/performance.md's reading of ``benchmarks/bench_correction_steps.py``'s committed output."""
    rows = {r["seconds per step"]: r for r in bench_rows(path)}
    steps = re.search(r"# (\d+) steps at B x T = (\d+ x \d+)", path.read_text())
    cpu, wall = rows["CPU"], rows["wall"]
    return (f"Over {steps.group(1)} steps at {steps.group(2)} the slowest step took {cpu['max / median']}× the median "
            f"CPU time ({cpu['max']} s against {cpu['median']} s), and {cpu['steps over 3x median']} steps were over 3× "
            f"it; by the wall clock, which counts the waits for a core on a shared machine, {wall['max / median']}× "
            f"and {wall['steps over 3x median']} steps.")


def _sampler_vs_generate(results: Path) -> str:
    from experiments.sampler_vs_generate import paragraph

    return paragraph(results / "sampler_vs_generate")


def _fp16_moe_paragraph(results: Path) -> str:
    from experiments.fp16_exploratory import paragraph

    return paragraph(results / "fp16_study" / "audits")


def _diagnosis_text(results: Path) -> str:
    from experiments.audit_diagnosis import diagnosis_text

    return diagnosis_text(results / "audit_diagnosis")


def _bench_table(path: Path) -> str:
    """A benchmark's committed output (``a | b | c`` rows, ``#`` lines) as a markdown table with its notes."""
    lines = path.read_text().splitlines()
    notes = [line.lstrip("# ") for line in lines if line.startswith("#")]
    out, header = [], None
    for line in (line for line in lines if not line.startswith("#")):
        cells = [c.strip() for c in line.split("|")]
        if header is None or not any(c.replace(".", "").isdigit() for c in cells[1:]):
            header = cells
            out += ["", "| " + " | ".join(cells) + " |", "|" + "---|" * len(cells)]
        else:
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join([f"*{'; '.join(notes)}*"] + out)


def _bench_markdown(path: Path) -> str:
    """A benchmark's committed output that prints a markdown table itself: its ``#`` lines as the notes, then
    the table as it is."""
    lines = path.read_text().splitlines()
    notes = [line.lstrip("# ") for line in lines if line.startswith("#")]
    return "\n".join([f"*{'; '.join(notes)}*", "", *(line for line in lines if line.startswith("|"))])


def _recipe_text(results: Path) -> str:
    from experiments.instruct_recipe import recipe_text

    return recipe_text(load("instruct_recipe", results))


def _multi_turn_text(results: Path) -> str:
    from experiments.multi_turn import results_text

    return results_text(load("multi_turn", results))


def _calculator_text(results: Path) -> str:
    from experiments.calculator_recipe import recipe_text

    return recipe_text(load("calculator_recipe", results))


def _pooled_paragraph(results: Path) -> str:
    from experiments.pooled import paragraph

    return paragraph(load("pooled", results))


def block_pattern(name: str) -> re.Pattern[str]:
    """``<!-- NAME:begin -->`` newline, the block's text (group 2, ending with a newline unless empty), ``<!-- NAME:end -->``."""
    return re.compile(rf"(<!-- {re.escape(name)}:begin -->\n)(.*?)(<!-- {re.escape(name)}:end -->)", re.S)


def stale_blocks(results: Path = RESULTS, repo: Path = REPO) -> dict[str, tuple[str, str]]:
    """{block: (in the file, generated)} for every block whose text differs from what the results give."""
    out = {}
    for name, (file, make) in BLOCKS.items():
        text = (repo / file).read_text()
        found = block_pattern(name).search(text)
        if found is None:
            raise ValueError(f"{file}: no <!-- {name}:begin --> … <!-- {name}:end --> block")
        want = make(results) + "\n"
        if found.group(2) != want:
            out[name] = (found.group(2), want)
    return out


def write_blocks(results: Path = RESULTS, repo: Path = REPO) -> list[str]:
    """Rewrite every stale block in place; returns the names rewritten."""
    stale = stale_blocks(results, repo)
    for name, (_, want) in stale.items():
        path = repo / BLOCKS[name][0]
        text = path.read_text()
        found = block_pattern(name).search(text)
        path.write_text(text[: found.start(2)] + want + text[found.end(2) :])
    return list(stale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the generated blocks of the docs")
    parser.add_argument("--check", action="store_true", help="exit 1 when a generated block is stale")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"experiments.summary: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.write:
        print("rewrote: " + (", ".join(write_blocks()) or "nothing (every block is current)"))
        return 0
    if args.check:
        stale = stale_blocks()
        for name in stale:
            print(f"stale: {name} ({BLOCKS[name][0]}); run python -m experiments.summary --write")
        return 1 if stale else 0
    print(summary_table([x for s in STUDIES for x in rows(s)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
