"""Batch normalisation across ranks: two gloo processes, each holding half the batch, get the same weights as
one process normalising the whole batch."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollcorr.config import CorrectionConfig
from rollcorr.correction import compute_correction

WORLD = 2


def _batch():
    g = torch.Generator().manual_seed(7)
    roll = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 2 - 0.05
    old = (roll + 0.4 * torch.randn(6, 9, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    lengths = torch.tensor([9, 2, 5, 9, 1, 7])  # unequal halves: rank 0 has 16 tokens, rank 1 has 17
    mask = torch.arange(9)[None] < lengths[:, None]
    return old, roll, mask


def _configs():
    return [
        CorrectionConfig(is_level="token", is_upper=2.0, batch_normalize=True),
        CorrectionConfig(is_level="sequence", is_upper=3.0, batch_normalize=True),
        CorrectionConfig(is_level="geometric", is_upper=None, batch_normalize=True),
    ]


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        old, roll, mask = _batch()
        rows = slice(rank * 3, rank * 3 + 3)
        out = [compute_correction(old[rows], roll[rows], mask[rows], c).is_weights for c in _configs()]
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_batch_norm_all_reduces_across_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=True)
        parts = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    old, roll, mask = _batch()
    for i, config in enumerate(_configs()):
        full = compute_correction(old, roll, mask, config).is_weights
        distributed = torch.cat([parts[0][i], parts[1][i]])
        torch.testing.assert_close(distributed, full, rtol=1e-12, atol=1e-12)
        # and the local-only normalisation would differ (the test can fail)
        local = compute_correction(old[:3], roll[:3], mask[:3], config).is_weights
        assert not torch.allclose(local, full[:3])
