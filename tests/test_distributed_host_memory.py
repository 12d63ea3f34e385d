"""The trainer's collectives through shared memory for CPU ranks of one host (distributed/host_memory.py), on two
gloo processes: every collective gives what gloo gives (bit for bit: a sum of two ranks is one rounding either
way), across slot-sized chunks, with objects too large for a slot sent through gloo, and no file left behind."""

from __future__ import annotations

import dataclasses
import glob
import os
import socket
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollcorr.distributed.host_memory import (
    CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    SPIN_ORDERED,
    CollectiveFailed,
    HostMemory,
    chunk_bytes_for,
)

WORLD = 2
pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, env: dict, *args) -> None:
    mp.spawn(_worker, args=(_free_port(), env, fn, *args), nprocs=WORLD, join=True)


def _worker(rank: int, port: int, env: dict, fn, *args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), **env)
    torch.set_num_threads(1)
    from rollcorr.distributed import close, init_from_env

    try:
        fn(init_from_env("cpu"), *args)
    finally:
        close()


def test_the_largest_slot_that_fits_half_of_dev_shm():
    assert chunk_bytes_for(2, 8 * CHUNK_BYTES) == CHUNK_BYTES  # 2 halves × 2 ranks × 8 MiB = half of 64 MiB
    assert chunk_bytes_for(2, 8 * CHUNK_BYTES - 1) == CHUNK_BYTES // 2
    assert chunk_bytes_for(2, 8 * MIN_CHUNK_BYTES) == MIN_CHUNK_BYTES
    assert chunk_bytes_for(2, 8 * MIN_CHUNK_BYTES - 1) is None  # Docker's 64 MiB default holds 8 ranks at 1 MiB
    assert chunk_bytes_for(8, 64 << 20) == MIN_CHUNK_BYTES * 2


def _collectives(ranks, out: str) -> None:
    """Each collective through shared memory and through gloo (the same group with ``host=None``)."""
    assert isinstance(ranks.host, HostMemory)
    small = HostMemory.open(ranks.rank, WORLD, ranks.broadcast, ranks.all_true, dist.barrier, 60.0,
                            chunk_bytes=MIN_CHUNK_BYTES)
    assert small.chunk_bytes == MIN_CHUNK_BYTES
    gloo = dataclasses.replace(ranks, host=None)
    chunked = dataclasses.replace(ranks, host=small)
    # slots of their own with gloo's barrier between writing and reading (what a CPU other than x86 gets)
    other = HostMemory.open(ranks.rank, WORLD, ranks.broadcast, ranks.all_true, dist.barrier, 60.0,
                            chunk_bytes=MIN_CHUNK_BYTES)
    synced_by_gloo = dataclasses.replace(ranks, host=HostMemory(other.flags, other.slots, ranks.rank, WORLD, dist.barrier))
    generator = torch.Generator().manual_seed(ranks.rank)
    results = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        big = (torch.randn(700_001, generator=generator) * 100).to(dtype)  # 2.8 MB in fp32: three 1 MiB chunks
        for op in ("sum", "max", "min"):
            for name, group in (("shm", ranks), ("chunked", chunked), ("gloo barrier", synced_by_gloo), ("gloo", gloo)):
                results[(str(dtype), op, name)] = group.all_reduce(big, op)
        scalar = torch.tensor(3.0 + ranks.rank).to(dtype)  # 0-d
        results[(str(dtype), "scalar", "shm")] = ranks.all_reduce(scalar)
        results[(str(dtype), "scalar", "gloo")] = gloo.all_reduce(scalar)
    x = torch.randn(5, 7, generator=generator)
    for name, group in (("shm", ranks), ("gloo", gloo)):
        into = x.clone()
        group.all_reduce(into, out=into)  # in place
        results[("out", name)] = into
        results[("rows", name)] = group.gather_rows(x)
        results[("empty", name)] = group.all_reduce(torch.zeros(0, 4))
    rows = torch.randn(400, 1000, generator=generator)  # 1.6 MB: two 1 MiB chunks
    results[("big rows", "chunked")] = chunked.gather_rows(rows)
    results[("big rows", "gloo")] = gloo.gather_rows(rows)
    payload = {"rank": ranks.rank, "tensor": torch.arange(3) + ranks.rank}
    results["objects"] = ranks.all_gather_object(payload)
    large = bytes(MIN_CHUNK_BYTES) if ranks.rank == 1 else b""  # one rank's pickle does not fit a slot: gloo
    results["large"] = [len(o) for o in chunked.all_gather_object(large)]
    try:  # a collective called with other shapes on the ranks fails on every rank, as gloo's does
        ranks.all_reduce(torch.ones(3 + ranks.rank))
    except CollectiveFailed as err:
        results["mismatch"] = str(err)
    torch.save(results, f"{out}.{ranks.rank}")


def test_every_collective_equals_gloos():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results")
        before = set(glob.glob("/dev/shm/rollcorr-*"))
        _spawn(_collectives, {}, out)
        assert set(glob.glob("/dev/shm/rollcorr-*")) == before  # unlinked once mapped
        zero, one = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    for results in (zero, one):
        for key, value in results.items():
            if isinstance(key, tuple) and key[-1] != "gloo" and key[:-1] + ("gloo",) in results:
                reference = results[key[:-1] + ("gloo",)]
                assert value.dtype == reference.dtype and value.shape == reference.shape, key
                assert torch.equal(value, reference), key
        assert [o["rank"] for o in results["objects"]] == [0, 1]
        assert torch.equal(results["objects"][1]["tensor"], torch.arange(3) + 1)
        assert results["large"] == [0, MIN_CHUNK_BYTES]
        assert results["mismatch"] == ("a collective got tensors of different sizes on the ranks ([12, 16] bytes in "
                                       "rank order): every rank must pass the same shape and dtype")
    for key in zero:  # every rank got the same bits
        if isinstance(key, tuple):
            assert torch.equal(zero[key], one[key]), key


def _averaged(ranks, out: str) -> None:
    """A replicated learner's gradient averaging; rank 1's loss was not finite in the second call."""
    from rollcorr.distributed.replicate import GradientAverager

    averager = GradientAverager()
    w = torch.zeros(4, requires_grad=True)
    seen = []
    for finite_here in (True, ranks.rank == 0):
        w.grad = torch.full((4,), 1.0 + 2 * ranks.rank)
        seen.append((averager([w], ranks, finite_here), w.grad.clone()))
    torch.save((ranks.host is not None, seen), f"{out}.{ranks.rank}")


@pytest.mark.parametrize("host_memory", ["1", "0"])
def test_gradients_averaged_with_whether_every_rank_was_finite(host_memory):
    """Both transports (``ROLLCORR_HOST_MEMORY=0``: gloo); the finite flag rides in the gradients' buffer."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "grads")
        _spawn(_averaged, {"ROLLCORR_HOST_MEMORY": host_memory}, out)
        for rank in range(WORLD):
            used_host, seen = torch.load(f"{out}.{rank}")
            assert used_host == (host_memory == "1")
            assert [finite for finite, _ in seen] == [True, False]
            for _, grad in seen:
                assert torch.equal(grad, torch.full((4,), 2.0))


def _abandoned(ranks, how: str, out: str) -> None:
    """Rank 1 exits (``exit``) or stays away (``late``) while rank 0 waits at the spin barrier."""
    from rollcorr.distributed.host_memory import SpinBarrier

    host = HostMemory.open(ranks.rank, WORLD, ranks.broadcast, ranks.all_true, dist.barrier, 1.0)
    assert isinstance(host.barrier, SpinBarrier)
    host.all_reduce(torch.ones(3))  # both here once
    if ranks.rank == 1:
        if how == "exit":
            os._exit(0)
        time.sleep(4.0)
        return
    start = time.perf_counter()
    try:
        host.all_reduce(torch.ones(3))
        said = None
    except CollectiveFailed as err:
        said = str(err)
    torch.save((said, time.perf_counter() - start), out)


@pytest.mark.skipif(not SPIN_ORDERED, reason="the spin barrier is x86's")
@pytest.mark.parametrize("how", ["exit", "late"])
def test_a_rank_that_exits_or_stays_away_fails_the_spin_barrier(how):
    """A killed rank fails the others' wait within a check interval (as a closed socket fails gloo's); one that
    does not come fails it after the collective timeout (1 s here)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "said")
        try:
            _spawn(_abandoned, {}, how, out)
        except mp.ProcessExitedException:
            pass  # rank 1's os._exit while the group was open may be reported; rank 0's answer is what counts
        said, waited = torch.load(out)
    if how == "exit":
        assert said.startswith("rank 1 (process ") and "exited while rank 0 waited for it" in said
        assert waited < 3.0
    else:
        assert said == "rank(s) 1 did not reach a collective within 1 s (rank 0 waited)"
        assert 1.0 <= waited < 3.0
