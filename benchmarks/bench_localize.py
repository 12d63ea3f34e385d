"""The cost of `rollcorr audit --localize` against the audit it diagnoses, one run, one process.

    python benchmarks/bench_localize.py --model models/smollm2-135m     # → benchmarks/results/bench_localize.txt
    python benchmarks/bench_localize.py --out -                          # the built-in model, printed only

The audit's sampling and scoring (`collect`: the sampler's decode and the learner's forward, what a plain audit
computes), then `localize` on the same responses twice: as it runs now (each component from its own layer on, the
unchanged prefix kept from the reference forward) and as it ran before (each component a whole forward of the
learner). Both give the same shares, bit for bit (checked here); the ratios are of the same run. A real model is
read with its chat template and the arithmetic prompts of examples/arithmetic, as experiments/audit_diagnosis.py
audits it. Models are loaded before the clock starts. The machine (CPU, load before and after) heads the output.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from unittest import mock

import torch
from machine import load, machine  # benchmarks/machine.py (a benchmark runs as a script from its folder)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "examples/arithmetic/train.jsonl"


def prompts_for(learner, model: str | None, n: int) -> list:
    """n prompts: the built-in task's, or the arithmetic prompts through the model's chat template."""
    from rollcorr.audit.collect import builtin_prompts, load_prompts
    from rollcorr.tasks.chat import model_input

    if model is None:
        return builtin_prompts(n)
    return [model_input(learner.tokenizer, p, chat=True) for p in load_prompts(PROMPTS)[:n]]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    from rollcorr.audit import localize as loc_mod
    from rollcorr.audit.collect import collect
    from rollcorr.engines import SamplingParams, make_learner, make_sampler

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the built-in model)")
    parser.add_argument("--sampler", default="hf:bf16")
    parser.add_argument("-n", type=int, default=8, help="responses (all of them localised)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/bench_localize.txt"), help="- for stdout only")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    busy = os.getloadavg()[0] > (os.cpu_count() or 1)
    header = f"# bench_localize: {machine()}; load before {load()}" + (
        " (a loaded machine: other jobs shared its cores)" if busy else "")
    learner = make_learner("hf:fp32", model_path=args.model)
    sampler = make_sampler(args.sampler, model_path=args.model)
    layers = learner.model.config.num_hidden_layers
    prompts = prompts_for(learner, args.model, args.n)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
    rollout, audit_s = timed(lambda: collect(sampler, learner, prompts, params, batch_size=8))
    kw = {"temperature": args.temperature, "responses": args.n, "audit_log_mu": rollout.rollout_log_prob}
    now, now_s = timed(lambda: loc_mod.localize(sampler, learner, rollout, **kw))
    with mock.patch.object(loc_mod, "start_layer", lambda model, paths: None):  # every component a whole forward
        before, before_s = timed(lambda: loc_mod.localize(sampler, learner, rollout, **kw))
    same = [c["k3"] for c in now["components"]] == [c["k3"] for c in before["components"]]
    if not same:
        raise SystemExit("bench_localize: the two ways gave different shares")
    tokens = int(rollout.response_mask.sum())
    lines = [header,
             f"# {Path(args.model).name if args.model else 'built-in model'} ({layers} layers), sampler {args.sampler} vs hf:fp32; {args.n} responses "
             f"of <= {args.max_new_tokens} tokens ({tokens} tokens), temperature {args.temperature}; {args.threads} "
             f"torch thread(s); command: python benchmarks/bench_localize.py"
             + (f" --model {Path(args.model).name}" if args.model else "") + f" -n {args.n} --max-new-tokens "
             f"{args.max_new_tokens}",
             f"# shares identical both ways: {same}; top component: {now['entry'].split(':')[0]}",
             "measure | seconds | / audit",
             f"audit: sampling and scoring | {audit_s:.1f} | 1",
             f"localize, prefix reused | {now_s:.1f} | {now_s / audit_s:.2f}",
             f"localize, whole forwards (before) | {before_s:.1f} | {before_s / audit_s:.2f}",
             f"before / now | {before_s / now_s:.2f} |",
             f"# load after {load()}"]
    text = "\n".join(lines)
    print(text)
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
