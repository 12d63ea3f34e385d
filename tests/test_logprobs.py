"""Memory-lean log-probs and entropy (rollcorr.logprobs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_metrics_as_accurate, log_softmax_bound
from rollcorr.logprobs import logprobs_from_hidden, logprobs_from_logits, naive_logprobs_from_hidden


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one intra-op thread is far faster than two on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _reference(logits, targets, temperature):
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    return log_p.gather(-1, targets[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _assert_float32_rounding(logp, ent, ref_logp, ref_ent, z):
    """float32 log p and entropy within their rounding of the float64 values: log p = z_y − lse to b
    (conftest.log_softmax_bound of the tempered logits z), H = −Σ p log p to b (1 + 2H): each term's log p is
    off by ≤ b, weighted by p |1 + log p| (Σ ≤ 1 + H), and the n-term sum rounds by n ε₃₂ H/2 ≤ b H."""
    b = log_softmax_bound(z)
    assert ((logp.double() - ref_logp).abs() <= b).all(), float((logp.double() - ref_logp).abs().max())
    assert ((ent.double() - ref_ent).abs() <= b * (1 + 2 * ref_ent)).all(), float((ent.double() - ref_ent).abs().max())


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_from_logits_matches_log_softmax(temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 37, generator=gen) * 4
    targets = torch.randint(0, 37, (3, 5), generator=gen)
    logp, ent = logprobs_from_logits(logits, targets, temperature=temperature, chunk_size=4)
    ref_logp, ref_ent = _reference(logits, targets, temperature)
    assert logp.dtype == torch.float32 and logp.shape == (3, 5)
    _assert_float32_rounding(logp, ent, ref_logp, ref_ent, logits / temperature)


def test_from_logits_gradcheck_float64():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(
        lambda x: logprobs_from_logits(x, targets, temperature=0.8, chunk_size=4), (logits,)
    )
    # only one output used (the other's grad is None)
    assert torch.autograd.gradcheck(
        lambda x: logprobs_from_logits(x, targets, temperature=0.8, chunk_size=4)[1].sum(), (logits,)
    )


def test_from_logits_bfloat16_input_computes_in_float32():
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, 6, 50, generator=gen) * 3).bfloat16().requires_grad_()
    targets = torch.randint(0, 50, (4, 6), generator=gen)
    logp, ent = logprobs_from_logits(logits, targets)
    ref_logp, ref_ent = _reference(logits.detach().float(), targets, 1.0)
    assert logp.dtype == torch.float32
    _assert_float32_rounding(logp, ent, ref_logp, ref_ent, logits.detach().float())
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


@pytest.mark.parametrize("chunk_size", [1, 4, 11, 64])
def test_from_hidden_matches_naive(chunk_size):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(29, 8, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 29, (9,), generator=gen)
    a = [t.clone().requires_grad_() for t in (hidden, weight)]
    b = [t.clone().requires_grad_() for t in (hidden, weight)]
    logp, ent = logprobs_from_hidden(*a, targets, temperature=0.9, chunk_size=chunk_size)
    ref_logp, ref_ent = naive_logprobs_from_hidden(*b, targets, temperature=0.9)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)
    coef = torch.randn(9, generator=gen, dtype=torch.float64)
    (coef * logp + 0.3 * ent).sum().backward()
    (coef * ref_logp + 0.3 * ref_ent).sum().backward()
    torch.testing.assert_close(a[0].grad, b[0].grad)
    torch.testing.assert_close(a[1].grad, b[1].grad)


def test_from_hidden_gradcheck_float64():
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 8, 5, 8])
    assert torch.autograd.gradcheck(
        lambda h, w: logprobs_from_hidden(h, w, targets, temperature=0.7, chunk_size=4), (hidden, weight)
    )
    assert torch.autograd.gradcheck(
        lambda h, w: logprobs_from_hidden(h, w, targets, chunk_size=3)[0], (hidden, weight)
    )


def test_from_hidden_is_stable_for_large_logits():
    hidden = torch.full((2, 3), 100.0)
    weight = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [-1.0, 2.0, 0.5]])
    logp, ent = logprobs_from_hidden(hidden, weight, torch.tensor([0, 1]), chunk_size=1)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert logp[0].item() == pytest.approx(0.0, abs=1e-6) and logp[1].item() == pytest.approx(
        -300.0, rel=1e-6
    )


def test_bad_inputs_raise():
    hidden, weight = torch.randn(3, 4), torch.randn(10, 4)
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_hidden(hidden, weight, torch.zeros(3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="outside"):
        logprobs_from_hidden(hidden, weight, torch.tensor([0, 1, 10]))
    with pytest.raises(ValueError, match=r"\(N, H\)"):
        logprobs_from_hidden(hidden, torch.randn(10, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids"):
        logprobs_from_logits(torch.randn(3, 10), torch.zeros(3))
    with pytest.raises(ValueError, match="does not match"):
        logprobs_from_logits(torch.randn(3, 10), torch.zeros(4, dtype=torch.long))


BENCH = {"n": 512, "h": 64, "vocab": 32768}


def _bench_child(variant: str) -> dict:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_logprobs.py"
    args = ["--n", str(BENCH["n"]), "--h", str(BENCH["h"]), "--vocab", str(BENCH["vocab"]), "--chunk-size", "2048",
            "--repeats", "1"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # as the benchmark: RSS follows live tensors
    out = subprocess.run(
        [sys.executable, str(script), "--variant", variant, *args],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow  # two fresh Python processes: ~5 s idle, ~20 s on a loaded machine
def test_chunked_working_memory_is_a_small_fraction_of_naive():
    """Peak RSS growth after a warm-up (fresh process each) minus the returned gradients: chunked ≪ naive."""
    naive, chunked = _bench_child("naive"), _bench_child("chunked")
    work_naive = naive["peak_extra_mb"] - naive["grads_mb"]
    work_chunked = chunked["peak_extra_mb"] - chunked["grads_mb"]
    assert work_naive > 100  # three (512, 32768) float32 arrays = 192 MiB in the naive path
    assert work_chunked < 0.25 * work_naive
    # both float32, against the benchmark's inputs in float64 (its seeded draws, redone here): the chunked
    # path as accurate as the naive one, each a sum over the n tokens (conftest.metric_floor)
    exact = _bench_reference(**BENCH)
    assert_metrics_as_accurate(chunked, naive, exact, n=BENCH["n"], keys=("logp_sum", "grad_weight_norm"))


def _bench_reference(n: int, h: int, vocab: int) -> dict:
    """benchmarks/bench_logprobs.py's logp_sum and grad_weight_norm in float64 (naive log-softmax)."""
    gen = torch.Generator().manual_seed(0)  # the child's draws, in its order
    hidden = torch.randn(n, h, generator=gen).double()
    weight = (torch.randn(vocab, h, generator=gen) * h**-0.5).double().requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=gen)
    coef = torch.randn(n, generator=gen).double()
    logp, _ = naive_logprobs_from_hidden(hidden, weight, targets, with_entropy=False)
    (coef * logp).sum().backward()
    return {"logp_sum": float(logp.detach().sum()), "grad_weight_norm": float(weight.grad.norm())}
