"""What a user sees: ``metrics.jsonl``, TensorBoard events, optional W&B, and a rich progress bar."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from rollcorr.safe_io import check_inside_dir, open_text_inside

# the columns of the progress bar: (metric key, label, format)
PROGRESS_FIELDS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("eval/accuracy", "acc", "{:.3f}"),
    ("staleness/lag_mean", "lag", "{:.2f}"),
    ("rollout_corr/kl", "kl", "{:.1e}"),
    ("rollout_corr/log_ppl_abs_diff", "|Δlogppl|", "{:.1e}"),
    ("rollout_corr/rollout_rs_masked_fraction", "rej", "{:.3f}"),
)


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


class RunLogger:
    """Appends one JSON line per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard / W&B.

    ``resume_step``: the run continues from the checkpoint at that step (``metrics.jsonl`` was already cut
    there by ``rundir.repair_metrics``); TensorBoard events after it are purged.
    """

    def __init__(self, run_dir: Path, total_steps: int, *, tensorboard: bool = True, wandb: bool = False,
                 progress: bool = True, config: dict | None = None, resume_step: int | None = None):  # fmt: skip
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.file = open_text_inside(self.path, "a")  # a planted link or FIFO is refused, never followed
        self.last: dict[str, float] = {}
        self.tb = None
        if tensorboard:
            check_inside_dir(self.run_dir / "tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=resume_step)
        self.wandb = None
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError:
                print("trainer.wandb=true but the wandb package is not installed: logging locally only")
            else:
                self.wandb = wandb_lib.init(project="rollcorr", dir=str(self.run_dir), config=config,
                                            resume="allow")  # fmt: skip
        self.progress = None
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            from rich.table import Column

            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[stats]}", table_column=Column(no_wrap=False, ratio=1)),
            )  # fmt: skip
            self.task = self.progress.add_task(
                "train", total=total_steps, completed=resume_step or 0, stats=""
            )
            self.progress.start()

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        if os.fstat(self.file.fileno()).st_nlink == 0:  # `rm -rf RUN` mid-run: stop, never carry on unseen
            from rollcorr.train.rundir import RunFolderError

            raise RunFolderError(f"{self.run_dir}: the run folder was removed while the run was going (its "
                                 f"metrics.jsonl is gone); stopped at step {step}")  # fmt: skip
        record: dict[str, Any] = {"step": step}
        record.update({k: _finite_or_none(float(v)) for k, v in sorted(metrics.items())})
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.last.update(metrics)
        if self.tb is not None:
            for k, v in metrics.items():
                if math.isfinite(float(v)):
                    self.tb.add_scalar(k, float(v), step)
        if self.wandb is not None:
            self.wandb.log(dict(metrics), step=step)
        if self.progress is not None:
            stats = "  ".join(
                f"{label} {fmt.format(self.last[key])}"
                for key, label, fmt in PROGRESS_FIELDS
                if key in self.last
            )
            self.progress.update(self.task, completed=step if advance else None, stats=stats)

    def message(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text)
        else:  # plain output (trainer.progress=false): the same text without its rich markup
            from rich.errors import MarkupError
            from rich.text import Text

            try:
                text = Text.from_markup(text).plain
            except MarkupError:
                pass
            print(text, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    with open_text_inside(Path(run_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f.read().splitlines() if line.strip()]
