"""One check of rollcorr's GPU paths, in under 8 minutes on one GPU, with the PyTorch and transformers the machine
has (nothing is installed; the source tree is put on the path).

    python scripts/check_gpu.py                    # on CUDA: one JSON line per check, exit 0 when all passed
    python scripts/check_gpu.py --device cpu       # the same checks on the CPU (CI runs this)
    python scripts/check_gpu.py --out FILE         # the lines also written to FILE

The checks, each a JSON line {"check", "ok", "seconds", ...numbers}:
  1. ``audit``: the built-in model sampled by hf:bf16 and scored by hf:fp32 on the device (the audit's collect
     and statistics): k3 and the share of tokens at |Δp| ≥ 0.01, both engines on the device;
  2. ``amp-bf16``, ``amp-fp16``: three training steps of the mixed-precision learners on the device
     (``model.device``), finite losses, the fp16 run's loss scale and overflow skips;
  3. ``exact``: the bitwise-exact pair on the device — the sampler's decode and the learner's forward give the
     same log-probs bit for bit;
  4. ``distributed``: ``scripts/check_distributed_gpu.py`` at one rank (NCCL on CUDA, gloo on the CPU) through
     torchrun.
A check that cannot run (a package the machine lacks) is reported with ``"ok": false`` and why, not hidden.
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


def check_audit(device: str) -> dict:
    import torch

    from rollcorr.audit.collect import builtin_prompts, collect, from_rollout
    from rollcorr.audit.stats import audit_stats
    from rollcorr.engines import SamplingParams, make_learner, make_sampler

    sampler, learner = make_sampler("hf:bf16", device=device), make_learner("hf:fp32", device=device)
    rollout = collect(sampler, learner, builtin_prompts(16), SamplingParams(max_new_tokens=16, seed=0), n=4, batch_size=16)
    data = from_rollout(rollout)
    stats = audit_stats(data.rollout_log_prob, data.old_log_prob, data.response_mask)
    on_device = next(learner.model.parameters()).device.type == torch.device(device).type
    k3 = stats["divergence"]["k3_kl"]
    return {"ok": on_device and 0 < k3 < 0.1, "device": str(next(learner.model.parameters()).device), "k3": k3,
            "share_ge_0.01": stats["probability"]["prob_diff_frac_ge_0.01"], "tokens": stats["n_tokens"]}


def check_amp(device: str, learner_spec: str, sampler_spec: str) -> dict:
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import run

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(None, [f"model.learner={learner_spec}", f"model.sampler={sampler_spec}",
                                    f"model.device={device}", "trainer.steps=3", "trainer.eval_every=0",
                                    "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
                                    "trainer.checkpoint_every=0", "rollout.prompts_per_step=8",
                                    "optim.skip_zero_grad=false", f"trainer.out={tmp}/run"])  # fmt: skip
        result = run(config, run_dir=Path(tmp) / "run")
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss/policy" in r]
    losses = [r["loss/policy"] for r in steps]
    out = {"ok": result.steps == 3 and result.stopped is None and all(x is not None for x in losses),
           "losses": losses, "final_accuracy": result.final_accuracy}  # fmt: skip
    if "train/amp_loss_scale" in steps[-1]:
        out |= {"loss_scale": steps[-1]["train/amp_loss_scale"],
                "overflow_skips": sum(r["train/amp_overflow_skips"] for r in steps)}  # fmt: skip
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
                          capture_output=True, text=True, env=env, timeout=400)  # fmt: skip
    said = [line for line in done.stdout.splitlines() if line.startswith("[check]")]
    return {"ok": done.returncode == 0, "lines": said[-4:], **({"stderr": done.stderr[-800:]} if done.returncode else {})}


CHECKS = {
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
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON lines to this file")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"check": "device", "ok": False, "why": "no CUDA device (use --device cpu)"}))
        return 2
    head = {"check": "machine", "ok": True, "torch": torch.__version__, "device": args.device,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}  # fmt: skip
    lines, failed = [head], 0
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
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
