"""One list of rejection rules (correction/rejection.py): compute_correction's mask is the AND of its keeps."""

from __future__ import annotations

import torch

from rollcorr.config.correction import CorrectionConfig
from rollcorr.correction import compute_correction
from rollcorr.correction.ratios import make_tokens
from rollcorr.correction.rejection import rejection_rules


def test_mask_is_the_and_of_the_rule_list():
    g = torch.Generator().manual_seed(0)
    b, t = 16, 12
    mask = torch.rand(b, t, generator=g) > 0.2
    old = -torch.rand(b, t, generator=g) * 3
    roll = (old + torch.randn(b, t, generator=g) * torch.linspace(0.01, 0.6, b)[:, None]).clamp(max=0)
    adv = torch.randn(b, generator=g)
    config = CorrectionConfig(
        rs=("token_k1", "seq_mean_k3", "seq_max_binary_kl"),
        rs_thresholds=((0.7, 1.4), 0.05, 0.5),
        veto_threshold=0.3,
        veto_upper=3.0,
        trm_max_k2=0.1,
        trm_mean_k3=0.02,
        opsm_delta=0.05,
    )
    tok = make_tokens(old, roll, mask, bound=config.safety_bound, verl=config.verl_compat)
    rules = rejection_rules(config, tok, advantages=adv)
    names = [r.rule for r in rules]
    assert names == [*config.rs, "veto", "veto_upper", "trm_max_k2", "trm_mean_k3", "opsm"]
    keep = mask.clone()
    for r in rules:
        keep &= r.token_keep if r.token_keep is not None else r.row_keep[:, None]
    result = compute_correction(old, roll, mask, config, advantages=adv, warn=False)
    assert torch.equal(result.mask, keep)
    assert 0 < int(keep.sum()) < int(mask.sum())  # the case rejects something and keeps something
