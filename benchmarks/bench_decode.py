"""Per-step compute of the default run, fast paths against their references, measured back to back.

    python benchmarks/bench_decode.py               # 10 repeats of each, 1 torch thread
    python benchmarks/bench_decode.py --repeats 20 --threads 2

On the built-in model and a default batch (16 addition prompts × 8 responses, 5 new tokens):

- generate: ``HFSampler(bf16)`` with the static-KV decoder (``fast_decode=True``) vs decoding through the
  transformers model with a ``DynamicCache`` (``fast_decode=False``); the same tokens either way.
- score: ``HFLearner(fp32)`` log-probs + entropy with gradient and backward on one mini-batch (64 rows), and
  without gradient on the batch (128 rows, the π_old recompute), with shared prompts vs one full forward.
- optimizer step guard: ``GuardedStep`` (copies into reused buffers) vs cloning the weights and deep-copying
  the optimizer's ``state_dict`` (what each optimizer step did before).

Reported: CPU seconds per call (``time.process_time``, this process only, so other work on a shared machine
inflates it less than wall time) and the ratio reference / fast measured in this run. The machine is shared:
numbers vary with its load; the command line is printed with them.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch


def cpu_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from rollcorr.engines import SamplingParams
    from rollcorr.engines.hf import HFLearner, HFSampler
    from rollcorr.tasks import make_task
    from rollcorr.train.step import GuardedStep

    prompts = [it["prompt"] for it in make_task("addition").sample(16, seed=1, split="train")]
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=3)
    sampler = HFSampler(dtype="bf16")
    learner = HFLearner()
    rollout = sampler.generate(prompts, params, n=8)
    mini = rollout.select(list(range(64)))
    rows = []

    def generate(fast: bool):
        sampler.fast_decode = fast
        return lambda: sampler.generate(prompts, params, n=8)

    def score(share: bool, grad: bool):
        def run():
            learner.share_prompts = share
            learner.model.zero_grad(set_to_none=True)
            lp, ent = learner.log_prob(mini if grad else rollout, grad=grad, with_entropy=True)
            if grad:
                (lp.sum() + ent.sum()).backward()

        return run

    weights = [p for p in learner.model.parameters()]
    optimizer = torch.optim.AdamW(weights, lr=1e-6)
    for p in weights:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # the state exists, as after the first step of a run
    guarded = GuardedStep(optimizer, weights)

    def deep_copy_step():
        _ = [p.detach().clone() for p in weights]
        _ = copy.deepcopy(optimizer.state_dict())
        optimizer.step()

    cases = [
        ("generate 128 rows (bf16 sampler)", generate(False), generate(True)),
        ("score + backward, 64 rows (fp32 learner)", score(False, True), score(True, True)),
        ("score, no grad, 128 rows (π_old recompute)", score(False, False), score(True, False)),
        ("optimizer step with its non-finite guard", deep_copy_step, guarded),
    ]
    for name, reference, fast in cases:
        ref_s, fast_s = cpu_seconds(reference, args.repeats), cpu_seconds(fast, args.repeats)
        rows.append((name, ref_s, fast_s))

    print(f"# {' '.join(['python', *sys.argv])}   (torch threads: {args.threads}, CPU seconds per call)")
    print(f"{'':46s} {'reference':>10s} {'fast':>10s} {'ratio':>7s}")
    for name, ref_s, fast_s in rows:
        print(f"{name:46s} {ref_s:10.4f} {fast_s:10.4f} {ref_s / fast_s:7.2f}")


if __name__ == "__main__":
    main()
