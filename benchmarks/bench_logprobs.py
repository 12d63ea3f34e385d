"""Chunked lm-head log-probs vs the naive log_softmax-gather, forward + backward, on CPU.

    python benchmarks/bench_logprobs.py                  # N=1536 tokens, H=896, V=151,936 (Qwen2.5-0.5B head)
    python benchmarks/bench_logprobs.py --n 2048 --repeats 2 --entropy

Both variants compute log p(target) from hidden states (N, H) and the lm-head weight (V, H) in float32 and
back-propagate into both (loss = Σ_n c_n · log p_n, fixed random c). `naive` builds the (N, V) logits, runs
`torch.log_softmax` and gathers; `chunked` is `rollcorr.logprobs.logprobs_from_hidden` (vocabulary chunks,
online log-sum-exp, recompute in backward). `--entropy` makes both also return the entropy.

Method.
- Memory: each variant runs in its own fresh Python process with glibc's mmap threshold fixed at 128 KiB
  (MALLOC_MMAP_THRESHOLD_), so every large tensor is its own mapping, returned to the OS when freed, and
  the resident set size (RSS) follows the live tensors. One warm-up forward + backward runs first (library
  workspaces, thread pools), its gradients are dropped, the kernel's peak-RSS mark is reset
  (/proc/self/clear_refs = 5) and the RSS is read; the measured forward + backward follows and peak =
  VmHWM − that RSS: the extra memory the op needs at its peak, *including* the gradients it returns
  (grad_weight alone is V·H·4 B = 519 MiB at H=896, for both variants). The working-memory line
  subtracts those returned gradients, which any implementation must allocate. (tracemalloc cannot see
  torch tensors.)
- Time: CPU time of the process (time.process_time) with one intra-op thread, median over the measured
  repeats (the warm-up is not timed). CPU time rather than wall time because the machine is shared: wall
  time measures the other users' load, CPU time measures the work. Wall times are printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from rollcorr.logprobs import logprobs_from_hidden, naive_logprobs_from_hidden


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _hwm_bytes() -> int:
    """Peak RSS since the last reset (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _child(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.n, args.h, generator=gen).requires_grad_()
    weight = (torch.randn(args.vocab, args.h, generator=gen) * args.h**-0.5).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.n,), generator=gen)
    coef = torch.randn(args.n, generator=gen)

    def step() -> torch.Tensor:
        hidden.grad = weight.grad = None
        if args.variant == "naive":
            logp, ent = naive_logprobs_from_hidden(hidden, weight, targets, with_entropy=args.entropy)
        else:
            logp, ent = logprobs_from_hidden(
                hidden, weight, targets, chunk_size=args.chunk_size, with_entropy=args.entropy
            )
        loss = (coef * logp).sum() + (0.1 * ent.sum() if ent is not None else 0.0)
        loss.backward()
        return logp.detach()

    step()  # warm-up: library workspaces and thread pools are allocated here, not in the measurement
    hidden.grad = weight.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    before = _rss_bytes()
    cpu, wall = [], []
    for i in range(args.repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        logp = step()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        if i == 0:
            peak = _hwm_bytes() - before
    timed = cpu
    return {
        "variant": args.variant,
        "peak_extra_mb": peak / 2**20,
        "grads_mb": (hidden.numel() + weight.numel()) * 4 / 2**20,
        "median_cpu_s": statistics.median(timed),
        "cpu_s": cpu,
        "wall_s": wall,
        "logp_sum": float(logp.double().sum()),
        "grad_weight_norm": float(weight.grad.norm()),
        "grad_hidden_norm": float(hidden.grad.norm()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1536, help="tokens")
    parser.add_argument("--h", type=int, default=896, help="hidden size")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=1, help="measured runs per variant (after a warm-up)")
    parser.add_argument("--entropy", action="store_true", help="also compute (and back-propagate) entropy")
    parser.add_argument("--variant", choices=("naive", "chunked"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(_child(args)))
        return
    results = {}
    for variant in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--variant", variant]
        for flag in ("n", "h", "vocab", "chunk_size", "repeats"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        cmd += ["--entropy"] if args.entropy else []
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    naive, chunked = results["naive"], results["chunked"]
    print(
        f"N={args.n} H={args.h} V={args.vocab} chunk={args.chunk_size} entropy={args.entropy} "
        "float32, forward+backward into hidden and weight, 1 thread"
    )
    for r in (naive, chunked):
        cpu = ", ".join(f"{t:.2f}" for t in r["cpu_s"])
        wall = ", ".join(f"{t:.2f}" for t in r["wall_s"])
        print(
            f"  {r['variant']:8s} peak extra {r['peak_extra_mb']:7.0f} MiB   median CPU {r['median_cpu_s']:6.2f} s"
            f"   (CPU {cpu}; wall {wall})"
        )
    print(
        f"  memory chunked/naive {chunked['peak_extra_mb'] / naive['peak_extra_mb']:.3f}   (target <= 0.25)"
    )
    work = {k: r["peak_extra_mb"] - r["grads_mb"] for k, r in results.items()}
    print(
        f"  working memory (peak extra minus the {naive['grads_mb']:.0f} MiB of returned grad_hidden + grad_weight):"
        f" naive {work['naive']:.0f} MiB, chunked {work['chunked']:.0f} MiB, ratio {work['chunked'] / work['naive']:.3f}"
    )
    print(f"  time   chunked/naive {chunked['median_cpu_s'] / naive['median_cpu_s']:.3f}   (target <= 1.3)")
    print(
        f"  agreement: |Σ log p| diff {abs(chunked['logp_sum'] - naive['logp_sum']):.2e}; "
        f"‖grad_weight‖ {naive['grad_weight_norm']:.6f} vs {chunked['grad_weight_norm']:.6f}; "
        f"‖grad_hidden‖ {naive['grad_hidden_norm']:.6f} vs {chunked['grad_hidden_norm']:.6f}"
    )


if __name__ == "__main__":
    main()
