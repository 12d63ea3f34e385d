"""One check of rollcorr's GPU paths, in under 8 minutes on one GPU, with the PyTorch and transformers the machine
has (nothing is installed; the source tree is put on the path).

    python scripts/check_gpu.py                    # on CUDA: one JSON line per check, exit 0 when all passed;
                                                   # the lines, with timings, also go to the results file
    python scripts/check_gpu.py --device cpu       # the same checks on the CPU (CI runs this)
    python scripts/check_gpu.py --out FILE         # the results file (default on CUDA: RESULTS below)

The checks, each a JSON line {"check", "ok", "seconds", ...numbers}:
  1. ``correction``: ``compute_correction`` (the default path, every metric, ``metrics_to_floats``) on device
     tensors for three presets at a few shapes: ms per call (the median of timed calls after a warm-up, the
     device synchronised by reading the floats), and its agreement with the same call in float64 on the CPU;
  2. ``audit``: the built-in model sampled by hf:bf16 and scored by hf:fp32 on the device (the audit's collect
     and statistics): k3 and the share of tokens at |Δp| ≥ 0.01, both engines on the device, tokens per second;
  3. ``amp-bf16``, ``amp-fp16``: three training steps of the mixed-precision learners on the device
     (``model.device``), finite losses, the fp16 run's loss scale and overflow skips, seconds per step;
  4. ``exact``: the bitwise-exact pair on the device — the sampler's decode and the learner's forward give the
     same log-probs bit for bit;
  5. ``distributed``: ``scripts/check_distributed_gpu.py`` at one rank (NCCL on CUDA, gloo on the CPU) through
     torchrun.
A check that cannot run (a package the machine lacks) is reported with ``"ok": false`` and why, not hidden.
The results file starts with a ``#`` header naming the machine, the GPU, the load and the command, so that the
first GPU run leaves its numbers in the repository (commit it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
RESULTS = ROOT / "benchmarks/results/check_gpu_cuda.txt"  # where a CUDA run writes its lines by default
CORRECTION_PRESETS = ("decoupled_token_is", "decoupled_seq_is_rs", "decoupled_geo_rs_token_tis")


def check_correction(device: str) -> dict:
    import statistics

    import torch

    from rollcorr.config import preset
    from rollcorr.correction import compute_correction, metrics_to_floats

    shapes = [(64, 2048), (256, 8192), (1024, 16384)] if device == "cuda" else [(8, 512), (64, 2048)]
    ms, worst = {}, 0.0
    g = torch.Generator().manual_seed(0)
    for b, t in shapes:
        rollout = -torch.rand(b, t, generator=g) * 4 - 1e-3
        old = (rollout + 0.05 * torch.randn(b, t, generator=g)).clamp(max=-1e-4)
        mask = torch.arange(t)[None] < torch.randint(t // 4, t + 1, (b, 1), generator=g)
        on_device = [x.to(device) for x in (old, rollout, mask)]
        for name in CORRECTION_PRESETS:
            config = preset(name)
            call = lambda on_device=on_device, config=config: metrics_to_floats(  # noqa: E731
                compute_correction(*on_device, config).metrics)
            for _ in range(2):
                got = call()  # warm-up (the floats: every kernel has run)
            times = []
            for _ in range(10 if b * t <= 1 << 22 else 3):
                start = time.perf_counter()
                call()
                times.append((time.perf_counter() - start) * 1e3)
            ms[f"{b}x{t} {name}"] = round(statistics.median(times), 3)
            exact = metrics_to_floats(compute_correction(old.double(), rollout.double(), mask, config).metrics)
            for key, value in exact.items():  # float32 on the device against float64 on the CPU
                if key.endswith("_std"):
                    continue  # sqrt of a difference of moments: its last float32 bits move more (docs/verl.md)
                worst = max(worst, abs(got[key] - value) / max(abs(value), 1.0))
    return {"ok": worst < 1e-3, "ms_per_call": ms, "max_relative_difference_vs_float64_cpu": worst}


def check_audit(device: str) -> dict:
    import torch

    from rollcorr.audit.collect import builtin_prompts, collect, from_rollout
    from rollcorr.audit.stats import audit_stats
    from rollcorr.engines import SamplingParams, make_learner, make_sampler

    sampler, learner = make_sampler("hf:bf16", device=device), make_learner("hf:fp32", device=device)
    start = time.perf_counter()  # the audit itself: sampling, scoring and its statistics
    rollout = collect(sampler, learner, builtin_prompts(16), SamplingParams(max_new_tokens=16, seed=0), n=4, batch_size=16)
    data = from_rollout(rollout)
    stats = audit_stats(data.rollout_log_prob, data.old_log_prob, data.response_mask)
    on_device = next(learner.model.parameters()).device.type == torch.device(device).type
    k3 = stats["divergence"]["k3_kl"]
    return {"ok": on_device and 0 < k3 < 0.1, "device": str(next(learner.model.parameters()).device), "k3": k3,
            "share_ge_0.01": stats["probability"]["prob_diff_frac_ge_0.01"], "tokens": stats["n_tokens"],
            "audit_seconds": round(time.perf_counter() - start, 2)}


def check_amp(device: str, learner_spec: str, sampler_spec: str) -> dict:
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import run

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(None, [f"model.learner={learner_spec}", f"model.sampler={sampler_spec}",
                                    f"model.device={device}", "trainer.steps=3", "trainer.eval_every=0",
                                    "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
                                    "trainer.checkpoint_every=0", "rollout.prompts_per_step=8",
                                    "optim.skip_zero_grad=false", f"trainer.out={tmp}/run"])
        result = run(config, run_dir=Path(tmp) / "run")
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss/policy" in r]
    losses = [r["loss/policy"] for r in steps]
    step_s = sorted(r["time/step_s"] for r in steps)
    out = {"ok": result.steps == 3 and result.stopped is None and all(x is not None for x in losses),
           "losses": losses, "final_accuracy": result.final_accuracy,
           "step_seconds_median": round(step_s[len(step_s) // 2], 4),
           "step_seconds": [round(x, 4) for x in step_s]}
    if "train/amp_loss_scale" in steps[-1]:
        out |= {"loss_scale": steps[-1]["train/amp_loss_scale"],
                "overflow_skips": sum(r["train/amp_overflow_skips"] for r in steps)}
    return out


def check_exact(device: str) -> dict:
    from rollcorr.audit.collect import builtin_prompts
    from rollcorr.engines import SamplingParams, make_learner, make_sampler

    sampler, learner = make_sampler("hf:exact", device=device), make_learner("hf:exact", device=device)
    rollout = sampler.generate(builtin_prompts(8), SamplingParams(max_new_tokens=6, seed=0), n=2)
    mask = rollout.response_mask.bool()
    differing = int((learner.log_prob(rollout).cpu()[mask] != rollout.rollout_log_prob[mask]).sum())
    return {"ok": differing == 0, "tokens": int(mask.sum()), "tokens_differing": differing}


def check_distributed(device: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           str(ROOT / "scripts/check_distributed_gpu.py"), "--device", device, "--steps", "2"],
                          capture_output=True, text=True, env=env, timeout=400)
    said = [line for line in done.stdout.splitlines() if line.startswith("[check]")]
    return {"ok": done.returncode == 0, "lines": said[-4:], **({"stderr": done.stderr[-800:]} if done.returncode else {})}


CHECKS = {
    "correction": check_correction,
    "audit": check_audit,
    "amp-bf16": lambda device: check_amp(device, "hf:amp-bf16", "hf:bf16"),
    "amp-fp16": lambda device: check_amp(device, "hf:amp-fp16", "hf:fp16"),
    "exact": check_exact,
    "distributed": check_distributed,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--only", nargs="*", choices=list(CHECKS), help="run these checks only")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the results file (default on CUDA: {RESULTS.relative_to(ROOT)}; none on the CPU)")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"check": "device", "ok": False, "why": "no CUDA device (use --device cpu)"}))
        return 2
    head = {"check": "machine", "ok": True, "torch": torch.__version__, "device": args.device,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}
    lines, failed = [head], 0
    load_before = _load()
    print(json.dumps(head), flush=True)
    for name, check in CHECKS.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        try:
            result = check(args.device)
        except ImportError as err:  # a package this machine lacks: said, not hidden
            result = {"ok": False, "why": f"missing package: {err}"}
        except Exception as err:  # noqa: BLE001 — a failing check is reported with its error, the others still run
            result = {"ok": False, "why": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-1500:]}
        line = {"check": name, **result, "seconds": round(time.perf_counter() - start, 1)}
        failed += not line["ok"]
        lines.append(line)
        print(json.dumps(line), flush=True)
    out = args.out if args.out is not None else (RESULTS if args.device == "cuda" else None)
    if out is not None:
        command = " ".join(["python scripts/check_gpu.py", *(argv if argv is not None else sys.argv[1:])])
        header = (f"# check_gpu: {_machine()}; device {args.device} ({head['gpu'] or 'no GPU'}); torch "
                  f"{torch.__version__}; load before {load_before}, after {_load()}; command: {command}\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(header + "".join(json.dumps(line) + "\n" for line in lines))
    return 1 if failed else 0


def _machine() -> str:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from machine import machine

    return machine()


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    raise SystemExit(main())
