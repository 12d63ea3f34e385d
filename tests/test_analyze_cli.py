"""``rollcorr analyze`` end to end: the shipped sample, --json, --config YAML, --set, errors, explanations."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from rollcorr.analyze.analysis import analyze
from rollcorr.analyze.cli import DEFAULT_PRESET, load_config, parse_value, sample_dump_path
from rollcorr.cli import main
from rollcorr.config.presets import PRESETS, preset
from rollcorr.dumps import read_dump


@pytest.fixture
def dump_path(tmp_path):
    """48 responses with small noise, a few planted outliers, advantages, token text, and 2 bad lines."""
    rng = random.Random(0)
    lines = []
    for i in range(48):
        n = rng.randint(2, 7)
        old = [math.log(rng.uniform(0.05, 0.99)) for _ in range(n)]
        roll = [min(0.0, x + rng.gauss(0, 0.02)) for x in old]
        if i == 3:
            roll[1] = old[1] - 2.0  # ρ = e² ≈ 7.4: IcePop / TIS / token_k1 catch it
        if i == 7:
            old[0] = roll[0] - 11.0  # ρ ≈ 1.7e-5: the veto catches it
        lines.append(
            json.dumps(
                {
                    "rollout_log_probs": roll,
                    "old_log_probs": old,
                    "response_mask": [1] * n,
                    "advantages": [(-1.0) ** i] * n,
                    "token_text": [str(d) for d in range(n - 1)] + ["<eos>"],
                    "prompt": f"{i}+1=",
                }
            )
        )
    lines.insert(10, '{"rollout_log_probs": [-0.1], "old_log_probs": [')  # line 11: bad JSON
    lines.insert(
        20, json.dumps({"rollout_log_probs": [-0.1, -0.2], "old_log_probs": [-0.1]})
    )  # line 21: ragged
    path = tmp_path / "dump.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(capsys, *argv):
    code = main(["analyze", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def _ratios(path):
    dump = read_dump(path)
    return dump, torch.exp(dump.learner_log_prob - dump.rollout_log_prob)


def test_shipped_sample_runs_with_the_default_preset(capsys, tmp_path):
    assert sample_dump_path().is_file()
    assert sample_dump_path().stat().st_size < 1_000_000
    assert sample_dump_path().stat().st_mode & 0o044 == 0o044  # readable once installed
    code, out, err = _run(capsys, "--json", tmp_path / "m.json")
    assert code == 0, err
    for part in (
        "Diagnostics",
        f"preset {DEFAULT_PRESET}",
        "Most mismatched tokens",
        "Malformed rows skipped",
    ):
        assert part in out
    data = json.loads((tmp_path / "m.json").read_text())
    dump = read_dump(sample_dump_path())
    assert 64 <= len(dump) <= 200
    assert [m["line"] for m in data["malformed"]] == [m.line for m in dump.malformed]
    assert len(dump.malformed) >= 5
    for m in dump.malformed:  # every malformed line is shown with its number and reason
        assert m.reason[:30] in out
    assert data["responses"] == len(dump)
    assert data["metrics"]["rollout_corr/num_tokens"] == dump.num_tokens
    assert "In short" in out


def test_shipped_sample_is_a_real_low_precision_mismatch():
    """bf16 sampler vs fp32 learner on the built-in model: small but nonzero |ℓ|, texts match the tokens."""
    dump = read_dump(sample_dump_path())
    lr = (dump.learner_log_prob - dump.rollout_log_prob)[dump.response_mask]
    assert (lr != 0).float().mean() > 0.5  # precision changes almost every token's probability ...
    assert lr.abs().mean() < 0.1  # ... by a little
    for row in range(len(dump)):
        n = int(dump.response_mask[row].sum())
        assert "".join(dump.token_text[row][:n]).replace("<eos>", "") == dump.text[row]
    assert {r for r in dump.extras["reward"]} <= {0.0, 1.0}


def test_json_metrics_match_the_correction_library(capsys, dump_path, tmp_path):
    from rollcorr.correction import compute_correction, metrics_to_floats

    out_path = tmp_path / "sub" / "m.json"
    code, _, err = _run(capsys, dump_path, "--preset", "decoupled_token_is", "--json", out_path)
    assert code == 0, err
    data = json.loads(out_path.read_text())
    dump = read_dump(dump_path)
    res = compute_correction(
        dump.learner_log_prob, dump.rollout_log_prob, dump.response_mask, preset("decoupled_token_is")
    )
    assert data["metrics"] == pytest.approx(metrics_to_floats(res.metrics))
    assert data["config"] == preset("decoupled_token_is").to_dict()
    assert [m["line"] for m in data["malformed"]] == [11, 21]
    assert "bad JSON" in data["malformed"][0]["reason"] and "ragged" in data["malformed"][1]["reason"]
    assert data["rejected_tokens"] == 0 and data["findings"] == []  # TIS rejects nothing
    assert not list(out_path.parent.glob("*.tmp"))  # written atomically, no leftovers


def test_token_rule_findings_are_the_tokens_outside_the_window(capsys, dump_path, tmp_path):
    code, out, err = _run(
        capsys,
        dump_path,
        "--set",
        "rs=token_k1",
        "--set",
        "rs_thresholds=0.97_1.03",
        "--json",
        tmp_path / "m.json",
    )
    assert code == 0, err
    data = json.loads((tmp_path / "m.json").read_text())
    dump, rho = _ratios(dump_path)
    outside = dump.response_mask & ((rho < 0.97) | (rho > 1.03))
    assert data["rejected_tokens"] == int(outside.sum()) > 0
    got = {(f["line"], f["position"]) for f in data["findings"]}
    want = {(dump.line_numbers[b], t) for b, t in outside.nonzero().tolist()}
    assert got == want
    for f in data["findings"]:
        assert f["rule"] == "token_k1" and f["level"] == "token" and f["threshold"] == "[0.97, 1.03]"
        assert not 0.97 <= f["value"] <= 1.03
    assert "Tokens hit" in out and "token_k1" in out


@pytest.mark.parametrize(
    "name, rule",
    [
        ("decoupled_geo_rs", "seq_mean_k1"),
        ("decoupled_k3_rs", "seq_mean_k3"),
        ("slime_veto", "veto"),
        ("trm_max_k2_mean_k3", "trm_max_k2"),
        ("opsm", "opsm"),
        ("bypass_ppo_clip_geo_rs", "seq_mean_k1"),
        ("prime_rl_masked_is", "token_k1"),
    ],
)
def test_every_rejection_is_explained(dump_path, name, rule):
    config = preset(name)
    analysis = analyze(read_dump(dump_path), config, name)
    assert not any(n.startswith("warning") for n in analysis.notes), analysis.notes
    rejected = analysis.dump.response_mask & ~analysis.kept_mask
    assert analysis.rejected_tokens == int(rejected.sum())
    assert analysis.rejected_tokens > 0, "the fixture should trip every rule listed here"
    assert rule in {f.rule for f in analysis.findings}
    for f in analysis.findings:
        assert f.excess >= 1.0 and f.line in analysis.dump.line_numbers


def test_veto_names_the_catastrophic_token(dump_path):
    dump = read_dump(dump_path)
    analysis = analyze(dump, preset("slime_veto"), "slime_veto")
    vetoed = [f for f in analysis.findings if f.rule == "veto"]
    assert len(vetoed) == 1
    f = vetoed[0]
    row = dump.line_numbers.index(f.line)
    assert dump.extras["prompt"][row] == "7+1="  # the planted row
    assert f.position == 0 and f.token == "0"
    assert f.value == pytest.approx(math.exp(-11.0), rel=1e-6)
    assert f.threshold == "≥ 0.0001"


def test_icepop_zeroed_weights_are_listed_not_rejected(dump_path):
    dump = read_dump(dump_path)
    analysis = analyze(dump, preset("icepop"), "icepop")
    assert analysis.rejected_tokens == 0  # IcePop masks weights, not the response mask
    zeroed = [f for f in analysis.findings if f.effect == "zero weight"]
    _, rho = _ratios(dump_path)
    want = dump.response_mask & ((rho < 0.5) | (rho > 5.0))
    assert {(f.row, f.position) for f in zeroed} == {tuple(x) for x in want.nonzero().tolist()}
    assert all(float(analysis.is_weights[f.row, f.position]) == 0.0 for f in zeroed)


def test_config_yaml_with_preset_and_overrides(capsys, dump_path, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("preset: decoupled_geo_rs\nrs_thresholds: ['0.9_1.1']\nis_level: token\n")
    code, out, err = _run(
        capsys, dump_path, "--config", cfg, "--set", "is_upper=3", "--json", tmp_path / "m.json"
    )
    assert code == 0, err
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["config"]["rs"] == ["seq_mean_k1"] and data["config"]["rs_thresholds"] == [[0.9, 1.1]]
    assert data["config"]["is_level"] == "token" and data["config"]["is_upper"] == 3.0
    assert "preset decoupled_geo_rs" in data["config_source"] and str(cfg) in data["config_source"]


def test_config_yaml_plain_keys(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("is_level: sequence\nis_mode: mask\nis_upper: 2.0\nveto_threshold: 1.0e-4\n")
    config, source = load_config(config_path=cfg)
    assert config.is_level == "sequence" and config.veto_threshold == 1e-4 and source == str(cfg)


def test_config_yaml_in_verl_dialect(tmp_path):
    pytest.importorskip("rollcorr.config.dialects")
    cfg = tmp_path / "verl.yaml"
    cfg.write_text(
        "rollout_is: token\nrollout_is_threshold: 2.0\nrollout_rs: seq_mean_k1\nrollout_rs_threshold: '0.999_1.001'\n"
    )
    config, _ = load_config(config_path=cfg, dialect="verl")
    assert config.is_level == "token" and config.rs == ("seq_mean_k1",)


def test_set_values_parse_like_the_command_line_means():
    assert parse_value("3") == 3 and parse_value("1e-4") == 1e-4
    assert parse_value("0.5_2") == "0.5_2"  # a verl window, not YAML's 0.52
    assert parse_value("None") is None and parse_value("true") is True
    assert parse_value('["token_k1", "seq_mean_k1"]') == ["token_k1", "seq_mean_k1"]
    assert parse_value("token") == "token"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "no_such_preset"], "unknown preset 'no_such_preset'"),
        (["--set", "is_upper"], "--set expects KEY=VALUE"),
        (["--set", "bogus_key=1"], "bogus_key: unknown correction field"),
        (["--set", "rs=token_k9"], "rs option='token_k9' is not allowed"),
        (["--config", "/nonexistent/c.yaml"], "--config file not found"),
        (["--dialect", "verl"], "--dialect needs --config"),
        (["--top", "-1"], "--top must be >= 0"),
        (["--rollout-field", "nope"], "no row has the rollout log-prob field 'nope'"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, dump_path, argv, message):
    code, out, err = _run(capsys, dump_path, *argv)
    assert code == 2
    assert message in " ".join(err.split())
    assert "Diagnostics" not in out


def test_unknown_preset_lists_the_names(capsys, dump_path):
    _, _, err = _run(capsys, dump_path, "--preset", "nope")
    assert "decoupled_token_is" in err


def test_missing_file_and_all_bad_rows(capsys, tmp_path):
    code, _, err = _run(capsys, tmp_path / "missing.jsonl")
    assert code == 2 and "not found" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n[1]\n")
    code, _, err = _run(capsys, bad)
    assert code == 2 and "all 2 rows are malformed" in " ".join(err.split())


def test_opsm_without_advantages_is_a_clear_error(capsys, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"rollout_log_probs": [-0.1], "old_log_probs": [-0.2]}) + "\n")
    code, _, err = _run(capsys, path, "--preset", "opsm")
    assert code == 2 and "needs advantages" in " ".join(err.split())


def test_all_metrics_and_list_presets(capsys, dump_path):
    code, out, _ = _run(capsys, dump_path, "--all-metrics", "--preset", "decoupled_geo_rs")
    assert code == 0
    assert "rollout_rs_seq_mean_k1_seq_std" in out and "more metrics" not in out
    code, out, _ = _run(capsys, "--list-presets")
    assert code == 0 and set(out.split()) == set(PRESETS)


def test_k1_window_shown_is_the_one_applied(dump_path):
    """rollcorr keeps lo ≤ ρ ≤ hi; verl_compat keeps verl's inverted window 1/hi ≤ ρ ≤ 1/lo (docs/spec.md §3)."""
    dump = read_dump(dump_path)
    base = preset("disabled").replace(rs=("token_k1",), rs_thresholds=("0.6_1.5",))
    for config, window in ((base, "[0.6, 1.5]"), (base.replace(verl_compat=True), "[0.6667, 1.667]")):
        analysis = analyze(dump, config)
        assert [r.threshold for r in analysis.rules] == [window]
        assert not any(n.startswith("warning") for n in analysis.notes)


# ---- dumps that say what they hold ----------------------------------------------------------------------
class _Tokenizer:
    """A stand-in tokenizer for writing: token id i decodes to "t<i>" (the real one is tested in test_trl_live)."""

    def batch_decode(self, rows):
        return ["".join(f"t{i}" for i in row) for row in rows]

    def decode(self, ids):
        return "".join(f"t{i}" for i in ids)


def _written_dump(tmp_path, correction):
    from rollcorr.dumps import write_dump

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 5, generator=g) * 2
    roll = (old + 0.02 * torch.randn(6, 5, generator=g)).clamp(max=0)
    tokens = torch.randint(0, 300, (6, 5), generator=g)
    path = tmp_path / "written.jsonl"
    write_dump(
        path, roll, old, torch.ones(6, 5), tokens=tokens, tokenizer=_Tokenizer(), correction=correction
    )
    return path, tokens


def test_analyze_applies_the_correction_the_dump_records(capsys, tmp_path):
    """A token-TIS run's dump used to be analysed with the default Geo-RS preset (rejecting most of it)."""
    path, _ = _written_dump(tmp_path, preset("decoupled_token_is"))
    dump = read_dump(path)
    assert dump.correction == {"is_level": "token"} and dump.corrections_seen == 1
    out_json = tmp_path / "a.json"
    assert main(["analyze", str(path), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "the dump's own correction (= preset decoupled_token_is)" in out
    report = json.loads(out_json.read_text())
    assert report["config_source"].startswith("the dump's own correction")
    assert report["config"]["is_level"] == "token" and report["rejected_tokens"] == 0  # TIS rejects nothing
    # told otherwise: --preset wins, and the report says so
    assert main(["analyze", str(path), "--preset", DEFAULT_PRESET]) == 0
    assert f"preset {DEFAULT_PRESET}" in capsys.readouterr().out


def test_analyze_without_a_recorded_correction_says_it_uses_the_default(capsys, tmp_path):
    path, _ = _written_dump(tmp_path, None)
    assert read_dump(path).correction is None
    assert main(["analyze", str(path)]) == 0
    assert f"preset {DEFAULT_PRESET} (default: the dump records no correction)" in capsys.readouterr().out


def test_written_dump_carries_token_texts(tmp_path):
    path, tokens = _written_dump(tmp_path, None)
    dump = read_dump(path)
    assert dump.token_text[0] == [f"t{int(i)}" for i in tokens[0]]
    assert dump.text[0] == "".join(f"t{int(i)}" for i in tokens[0])
    analysis = analyze(dump, preset("decoupled_token_icepop"), "test")
    assert analysis is not None


def test_dump_with_two_corrections_asks_which(capsys, tmp_path):
    path, _ = _written_dump(tmp_path, preset("decoupled_token_is"))
    from rollcorr.dumps import write_dump

    write_dump(path, torch.full((1, 2), -0.5), torch.full((1, 2), -0.5), torch.ones(1, 2),
               correction=preset("icepop"))
    assert main(["analyze", str(path)]) == 2
    assert "2 different corrections" in capsys.readouterr().err
