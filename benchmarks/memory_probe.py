"""One ``rollcorr train`` run in this process, watched for memory: prints one JSON line at its end.

    python benchmarks/memory_probe.py --config instruct trainer.steps=2 model.path=... task.name=...

Measured: the process's peak resident set (``ru_maxrss``: exact, whatever the machine's load); where it sat (a
thread reads the resident set every 5 ms and, at each new largest value, the main thread's frames: the step and
the innermost rollcorr functions, with ``backward`` or the optimizer's step when it is inside them); the resident
set once the libraries are imported (before any model loads); what each part of the run holds at its end
(``rollcorr.train.memory.held_bytes`` over the ``Trainer``'s attributes, each storage counted once, for the first
part that holds it: the learner, its optimizer, then the rest in the order the trainer made them); the learner's
CPU seconds per step (the main thread's ``time.thread_time`` in ``optimize``: its forwards with gradient, backward
passes and AdamW steps — CPU time, so a loaded machine changes it little) and the run's; the final checkpoint's
files. ``benchmarks/bench_train.py --memory`` runs it once per variant and prints the table.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from rollcorr.train import step as step_module
from rollcorr.train.config import load_config
from rollcorr.train.loop import Trainer
from rollcorr.train.memory import held_bytes, resident_bytes

INSIDE = {"backward": "backward", "_single_tensor_adam": "AdamW", "_multi_tensor_adam": "AdamW",
          "_try_alone": "AdamW (dry run)"}


def where(frame, trainer: Trainer | None) -> str:
    """'step N: f › g › h' — the innermost three rollcorr functions of a stack, and what torch was doing in them."""
    frames = traceback.extract_stack(frame)
    ours = [f.name for f in frames if f"{os.sep}rollcorr{os.sep}" in f.filename and f.name != "<listcomp>"]
    inside = next((INSIDE[f.name] for f in reversed(frames) if f.name in INSIDE), None)
    names = [n for n in ours[-3:]] + ([inside] if inside and inside not in ours[-3:] else [])
    step = f"step {trainer.step + 1}: " if trainer is not None and ours and "_one_step" in ours else ""
    return step + " › ".join(names)


class Watcher(threading.Thread):
    """Reads the resident set every ``every_s``; at each new largest value, where the main thread is."""

    def __init__(self, every_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.every_s, self.peak, self.at, self.trainer = every_s, 0, "", None
        self.main = threading.main_thread().ident
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            rss = resident_bytes()
            if rss > self.peak:
                frame = sys._current_frames().get(self.main)
                self.peak, self.at = rss, where(frame, self.trainer) if frame is not None else ""
            time.sleep(self.every_s)


def timed_optimize(seconds: list[float]):
    """``step.optimize`` with the main thread's CPU seconds in it appended to ``seconds``."""
    optimize = step_module.optimize

    def wrapped(*args, **kwargs):
        start = time.thread_time()
        try:
            return optimize(*args, **kwargs)
        finally:
            seconds.append(time.thread_time() - start)

    return wrapped


def main(argv: list[str]) -> dict:
    preset = argv[argv.index("--config") + 1] if "--config" in argv else None
    overrides = [a for a in argv if "=" in a]
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    libraries = resident_bytes()
    watcher = Watcher()
    watcher.start()
    learner_cpu: list[float] = []
    step_module.optimize = timed_optimize(learner_cpu)
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(preset, ["trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
                                      "trainer.checkpoint_every=0", f"trainer.out={tmp}/run", *overrides])
        cpu = time.process_time()
        trainer = Trainer(config)
        watcher.trainer = trainer
        trainer.run()
        cpu = time.process_time() - cpu
        watcher.done.set()
        parts = {"learner": trainer.learner, "optimizer": trainer.optimizer}
        parts |= {name: value for name, value in vars(trainer).items() if name not in parts}
        held = {name: b for name, b in held_bytes(parts).items() if b}
        checkpoint = max((Path(tmp) / "run" / "checkpoints").iterdir())
        files = {"state.pt": (checkpoint / "state.pt").stat().st_size,
                 "model/": sum(f.stat().st_size for f in (checkpoint / "model").rglob("*") if f.is_file())}
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in trainer.learner.model.parameters()}.values())
    trainable = sum(p.numel() * p.element_size() for p in trainer.learner.model.parameters() if p.requires_grad)
    accuracy = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "sampled_peak": watcher.peak,
            "where": watcher.at, "libraries": libraries, "held": held, "weights": weights, "trainable": trainable,
            "learner_cpu_s": learner_cpu, "run_cpu_s": cpu, "steps": trainer.step, "checkpoint": files,
            "accuracy": accuracy}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
