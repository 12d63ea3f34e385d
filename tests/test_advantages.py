"""Group advantages (rollcorr.advantages)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcorr.advantages import (
    broadcast,
    compute_advantages,
    drgrpo_advantages,
    grpo_advantages,
    oapl_advantages,
    oapl_value,
    rloo_advantages,
    uniform_group_filter,
)

REWARDS = torch.tensor([1.0, 0.0, 0.5, 3.0, 1.0, 2.0, 7.0])
GROUPS = torch.tensor([4, 4, 4, 9, 9, 9, 2])  # arbitrary ids, one singleton group


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one intra-op thread is far faster than two on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _python_grpo(rewards, groups, keep, norm_std, eps=1e-6):
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and keep[j]]
        if not keep[i] or len(members) < 2:
            out.append(0.0)
            continue
        a = r - statistics.mean(members)
        out.append(a / (statistics.stdev(members) + eps) if norm_std else a)
    return torch.tensor(out)


@settings(deadline=None, max_examples=30)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.floats(-5, 5), st.booleans()), min_size=1, max_size=12),
    st.booleans(),
)
def test_grpo_matches_python_reference(rows, norm_std):
    groups = torch.tensor([g for g, _, _ in rows])
    rewards = torch.tensor([r for _, r, _ in rows], dtype=torch.float64)
    keep = torch.tensor([k for _, _, k in rows])
    got = grpo_advantages(rewards, groups, norm_std=norm_std, keep=keep)
    expected = _python_grpo(rewards.tolist(), groups.tolist(), keep.tolist(), norm_std).double()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_grpo_drgrpo_rloo_on_a_small_batch():
    grpo = grpo_advantages(REWARDS, GROUPS)
    mean0, std0 = 0.5, 0.5  # group 4: 1, 0, 0.5 → mean 0.5, unbiased std 0.5
    assert grpo[0].item() == pytest.approx((1 - mean0) / (std0 + 1e-6))
    assert grpo[6].item() == 0.0  # singleton group: no baseline information
    dr = drgrpo_advantages(REWARDS, GROUPS)
    torch.testing.assert_close(dr[:3], torch.tensor([0.5, -0.5, 0.0]))
    rloo = rloo_advantages(REWARDS, GROUPS)
    torch.testing.assert_close(rloo[3:6], torch.tensor([3.0 - 1.5, 1.0 - 2.5, 2.0 - 2.0]))
    # RLOO = n/(n-1) · Dr.GRPO
    torch.testing.assert_close(rloo[:6], 1.5 * dr[:6])


def test_rejected_sequences_are_excluded_from_baselines():
    keep = torch.tensor([True, False, True, True, True, True, True])
    adv = drgrpo_advantages(REWARDS, GROUPS, keep=keep)
    torch.testing.assert_close(adv[:3], torch.tensor([0.25, 0.0, -0.25]))  # baseline (1 + 0.5) / 2
    rloo = rloo_advantages(REWARDS, GROUPS, keep=keep)
    torch.testing.assert_close(rloo[:3], torch.tensor([0.5, 0.0, -0.5]))
    assert adv[1].item() == 0.0 and rloo[1].item() == 0.0


def test_oapl_value_is_soft_max_between_mean_and_max():
    v_soft = oapl_value(REWARDS, GROUPS, beta1=1.0)
    expected = 1.0 * math.log((math.exp(1.0) + math.exp(0.0) + math.exp(0.5)) / 3)
    assert v_soft[0].item() == pytest.approx(expected, rel=1e-6)
    v_mean = oapl_value(REWARDS, GROUPS, beta1=math.inf)
    assert v_mean[3].item() == pytest.approx(2.0)
    v_max = oapl_value(REWARDS, GROUPS, beta1=1e-3)
    assert v_max[3].item() == pytest.approx(
        3.0 + 1e-3 * math.log(1 / 3), abs=1e-6
    )  # no overflow at r/β₁ = 3000
    assert (v_mean <= v_soft + 1e-6).all() and (v_soft <= v_max + 1e-6).all()
    adv = oapl_advantages(REWARDS, GROUPS, beta1=1.0)
    torch.testing.assert_close(adv, REWARDS - v_soft)
    with pytest.raises(ValueError, match="beta1"):
        oapl_value(REWARDS, GROUPS, beta1=0.0)


def test_uniform_group_filter_and_dispatcher():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    assert uniform_group_filter(rewards, groups).tolist() == [False, False, False, True, True, False]
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[3, 2:] = False
    adv, used = compute_advantages("grpo", rewards, groups, mask, filter_uniform_groups=True)
    assert used.tolist() == [False, False, False, True, True, False]
    assert adv.shape == (6, 4)
    assert torch.equal(adv[:3], torch.zeros(3, 4))
    assert adv[3, 2:].abs().sum() == 0 and adv[3, 0] < 0 < adv[4, 0]
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("gae", rewards, groups, mask)


def test_input_validation():
    with pytest.raises(ValueError, match="group_ids has shape"):
        grpo_advantages(REWARDS, GROUPS[:-1])
    with pytest.raises(ValueError, match="NaN"):
        grpo_advantages(torch.tensor([float("nan"), 1.0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="integer"):
        grpo_advantages(REWARDS, GROUPS.float())
    with pytest.raises(ValueError, match="must be"):
        broadcast(REWARDS, torch.ones(3, 2))
