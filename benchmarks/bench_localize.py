"""The cost of `rollcorr audit --localize` against the audit it diagnoses, one run, one process.

    python benchmarks/bench_localize.py --model models/smollm2-135m --cli  # → benchmarks/results/bench_localize.txt
    python benchmarks/bench_localize.py --out -                          # the built-in model, printed only

The audit's sampling and scoring (`collect`: the sampler's decode and the learner's forward, what a plain audit
computes), then `localize` on the same responses: the default (every component's share estimated to first order
in one backward, the largest estimates measured exactly) and `--localize-exact` (every component swapped in alone,
each from its own layer on, the unchanged prefix kept from the reference forward); `--whole` adds the way it ran
before the prefix was reused (each component a whole forward of the learner; the same shares bit for bit, checked).
The ratios are of the same run: localize's time over the audit's (the mean of the audit timed before and after
the default, the same tokens both times), in wall and in CPU seconds (on a shared machine other jobs stretch the
wall time of each part differently; the CPU time is what it computes). Below, how the
default's shares compare with the exact ones: the top component of each, and each share the default measured
against the exact run's; `--cli` adds `rollcorr audit` timed end to end, plain and with --localize. A real model is read with its chat template and the arithmetic
prompts of examples/arithmetic, as experiments/audit_diagnosis.py audits it. Models are loaded before the clock
starts. The machine (CPU, load before and after) heads the output.
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


def cpu_seconds() -> float:
    """CPU seconds spent so far by this process and its finished children (user + system): what a run computes,
    which other jobs on a shared machine stretch far less than its wall time."""
    import resource

    mine, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime


def timed(fn):
    """fn's result and the (wall, CPU) seconds it took."""
    start, cpu = time.perf_counter(), cpu_seconds()
    out = fn()
    return out, (time.perf_counter() - start, cpu_seconds() - cpu)


def mean(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return (a[0] + b[0]) / 2, (a[1] + b[1]) / 2


def ratio_row(name: str, sec: tuple[float, float], base: tuple[float, float]) -> str:
    """A table row: wall seconds and their ratio to ``base``'s, CPU seconds and theirs."""
    return f"{name} | {sec[0]:.1f} | {sec[0] / base[0]:.2f} | {sec[1]:.1f} | {sec[1] / base[1]:.2f}"


def agreement(fast: dict, exact: dict) -> list[str]:
    """How the default's shares compare with --localize-exact's: the top component of each (and whether the same),
    the default's exactly measured components against the exact run's, its first-order sum."""
    top = [max(loc["components"], key=lambda c: c["share"]) for loc in (fast, exact)]
    shares = {c["component"]: c["share"] for c in exact["components"]}
    lines = [f"top component | default: {top[0]['component']} {100 * top[0]['share']:.1f} % ({top[0]['method']}) | "
             f"exact: {top[1]['component']} {100 * top[1]['share']:.1f} % | same: {top[0]['component'] == top[1]['component']}"]
    for c in sorted(fast["components"], key=lambda c: -abs(c["estimate"])):
        if c["method"] == "exact" and c["component"] in fast["refined"]:
            lines.append(f"measured by the default | {c['component']}: {100 * c['share']:.1f} % (estimate "
                         f"{100 * c['estimate']:.1f} %) | exact run: {100 * shares[c['component']]:.1f} % |")
    lines.append(f"sum of the shares | default (measured and estimated): {100 * fast['share_sum']:.0f} % | exact: "
                 f"{100 * exact['share_sum']:.0f} % |")
    return lines


def end_to_end(args) -> list[str]:
    """What a user waits for: ``rollcorr audit`` as a command (Python's start, the models loaded, sampling, scoring,
    the report and its figures written), plain, then with ``--localize``, then plain again (the plain runs'
    mean against the load's drift), each with ``args.threads`` torch threads; the same model, prompts and chat
    template as the timings above."""
    import subprocess
    import sys
    import tempfile

    words = ["-n", str(args.n), "--max-new-tokens", str(args.max_new_tokens), "--temperature", f"{args.temperature:g}",
             "--sampler", args.sampler, "--learner", "hf:fp32"]
    if args.model:
        words += ["--model", args.model, "--prompts", str(PROMPTS.relative_to(ROOT)), "--chat"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    seconds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, extra in enumerate(([], ["--localize"], [])):
            argv = [sys.executable, "-m", "rollcorr", "audit", *words, *extra, "--out", f"{tmp}/audit{i}"]
            done, sec = timed(lambda argv=argv: subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True))
            if done.returncode != 0:
                raise SystemExit(f"bench_localize: {' '.join(argv[2:])} failed: {done.stderr[-500:]}")
            seconds.append(sec)
    plain = mean(seconds[0], seconds[2])
    return [f"# end to end: rollcorr audit {' '.join(words)} [--localize]; plain {seconds[0][0]:.1f} s before and "
            f"{seconds[2][0]:.1f} s after (wall)",
            "end to end | wall s | / plain audit | CPU s | / plain audit (CPU)",
            ratio_row("rollcorr audit (mean of the runs before and after)", plain, plain),
            ratio_row("rollcorr audit --localize", seconds[1], plain)]


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
    parser.add_argument("--whole", action="store_true", help="also time the exact mode with whole forwards (before #50)")
    parser.add_argument("--cli", action="store_true", help="also time `rollcorr audit` end to end, plain and with "
                        "--localize")
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
    rollout, audit_before = timed(lambda: collect(sampler, learner, prompts, params, batch_size=8))
    kw = {"temperature": args.temperature, "responses": args.n, "audit_log_mu": rollout.rollout_log_prob}
    fast, fast_s = timed(lambda: loc_mod.localize(sampler, learner, rollout, **kw))
    again, audit_after = timed(lambda: collect(sampler, learner, prompts, params, batch_size=8))
    if not torch.equal(again.response_ids, rollout.response_ids):
        raise SystemExit("bench_localize: the audit sampled other tokens the second time")
    audit_s = mean(audit_before, audit_after)  # the audit on either side of the default, against the load's drift
    exact, exact_s = timed(lambda: loc_mod.localize(sampler, learner, rollout, exact=True, **kw))
    rows = [("audit: sampling and scoring (mean of the runs before and after the default)", audit_s),
            ("localize (default: first-order estimate, largest measured)", fast_s),
            ("localize --localize-exact (prefix reused)", exact_s)]
    if args.whole:
        with mock.patch.object(loc_mod, "start_layer", lambda model, paths: None):  # every component a whole forward
            before, before_s = timed(lambda: loc_mod.localize(sampler, learner, rollout, exact=True, **kw))
        if [c["k3"] for c in exact["components"]] != [c["k3"] for c in before["components"]]:
            raise SystemExit("bench_localize: the prefix reused and the whole forwards gave different shares")
        rows.append(("localize --localize-exact, whole forwards (before #50)", before_s))
    tokens = int(rollout.response_mask.sum())
    lines = [header,
             f"# {Path(args.model).name if args.model else 'built-in model'} ({layers} layers), sampler {args.sampler} vs hf:fp32; {args.n} responses "
             f"of <= {args.max_new_tokens} tokens ({tokens} tokens), temperature {args.temperature}; {args.threads} "
             f"torch thread(s); command: python benchmarks/bench_localize.py"
             + (f" --model {args.model}" if args.model else "") + f" -n {args.n} --max-new-tokens "
             f"{args.max_new_tokens}" + (" --whole" if args.whole else "") + (" --cli" if args.cli else ""),
             f"# the audit took {audit_before[0]:.1f} s before the default and {audit_after[0]:.1f} s after it (wall)",
             "measure | wall s | / audit | CPU s | / audit (CPU)",
             *(ratio_row(name, sec, audit_s) for name, sec in rows),
             *agreement(fast, exact),
             *(end_to_end(args) if args.cli else []),
             f"# load after {load()}"]
    text = "\n".join(lines)
    print(text)
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
