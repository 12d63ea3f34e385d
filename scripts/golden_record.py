"""Record (or check) the default training run's metrics, step by step: the "behaviour unchanged" guard.

Runs ``rollcorr train`` with the shipped default config for 60 steps (seed 0, one thread, evaluation every 20
steps, no progress bar, no TensorBoard) and writes every logged step's metrics to a JSON file, together with
the CPU kernels torch used (``torch.backends.cpu.get_cpu_capability()``): sampled tokens — hence every metric —
depend on them, so a record only checks a run on the same capability.

    .venv/bin/python scripts/golden_record.py                       # write tests/data/golden_default_60.json
    .venv/bin/python scripts/golden_record.py --check               # rerun and compare to it (rel 1e-4)
    .venv/bin/python scripts/golden_record.py --out /tmp/run.json   # write elsewhere

tests/test_golden_record.py runs the check (marked slow).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

RECORD = Path(__file__).resolve().parents[1] / "tests" / "data" / "golden_default_60.json"
OVERRIDES = [
    "trainer.steps=60",
    "trainer.seed=0",
    "trainer.eval_every=20",
    "trainer.progress=false",
    "trainer.tensorboard=false",
    "trainer.threads=1",
    "trainer.plot=false",
]
# metrics renamed since the record was written: {name in the record: name now} (see ``compare``)
RENAMED: dict[str, str] = {
    # the version lag is logged once, by the Rollout (the correction no longer repeats it)
    "rollout_corr/staleness_mean": "staleness/lag_mean",
    "rollout_corr/staleness_max": "staleness/lag_max",
    # "staleness" is the version lag only; log π_θ − log π_old is the drift
    "factors/staleness_log_mean": "factors/drift_log_mean",
    "rollout_corr/staleness_k3": "rollout_corr/drift_k3",
    "factors/staleness_log_std": "factors/drift_log_std",
    "factors/staleness_log_abs_mean": "factors/drift_log_abs_mean",
    "factors/staleness_ratio_mean": "factors/drift_ratio_mean",
}
# metrics added since the record was written (not compared: the record has no value for them)
ADDED: frozenset[str] = frozenset({
    "learner/ranks",  # data-parallel learner processes (1 here)
})
# wall-clock measurements: never compared
TIMING_PREFIXES = ("time/",)
TIMING_SUFFIXES = ("_s", "/seconds", "_seconds")


def is_timing(key: str) -> bool:
    return key.startswith(TIMING_PREFIXES) or key.endswith(TIMING_SUFFIXES)


def record_run() -> dict[str, Any]:
    """Train the default config with OVERRIDES in a temporary run folder; every metrics.jsonl line."""
    import torch

    from rollcorr.train.config import load_config
    from rollcorr.train.logging import read_metrics
    from rollcorr.train.loop import run

    torch.set_num_threads(1)
    config = load_config(None, OVERRIDES)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(config, run_dir=Path(tmp) / "run")
        steps = read_metrics(result.run_dir)
    return {
        "overrides": OVERRIDES,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "steps": steps,
    }


def compare(golden: dict[str, Any], new: dict[str, Any], renamed: dict[str, str] | None = None,
            rel: float = 1e-4, abs_tol: float = 1e-6, added: frozenset[str] = frozenset()) -> list[str]:
    """Differences between two records' metrics (timing keys excluded), one line each; [] when they match.

    ``renamed``: {name in the record: name now}. A metric that was logged twice under two names and now once
    maps to the surviving name, and both recorded values must equal it. ``added``: metrics new since the
    record, accepted as new (every other new metric is a difference).
    """
    renamed = renamed or {}
    problems = []
    if len(golden["steps"]) != len(new["steps"]):
        problems.append(f"{len(golden['steps'])} logged lines in the record, {len(new['steps'])} now")
    for old_line, new_line in zip(golden["steps"], new["steps"], strict=False):
        step = old_line.get("step")
        pairs = [(k, renamed.get(k, k)) for k in old_line if not is_timing(k)]
        new_keys = {k for k in new_line if not is_timing(k)}
        for old_key, key in sorted(pairs):
            if key not in new_line:
                problems.append(
                    f"step {step}: {old_key} missing now" + (f" (as {key})" if key != old_key else "")
                )
        for key in sorted(new_keys - {k for _, k in pairs} - added):
            problems.append(f"step {step}: {key} new (not in the record)")
        for old_key, key in sorted(pairs):
            if key not in new_line:
                continue
            a, b = old_line[old_key], new_line[key]
            if a is None or b is None:
                if (a is None) != (b is None):
                    problems.append(f"step {step}: {key} {a!r} in the record, {b!r} now")
            elif not math.isclose(a, b, rel_tol=rel, abs_tol=abs_tol):
                problems.append(f"step {step}: {key} {a!r} in the record, {b!r} now")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=RECORD, help="where to write the record")
    parser.add_argument(
        "--check", action="store_true", help="compare a new run to --out instead of writing it"
    )
    args = parser.parse_args(argv)
    new = record_run()
    if args.check:
        golden = json.loads(args.out.read_text())
        if golden["cpu_capability"] != new["cpu_capability"]:
            print(
                f"recorded on {golden['cpu_capability']}, this machine runs {new['cpu_capability']}: not comparable"
            )
            return 2
        problems = compare(golden, new, RENAMED, added=ADDED)
        for line in problems[:40]:
            print(line)
        print(f"{len(problems)} differences" if problems else "matches the record")
        return 1 if problems else 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(new, indent=1) + "\n")
    print(f"wrote {args.out}: {len(new['steps'])} lines, cpu capability {new['cpu_capability']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
