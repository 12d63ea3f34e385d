"""The audit's verdict level (rollcorr.audit.levels): read from shares of tokens with bootstrap intervals, so one
pair of engines gets one level whether 64 or 2,048 responses are audited (a maximum grows with the sample)."""

import pytest
import torch

from rollcorr.audit.collect import builtin_prompts, collect, from_rollout
from rollcorr.audit.levels import (
    BF16_WIDE_SHARE,
    FP16_SHARE,
    SAME_SHARE,
    level_of,
    row_hits,
    share_intervals,
    verdict_level,
)
from rollcorr.audit.stats import audit_stats
from rollcorr.engines import SamplingParams, make_learner, make_sampler


def shares(ge_1e3: float, ge_001: float, ge_005: float) -> dict[str, float]:
    return {"ge_1e-3": ge_1e3, "ge_0.01": ge_001, "ge_0.05": ge_005}


def test_the_rule_at_its_boundaries():
    assert level_of(shares(SAME_SHARE * 0.99, 0, 0)) == "same"
    assert level_of(shares(SAME_SHARE, 0, 0)) == "fp16"
    assert level_of(shares(0.5, FP16_SHARE * 0.99, 0)) == "fp16"
    assert level_of(shares(0.5, FP16_SHARE, 0)) == "bf16"
    assert level_of(shares(0.5, 0.31, BF16_WIDE_SHARE)) == "bf16"  # SmolLM2's bf16: 31 % at ≥ 0.01, 2.6 % at ≥ 0.05
    assert level_of(shares(0.5, 0.1, BF16_WIDE_SHARE + 1e-9)) == "beyond"


def test_shares_and_intervals_count_valid_tokens_and_keep_responses_together():
    abs_diff = torch.tensor([[0.2, 0.002, 0.0, 9.0], [0.0, 0.0, 0.02, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)  # the 9.0 is padding
    hits, counts = row_hits(abs_diff, mask)
    assert counts.tolist() == [3, 4] and hits["ge_0.05"].tolist() == [1, 0] and hits["ge_1e-3"].tolist() == [2, 1]
    out = share_intervals(hits, counts, n=500)
    assert out["ge_0.01"]["share"] == pytest.approx(2 / 7)
    lo, hi = out["ge_0.05"]["ci95"]  # resampling whole responses: 0 (row 2 twice) to 2/6 (row 1 twice)
    assert lo == 0.0 and hi == pytest.approx(1 / 3)
    one = verdict_level(abs_diff[:1, :3], mask[:1, :3])
    assert one["shares"]["ge_0.05"]["ci95"] == [pytest.approx(1 / 3)] * 2  # one response: no spread


@pytest.mark.parametrize("spec, expected", [("hf:bf16", "bf16"), ("hf:fp16", "fp16")])
def test_one_pair_of_engines_gets_one_level_at_64_512_and_2048_responses(spec, expected):
    """The built-in model, the audit's default sampling (temperature 1, 64 new tokens): the first 64, 512 and all
    2,048 responses of one audit. The old rule (by the max |Δp|) called hf:fp16 "fp16" at 64 responses and
    "bf16" at 2,048, and hf:bf16 "bf16" then "beyond": the max grows with the sample, the shares do not."""
    torch.manual_seed(0)
    learner = make_learner("hf:fp32")
    rollout = collect(make_sampler(spec), learner, builtin_prompts(256), SamplingParams(max_new_tokens=64, seed=0),
                      n=8, batch_size=64)
    data = from_rollout(rollout)
    levels = {}
    for n in (64, 512, 2048):
        stats = audit_stats(data.rollout_log_prob[:n], data.old_log_prob[:n], data.response_mask[:n])
        levels[n] = stats["verdict_level"]["level"]
    assert levels == dict.fromkeys((64, 512, 2048), expected)


def test_bootstrap_drawn_in_blocks_is_the_one_tensor_draw(monkeypatch):
    """The interval's resamples drawn in blocks of ``PICK_BLOCK`` indices (bounded memory: one (n, B) tensor
    of 10⁵ responses took 1.6 GB) are the same draws as one tensor: identical intervals, any block size."""
    from rollcorr.audit import levels

    g = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 50, (3000,), generator=g).double()
    hits = {name: torch.minimum(counts, torch.randint(0, 10, (3000,), generator=g).double()) for name in levels.THRESHOLDS}
    rows = counts > 0
    draw = torch.Generator().manual_seed(levels.STAT_SEED)
    picks = torch.randint(0, int(rows.sum()), (levels.BOOTSTRAP, int(rows.sum())), generator=draw)
    total = counts[rows][picks].sum(dim=1)
    probs = torch.tensor([0.025, 0.975], dtype=torch.float64)
    want = {name: torch.quantile(hits[name][rows][picks].sum(dim=1) / total, probs).tolist() for name in levels.THRESHOLDS}
    for block in (1, 4999, 3000 * 7, 1 << 30):
        monkeypatch.setattr(levels, "PICK_BLOCK", block)
        got = levels.share_intervals(hits, counts)
        assert {name: got[name]["ci95"] for name in levels.THRESHOLDS} == want
