""""Is this level normal?" (issue 50 item 5): the level placed by a statistic one token cannot move across a band,
its interval drawn, bands whose edges are their sources', maxima compared only over as many tokens, exact
intervals for shares with no hit, labels inside the figure, and a verdict that leaves the cause to --localize."""

import json
from pathlib import Path

import pytest
import torch

from rollcorr.audit import levels
from rollcorr.audit.levels import (
    K3_BANDS,
    bands_of,
    exact_interval,
    median_of_means,
    row_hits,
    share_intervals,
)
from rollcorr.audit.stats import audit_stats, median_max_over

RESULTS = Path(__file__).resolve().parents[1] / "experiments/results/audit_diagnosis"


def test_a_share_with_no_hit_gets_the_exact_upper_bound_not_zero():
    """145 tokens and no hit: the bootstrap's every resample is 0, so it said [0, 0]; Clopper-Pearson says
    [0, 1 − 0.025^(1/145)] ≈ 2.5 % (the rule of three's one-sided 3/145 ≈ 2.1 %)."""
    abs_diff = torch.full((29, 5), 0.02)  # every token ≥ 0.01, none ≥ 0.05: shares 1 and 0
    mask = torch.ones(29, 5, dtype=torch.bool)
    out = share_intervals(*row_hits(abs_diff, mask), n=200)
    assert out["ge_0.05"]["share"] == 0.0
    assert out["ge_0.05"]["ci95"] == pytest.approx([0.0, 1 - 0.025 ** (1 / 145)], rel=1e-12)
    assert 0.02 < out["ge_0.05"]["ci95"][1] < 0.026
    assert out["ge_0.01"]["ci95"] == pytest.approx([0.025 ** (1 / 145), 1.0], rel=1e-12)  # all hits: mirrored
    assert exact_interval(3, 145) is None  # a share strictly inside (0, 1) keeps the bootstrap's spread
    assert exact_interval(0, 0) is None


def test_median_of_means_is_the_median_of_group_token_means_and_one_token_cannot_move_it_far():
    counts = torch.tensor([2.0, 3, 0, 1, 4, 2, 2, 5, 1, 3], dtype=torch.float64)  # response 2 has no token: left out
    sums = torch.tensor([0.2, 0.6, 0.0, 0.1, 0.4, 0.4, 0.2, 0.5, 0.1, 0.3], dtype=torch.float64)
    # the 9 responses with a token in 5 consecutive groups (i * 5 // 9): {0, 1} {3, 4} {5, 6} {7, 8} {9}
    means = [0.8 / 5, 0.5 / 5, 0.6 / 4, 0.6 / 6, 0.3 / 3]  # 0.16 0.1 0.15 0.1 0.1
    assert median_of_means(sums, counts) == pytest.approx(sorted(means)[2], rel=1e-15)  # 0.1
    spiked = sums.clone()
    spiked[7] += 1e3  # one off-distribution token: the token mean moves 300-fold, the median to a neighbour's mean
    assert median_of_means(spiked, counts) == pytest.approx(sorted(means)[3], rel=1e-15)  # 0.15
    assert float(spiked.sum() / counts.sum()) > 300 * float(sums.sum() / counts.sum())
    assert median_of_means(sums[:2], counts[:2]) == pytest.approx((0.1 + 0.2) / 2)  # fewer responses than groups


def test_median_max_over_n_tokens_is_the_quantile_at_half_to_the_one_over_n():
    """The median of the max of n draws is F⁻¹(0.5^(1/n)); from all tokens or only the largest ones alike."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.rand(5000, generator=g, dtype=torch.float64) ** 4
    ordered = tokens.sort(descending=True).values
    for n in (1, 10, 294, 4999):
        want = float(torch.quantile(tokens, 0.5 ** (1 / n)))
        assert median_max_over(ordered, 5000, n) == pytest.approx(want, rel=1e-12)
        need = 5000 - int(4999 * 0.5 ** (1 / n))
        assert median_max_over(ordered[:need], 5000, n) == pytest.approx(want, rel=1e-12)
        assert median_max_over(ordered[: need - 1], 5000, n) is None  # the quantile is below what was kept
    assert median_max_over(ordered[:300], 293, 294) is None  # fewer tokens than the max is over: no estimate
    draws = tokens[torch.randint(0, 5000, (4001, 294), generator=g)].amax(dim=1)  # simulated: within sampling error
    assert float(draws.median()) == pytest.approx(median_max_over(ordered, 5000, 294), rel=0.05)


def test_each_bands_edges_hold_its_own_measured_pairs_read_from_their_results():
    """A band's edges are the widest its sources go: a measured pair is never drawn outside its own kind's band,
    and the pairs rollcorr measured are the committed audits' k3 (SmolLM2's plain bf16 pair in the dense band)."""
    audits = {p.parent.name: json.loads(p.read_text()) for p in RESULTS.glob("*/summary.json")}
    ours = {"SmolLM2-135M, hf:bf16": audits["smollm2_hf_bf16"], "SmolLM2-135M, vllm:bf16 (CPU build)":
            audits["smollm2_vllm_bf16"]}
    seen = set()
    for band in K3_BANDS:
        lo, hi = band.edges
        assert lo <= band.quoted[0] and band.quoted[1] <= hi
        for m in band.measured:
            assert lo <= m.k3 <= hi and band.name in bands_of(m.k3)
            if m.label in ours:
                assert m.k3 == pytest.approx(ours[m.label]["divergence"]["k3_kl"], rel=5e-3), m.label
                seen.add(m.label)
    assert seen == set(ours)
    dense = next(b for b in K3_BANDS if b.name == "dense models")
    assert dense.quoted[1] < audits["smollm2_hf_bf16"]["divergence"]["k3_kl"] <= dense.edges[1]


@pytest.fixture(scope="module")
def builtin_bf16_512():
    """The built-in model's default audit (hf:bf16 against hf:fp32, temperature 1, 64 new tokens, seed 0,
    batches of 8) at -n 512: its first 32 and 128 responses are the -n 32 and -n 128 audits (the same prompts,
    batch i seeded seed + i)."""
    from rollcorr.audit.collect import builtin_prompts, collect, from_rollout
    from rollcorr.engines import SamplingParams, make_learner, make_sampler

    torch.manual_seed(0)
    params = SamplingParams(max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0, seed=0)
    rollout = collect(make_sampler("hf:bf16"), make_learner("hf:fp32"), builtin_prompts(512), params, batch_size=8)
    return from_rollout(rollout)


def test_the_builtin_bf16_audit_is_placed_in_one_band_at_32_128_and_512_responses(builtin_bf16_512):
    """The token mean of k3 moved across the dense/MoE boundary with one token (issue 50: 2.3e-4, 1.5e-3,
    5.7e-4); the median of group means places all three in the same band, inside each one's bootstrap interval
    of the token mean."""
    data, placed, means = builtin_bf16_512, {}, {}
    for n in (32, 128, 512):
        stats = audit_stats(data.rollout_log_prob[:n], data.old_log_prob[:n], data.response_mask[:n])
        level = stats["k3_level"]
        assert level["mean"] == pytest.approx(stats["divergence"]["k3_kl"], rel=1e-9)
        lo, hi = level["ci95"]
        assert lo <= level["mean"] <= hi and lo < hi
        placed[n] = tuple(level["bands"])
        means[n] = level["mean"]
    assert placed == dict.fromkeys((32, 128, 512), ("dense models",))
    dense = next(b for b in K3_BANDS if b.name == "dense models")  # what the token mean alone did (docs/audit.md)
    assert means[128] > dense.quoted[1] > max(means[32], means[512])


def test_the_levels_figure_draws_the_interval_and_keeps_every_label_inside(builtin_bf16_512):
    from rollcorr.audit import plots

    data = builtin_bf16_512
    stats = audit_stats(data.rollout_log_prob[:128], data.old_log_prob[:128], data.response_mask[:128])
    stats["whatif"] = [{"change": "fp16", "k3_kl": 2.1e-6}, {"change": "batch", "k3_kl": 0.0}]
    fig = plots.levels_figure(stats)
    ax = fig.axes[0]
    bars = [c for c in ax.containers if c.__class__.__name__ == "ErrorbarContainer"]
    assert len(bars) == 1  # the token mean's 95 % interval
    (segment,) = bars[0].lines[2][0].get_segments()
    assert [x for x, _ in segment] == pytest.approx(stats["k3_level"]["ci95"], rel=1e-9)
    renderer = fig.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    assert len(ax.texts) >= len(K3_BANDS) + 4
    for text in ax.texts:
        extent = text.get_window_extent(renderer)
        assert box.x0 - 0.5 <= extent.x0 and extent.x1 <= box.x1 + 0.5, text.get_text()
        assert text.get_fontsize() >= 5


def test_maxima_are_compared_only_over_as_many_tokens(tmp_path):
    """The reference table's max row is this audit's median max over a reference's token count (294), never its
    own max over all its tokens; a reference whose count is unknown (ABEJA) has its max said but not compared."""
    from rollcorr.audit import AuditData, write_report
    from rollcorr.audit.report import _num, reference_rows
    from rollcorr.audit.verdict import REFERENCES

    g = torch.Generator().manual_seed(0)
    log_old = -torch.rand(40, 30, generator=g, dtype=torch.float64) * 3
    log_mu = (log_old + 0.03 * torch.randn(40, 30, generator=g, dtype=torch.float64)).clamp(max=0)
    data = AuditData(log_mu, log_old, torch.ones(40, 30, dtype=torch.bool), source={"model": "builtin"})
    summary = write_report(data, tmp_path)
    abs_diff = (log_mu.exp() - log_old.exp()).abs().flatten()
    want = float(torch.quantile(abs_diff, 0.5 ** (1 / 294)))
    assert summary["max_over_tokens"] == {"294": pytest.approx(want, rel=1e-12)}
    assert summary["probability"]["prob_diff_max"] > want  # its own max, over 1,200 tokens, is larger
    rows = {row[0]: row[1:] for row in reference_rows(summary)}
    assert "max |Δp|" not in rows and rows["max |Δp| over 294 tokens"][0] == _num(want)
    assert rows["max |Δp| over 294 tokens"][-1] == "—"  # ABEJA: tokens not given
    few = write_report(AuditData(log_mu[:9], log_old[:9], torch.ones(9, 30, dtype=torch.bool), source={"model": "builtin"}),
                       tmp_path / "few")  # 270 tokens: a max over 294 cannot be read from them
    assert few["max_over_tokens"] == {"294": None}
    assert {row[0]: row[1] for row in reference_rows(few)}["max |Δp| over 294 tokens"] == "—"
    assert "where this audit's is" not in few["verdict"][0]
    page = (tmp_path / "report.html").read_text()
    assert f"Its max |Δp| {REFERENCES['abeja_vllm_hf']['prob_diff_max']:.3g} is over a number of tokens" in page


def _bf16_summary(localized: bool) -> dict:
    from rollcorr.audit import AuditData
    from rollcorr.audit.report import build_summary

    g = torch.Generator().manual_seed(1)
    log_old = -torch.rand(64, 20, generator=g, dtype=torch.float64) * 2
    log_mu = (log_old + 0.02 * torch.randn(64, 20, generator=g, dtype=torch.float64)).clamp(max=0)
    found = {"localization": {"entry": "The divergence enters mostly at the layer 2 mlp: ..."}} if localized else {}
    return build_summary(AuditData(log_mu, log_old, torch.ones(64, 20, dtype=torch.bool), diagnosis=found))


def test_the_verdict_names_the_size_and_leaves_the_cause_to_the_localisation():
    """One perturbed tensor in an fp32 sampler read "as far apart as bf16 numerics usually put two engines"; with
    --localize run, the verdict says the size and points to the localisation for the cause."""
    plain, localized = _bf16_summary(False), _bf16_summary(True)
    assert plain["verdict_level"]["level"] == localized["verdict_level"]["level"] == "bf16"
    assert plain["verdict"][0].startswith("The engines are as far apart as bf16 numerics usually put")
    first = localized["verdict"][0]
    assert first.startswith('The mismatch is the size bf16 numerics leave between two engines holding one model (level "bf16")')
    assert "usually put" not in first and "the localisation's finding below" in first


def test_the_terminal_says_where_the_level_is_placed(capsys):
    from rich.console import Console

    from rollcorr.audit.report import level_sentence, print_summary

    summary = _bf16_summary(False)
    sentence = level_sentence(summary)
    level = summary["k3_level"]
    assert f"{level['robust']:.2g} (the median of {level['groups']} group means" in sentence
    print_summary(summary, Console(width=300, force_terminal=False))
    assert sentence in capsys.readouterr().out
    assert levels.K3_GROUPS == level["groups"]


def test_the_audit_page_says_what_the_code_does():
    """docs/audit.md's figures on the placement and the reference table are the code's constants."""
    import re

    from rollcorr.audit.verdict import REFERENCES

    page = " ".join((Path(__file__).resolve().parents[1] / "docs/audit.md").read_text(encoding="utf-8").split())
    dense, moe = (next(b for b in K3_BANDS if b.name == name) for name in ("dense models", "MoE models"))
    assert f"({dense.quoted[0]:.0e}–{dense.quoted[1]:.0e} dense, {moe.quoted[0]:.0e}–{moe.quoted[1]:.0e} MoE)".replace(
        "e-0", "e-") in page
    assert f"the token means of {levels.K3_GROUPS} consecutive groups of responses" in page
    assert f"(about {100 * exact_interval(0, 145)[1]:.1f} % at 145 tokens)" in page
    builtin = [r for r in REFERENCES.values() if r["model"] == "builtin"]
    assert {r["tokens"] for r in builtin} == {294}
    row = "| max over 294 tokens | " + " | ".join(f"{r['prob_diff_max']:.3g}" for r in builtin) + " | — |"
    assert row in page
    assert re.search(r"its max, ([\d.]+), is over a number of tokens", page).group(1) == \
        f"{REFERENCES['abeja_vllm_hf']['prob_diff_max']:.3g}"
