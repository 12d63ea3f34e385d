"""What a user sees: ``metrics.jsonl``, TensorBoard events, optional W&B, and a rich progress bar in a terminal —
or, when the output is not a terminal (a file, a pipe, a job log), one plain line per step at most every
``trainer.log_every_s`` seconds (and the last step), never wrapped."""

from __future__ import annotations

import json
import math
import os
import sys
import time
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
    ("response/clipped_ratio", "cut", "{:.2f}"),
    ("response/length_mean", "len", "{:.1f}"),
)


def progress_stats(metrics: dict[str, float]) -> str:
    """The progress columns of ``metrics`` that are there and finite, e.g. "reward 0.375  acc 0.500  kl 1.2e-04"."""
    return "  ".join(f"{label} {fmt.format(metrics[key])}" for key, label, fmt in PROGRESS_FIELDS
                     if key in metrics and math.isfinite(metrics[key]))


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


class RunLogger:
    """Appends one JSON line per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard / W&B.

    ``resume_step``: the run continues from the checkpoint at that step (``metrics.jsonl`` was already cut
    there by ``rundir.repair_metrics``); TensorBoard events after it are purged. ``progress``: a rich progress bar
    when stdout is a terminal, else plain step lines every ``line_every_s`` seconds (module docstring).
    """

    def __init__(self, run_dir: Path, total_steps: int, *, tensorboard: bool = True, wandb: bool = False,
                 progress: bool = True, config: dict | None = None, resume_step: int | None = None,
                 wandb_project: str = "rollcorr", line_every_s: float = 10.0):
        self.run_dir = Path(run_dir)
        self.total_steps, self.line_every_s = total_steps, line_every_s
        self.lines = progress and not sys.stdout.isatty()  # no terminal: plain lines instead of a live bar
        progress = progress and not self.lines
        self.started = time.monotonic()
        self.last_line: float | None = None  # when the last step line was printed
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
                self.wandb = wandb_lib.init(project=wandb_project, dir=str(self.run_dir), config=config,
                                            resume="allow")
        # imported here, not in ``message``: the trainer's signal handler calls ``message``, and a signal that
        # lands while ``message`` is importing rich.text would find it half-initialised (an ImportError)
        from rich.errors import MarkupError
        from rich.text import Text

        self._plain, self._markup_error = Text.from_markup, MarkupError
        self.progress = None
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            from rich.table import Column

            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[stats]}", table_column=Column(no_wrap=False, ratio=1)),
            )
            self.task = self.progress.add_task(
                "train", total=total_steps, completed=resume_step or 0, stats=""
            )
            self.progress.start()

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        if os.fstat(self.file.fileno()).st_nlink == 0:  # `rm -rf RUN` mid-run: stop, never carry on unseen
            from rollcorr.train.rundir import RunFolderError

            raise RunFolderError(f"{self.run_dir}: the run folder was removed while the run was going (its "
                                 f"metrics.jsonl is gone); stopped at step {step}")
        record: dict[str, Any] = {"step": step}
        record.update({k: _finite_or_none(float(v)) for k, v in sorted(metrics.items())})
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.last.update(metrics)
        if self.tb is not None:  # one event holding every scalar of the step: ~0.3 ms, where one add_scalar
            # per metric took ~4 ms a step (114 metrics), paid by rank 0 while the other ranks wait
            from tensorboard.compat.proto.summary_pb2 import Summary

            values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items() if math.isfinite(float(v))]
            self.tb._get_file_writer().add_summary(Summary(value=values), step)
        if self.wandb is not None:
            self.wandb.log(dict(metrics), step=step)
        if self.progress is not None:
            self.progress.update(self.task, completed=step if advance else None, stats=progress_stats(self.last))
        elif self.lines and advance:
            self._step_line(step)

    def _step_line(self, step: int) -> None:
        """One plain line for ``step`` when ``line_every_s`` has passed since the last one (always the last step)."""
        now = time.monotonic()
        if self.last_line is not None and now - self.last_line < self.line_every_s and step < self.total_steps:
            return
        self.last_line = now
        elapsed = int(now - self.started)
        clock = f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}"
        print(f"step {step}/{self.total_steps}  {clock}  {progress_stats(self.last)}".rstrip(), flush=True)

    def message(self, text: str) -> None:
        """A line for the user: in a terminal through the progress bar's console, left to the terminal to wrap
        (soft wrap: a command in it survives copy and paste); otherwise printed whole, without its rich markup."""
        if self.progress is not None:
            self.progress.console.print(text, soft_wrap=True)
        else:  # plain output (no terminal, or trainer.progress=false): the same text without its rich markup
            try:
                text = self._plain(text).plain
            except self._markup_error:
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


class SampleLog:
    """What the model wrote: ``samples.jsonl`` in the run folder and a TensorBoard text panel ("samples").

    At step 1 and at every evaluation, ``write`` records ``per_kind`` training responses (one per prompt, the
    first of each group) with their reward and per-token |Δp| = |μ(y_t) − π_old(y_t)| (μ the sampler's full
    distribution, π_old the learner's), and as many greedy evaluation responses with the answer they were scored
    against. One JSON object per response: {"step", "kind": "train" | "eval", "prompt", "response", "reward",
    and for train "tokens", "abs_prob_diff", for eval "answer"}.
    """

    def __init__(self, run_dir: Path, tokenizer, tb=None, per_kind: int = 4) -> None:
        from rollcorr.train.rundir import SAMPLES_FILE

        self.path = Path(run_dir) / SAMPLES_FILE
        self.file = open_text_inside(self.path, "a")
        self.tokenizer, self.tb, self.per_kind = tokenizer, tb, per_kind

    def _train_rows(self, step: int, rollout) -> list[dict[str, Any]]:
        from rollcorr.tasks.chat import prompt_text

        group = rollout.group_ids.tolist()
        firsts = [i for i in range(rollout.batch_size) if i == 0 or group[i] != group[i - 1]][: self.per_kind]
        log_mu = rollout.rollout_log_prob
        if rollout.log_kept_mass is not None and rollout.kept_ids is None:
            log_mu = log_mu + rollout.log_kept_mass  # the sampler's full distribution, as the learner's
        # (with kept sets both sides are renormalised over them: μ as drawn, π_old over the same set)
        rows = []
        for i in firsts:
            mask = rollout.response_mask[i].bool()
            ids = rollout.response_ids[i][mask].tolist()
            old = rollout.old_log_prob[i][mask] if rollout.old_log_prob is not None else log_mu[i][mask]
            diff = (log_mu[i][mask].exp() - old.exp()).abs()
            rows.append({"step": step, "kind": "train", "prompt": prompt_text(rollout.meta[i]["prompt"]),
                         "response": self.tokenizer.decode(ids, skip_special_tokens=True),
                         "reward": float(rollout.rewards[i]) if rollout.rewards is not None else None,
                         "tokens": [self.tokenizer.decode([t]) for t in ids],
                         "abs_prob_diff": [float(f"{d:.3g}") for d in diff.tolist()]})
        return rows

    def write(self, step: int, rollout=None, evaluated: list[dict[str, Any]] | None = None) -> None:
        from rollcorr.tasks.chat import prompt_text

        rows = self._train_rows(step, rollout) if rollout is not None else []
        for entry in (evaluated or [])[: self.per_kind]:
            rows.append({"step": step, "kind": "eval", "prompt": prompt_text(entry["item"]["prompt"]),
                         "response": entry["response"], "reward": entry["reward"],
                         "answer": str(entry["item"].get("answer", ""))})
        for row in rows:
            self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None and rows:
            self.tb.add_text("samples", _markdown(rows), step)

    def close(self) -> None:
        self.file.close()


def _markdown(rows: list[dict[str, Any]]) -> str:
    """A TensorBoard text panel: one table row per response (max |Δp| for training responses)."""

    def cell(text: Any) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ⏎ ")[:300]

    lines = ["| kind | prompt | response | reward | max \\|Δp\\| |", "|---|---|---|---|---|"]
    for r in rows:
        peak = max(r["abs_prob_diff"], default=0.0) if "abs_prob_diff" in r else ""
        lines.append(f"| {r['kind']} | {cell(r['prompt'])} | {cell(r['response'])} | {r['reward']} | {peak} |")
    return "\n".join(lines)
