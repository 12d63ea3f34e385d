"""Cost of the vllm sampler against the hf sampler: engine start, sampling tokens/s, weight-update time.

    .venv/bin/python benchmarks/bench_vllm.py [--model DIR] [--specs vllm:fp32 vllm:bf16 hf:fp32 hf:bf16]
        [--prompts 32] [--n 4] [--tokens 6] [--repeat 3]

Per spec: seconds to build the sampler (vLLM: the engine start), then the median over ``--repeat`` calls of
``generate`` (``--prompts`` addition prompts × ``--n`` responses, ``--tokens`` new tokens, temperature 1)
as generated tokens per second, and of ``load_weights`` with the learner's weights (vLLM: reload in
place + prefix-cache reset). Wall times on a shared machine are noisy: report the load printed in the header.
Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def bench(
    spec: str, model, prompts: list[str], n: int, tokens: int, repeat: int, weights
) -> dict[str, float]:
    from rollcorr.engines import SamplingParams, make_sampler

    t0 = time.perf_counter()
    sampler = make_sampler(spec, model)
    start_s = time.perf_counter() - t0
    gen, upd, count = [], [], 0
    for i in range(repeat + 1):  # the first call warms up
        params = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=i)
        t0 = time.perf_counter()
        r = sampler.generate(prompts, params, n=n)
        if i:
            gen.append(time.perf_counter() - t0)
            count = int(r.response_mask.sum())
        t0 = time.perf_counter()
        sampler.load_weights(weights, i + 1)
        if i:
            upd.append(time.perf_counter() - t0)
    sampler.close()
    g = statistics.median(gen)
    return {"start_s": start_s, "generate_s": g, "tokens": count, "tokens_per_s": count / g,
            "load_weights_s": statistics.median(upd)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model folder (default: the built-in model)")
    parser.add_argument("--specs", nargs="+", default=["vllm:fp32", "vllm:bf16", "hf:fp32", "hf:bf16"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from rollcorr.audit.collect import builtin_prompts
    from rollcorr.engines import make_learner

    learner = make_learner("hf:fp32", args.model)
    weights = {k: v.detach().clone() for k, v in learner.state_dict().items()}
    prompts = builtin_prompts(args.prompts, seed=0)
    if args.model is not None:  # a chat model: plain questions
        prompts = [f"Question {i}: what is {i} + {i + 1}? Answer:" for i in range(args.prompts)]
    print(f"load {os.getloadavg()[0]:.1f} · {args.prompts} prompts × {args.n} · {args.tokens} new tokens")
    print(f"{'spec':<12} {'start s':>8} {'generate s':>11} {'tokens':>7} {'tok/s':>8} {'update s':>9}")
    for spec in args.specs:
        row = bench(spec, args.model, prompts, args.n, args.tokens, args.repeat, weights)
        print(f"{spec:<12} {row['start_s']:8.1f} {row['generate_s']:11.3f} {row['tokens']:7d} "
              f"{row['tokens_per_s']:8.0f} {row['load_weights_s']:9.3f}", flush=True)


if __name__ == "__main__":
    main()
