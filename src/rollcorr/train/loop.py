"""The training run: the parts (``rollcorr.train.build``), then step, publish, evaluate, checkpoint.

    executor.next_rollout(step, version)   → rollout with rewards (sampler at some version ≤ version)
    train_step(rollout, ...)                → π_old, correction, advantages, loss, optimizer step
    version += 1; publish to the sampler    (OAPL: only every ``oapl_sync_every`` versions)
    evaluate / log / checkpoint

``run(config)`` starts a run, ``run(config, resume=run_dir)`` continues one from its newest checkpoint.
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollcorr import user_code
from rollcorr.checkpoint import (
    checkpoint_dir,
    load_latest_intact,
    recover_checkpoints,
    rng_state,
    set_rng_state,
)
from rollcorr.distributed.group import agree, join, joined
from rollcorr.distributed.ranks import ONE_PROCESS, Ranks
from rollcorr.distributed.roles import NoLock, SilentLogger
from rollcorr.engines.preflight import check_prompts
from rollcorr.safe_io import UnsafePathError
from rollcorr.tasks.chat import model_input, uses_chat
from rollcorr.train.alerts import RunAlerts, lr_warning, truncation_warning
from rollcorr.train.build import (
    build_evaluator,
    build_learner,
    check_components,
    data_parallel_note,
    follow_sampler,
    rank_executor,
)
from rollcorr.train.config import ConfigError, TrainConfig, config_differs, config_from_dict, save_config
from rollcorr.train.executors import with_learner_weights
from rollcorr.train.rundir import (
    CONFIG_FILE,
    LOCK_FILE,
    METRICS_FILE,
    SAMPLES_FILE,
    RunFinished,
    RunFolderError,
    RunLock,
    check_new_run_dir,
    check_restart_from_zero,
    check_resume_config,
    clear_run_dir,
    make_run_dir,
    new_run_dir,
    repair_metrics,
)
from rollcorr.train.source import sampling_params
from rollcorr.train.step import StepConfig, train_step

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each: checkpoint after this step, then stop


class TrainingStopped(RuntimeError):
    """Raised when too many consecutive steps were bad (non-finite loss, gradient or weights), or on a signal."""


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    version: int
    initial_accuracy: float | None
    final_accuracy: float | None
    seconds: float
    stopped: str | None = None
    stop_signal: int | None = None  # the signal that stopped the run (on any rank), if one did
    plotter: subprocess.Popen | None = field(default=None, repr=False, compare=False)  # writes curves.png

    def wait_for_plot(self, timeout_s: float = 300.0) -> Path:
        """``curves.png`` once the background process that draws it after the run is done (trainer.plot)."""
        from rollcorr.train.plots import wait_for_plot

        return wait_for_plot(self.run_dir, self.plotter, timeout_s)


def missing_log_probs_error(proximal, config: TrainConfig) -> ConfigError:
    """The error for a rollout that came back without log μ: the correction (and some strategies) read it."""
    if proximal.needs_rollout_log_prob:
        return ConfigError(f"algorithm.proximal.name: {proximal.name!r} needs rollout log-probs, but sampler "
                           f"{config.model.sampler!r} gives none")
    return ConfigError(
        f"model.sampler: {config.model.sampler!r} gives no rollout log-probs; the correction needs them"
    )


def publishes(step_config: StepConfig, version: int) -> bool:
    """Whether weights of ``version`` go to the sampler (OAPL: only every ``oapl_sync_every`` versions)."""
    return version % step_config.publish_every == 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def open_resume(run_dir: Path, config: TrainConfig) -> tuple[dict[str, Any] | None, list[str]]:
    """The state to resume from (None: no intact checkpoint, restart at step 0) and messages for the user.

    Checked before anything in the folder is written: the overrides against the checkpoint's own config
    (``rundir.RESUMABLE_KEYS``), ``trainer.steps`` against its step, and a finished run (``RunFinished``).
    Leftovers of a kill during a save are tidied first (``recover_checkpoints``).
    """
    try:  # a link or a file where checkpoints/ should be: refused, never followed
        messages = recover_checkpoints(run_dir)
        path, state, skipped = load_latest_intact(run_dir)
    except UnsafePathError as err:
        raise RunFolderError(f"{err} (a damaged run folder); move it aside to restart") from None
    messages += skipped
    if state is None and skipped:  # checkpoints exist but none loads: never silently start over
        raise RunFolderError(f"{run_dir}: no checkpoint can be read ({'; '.join(skipped)}); move "
                             f"{run_dir / 'checkpoints'} aside to restart the run from step 0")
    if state is None:
        check_restart_from_zero(run_dir, config.trainer.checkpoint_every)
        messages.append(f"{run_dir}: no checkpoint yet (killed before the first one); restarting from step 0")
        return None, messages
    step, steps = int(state["step"]), config.trainer.steps
    stored = state["config"]
    try:  # in today's form: older checkpoints wrote {preset: name} where the resolved correction is now
        stored = config_from_dict(stored).to_dict()
    except ConfigError:
        pass  # compared as written: the first key that differs is named
    check_resume_config(stored, config.to_dict(), step)
    if step >= steps:
        raise RunFinished(
            f"{run_dir}: already finished (checkpoint at step {step}, trainer.steps={steps}); nothing to do. "
            f"To train further: rollcorr train --resume {run_dir} trainer.steps=<more than {step}>"
        )
    messages.append(f"resuming {run_dir} from {path.name}")
    return state, messages


def open_run_dir(config: TrainConfig, run_dir: Path | None, resume: Path | None, overwrite: bool,
                 ranks: Ranks = ONE_PROCESS) -> tuple[Path, Any, dict[str, Any] | None, list[str]]:
    """(folder, its lock, state to resume from or None, messages). Rank 0 opens it: a new run gets an empty
    (or, with ``overwrite``, emptied) folder, a resumed one its checked checkpoint; nothing is written before
    the lock is held and every check passed. The other ranks get its folder (or its error) by broadcast, no
    lock, and read the same checkpoint (``load_latest_intact`` after rank 0 tidied the folder)."""
    opened, error = None, None
    if ranks.is_main:
        try:
            opened = _open_run_dir(config, run_dir, resume, overwrite)
        except Exception as err:  # every rank raises it
            error = err
    folder, error = ranks.broadcast((None if opened is None else opened[0], error))
    if error is not None:
        raise error
    if ranks.is_main:
        return opened
    state = load_latest_intact(folder)[1] if resume is not None else None
    return folder, NoLock(), state, []


def _open_run_dir(config: TrainConfig, run_dir: Path | None, resume: Path | None, overwrite: bool
                  ) -> tuple[Path, RunLock, dict[str, Any] | None, list[str]]:
    if resume is not None:
        folder = Path(resume)
        lock = RunLock(folder)
        try:
            state, notes = open_resume(folder, config)
            config_differs(config, folder / CONFIG_FILE, resuming=True)  # a read-only one that would change: refused
        except BaseException:
            lock.release()
            raise
        return folder, lock, state, notes
    folder = Path(run_dir) if run_dir is not None else new_run_dir(config.trainer.out)
    if (folder / LOCK_FILE).exists():  # a run may be writing there right now: say so, with its pid
        RunLock(folder).release()
    check_new_run_dir(folder, overwrite)
    make_run_dir(folder)
    lock = RunLock(folder)
    try:
        check_new_run_dir(folder, overwrite)  # again, now that no one else can write
        if overwrite:
            clear_run_dir(folder)
        (folder / "checkpoints").mkdir()  # from the start: a resume that finds it gone refuses to restart
    except BaseException:
        lock.release()
        raise
    return folder, lock, None, []


# ---------------------------------------------------------------- the run


class Trainer:
    """Holds what lives for the whole run: learner, optimizer, executor, π_old strategy, logger, evaluator.

    ``ranks`` (rollcorr.distributed): this process's place in the data-parallel group — one of N learner
    processes, or, by default, the group of one process. Rank 0 alone samples, evaluates, logs and writes
    (``distributed/roles.py``); every rank trains on its rows.
    """

    def __init__(self, config: TrainConfig, run_dir: Path | None = None, resume: Path | None = None,
                 overwrite: bool = False, ranks: Ranks = ONE_PROCESS):
        self.config = config
        self.ranks = ranks
        self.step_config, self.proximal, self.env = check_components(config)
        # the run folder: checked, locked and (on resume) validated against its checkpoint before any write
        self.run_dir, self.lock, state, notes = open_run_dir(config, run_dir, resume, overwrite, ranks)
        try:
            if resume is None and ranks.is_main:
                save_config(config, self.run_dir / CONFIG_FILE)
            self._build(config, state, resume is not None, notes)
            # a resume's overrides are recorded once it started: one that fails changes nothing
            if resume is not None and ranks.is_main and config_differs(config, self.run_dir / CONFIG_FILE, True):
                save_config(config, self.run_dir / CONFIG_FILE)
        except BaseException:
            if resume is None and ranks.is_main:  # a new run that could not start (a model that does not load)
                clear_run_dir(self.run_dir)
            self.lock.release()
            if resume is None and ranks.is_main:
                (self.run_dir / LOCK_FILE).unlink(missing_ok=True)
                if not any(self.run_dir.iterdir()):
                    self.run_dir.rmdir()
            raise

    def _build(
        self, config: TrainConfig, state: dict[str, Any] | None, resumed: bool, notes: list[str]
    ) -> None:
        """Models, optimizer, executor, evaluator, logger; then the checkpoint's state when resuming."""
        from rollcorr.train.logging import RunLogger, SampleLog

        t = config.trainer
        main = self.ranks.is_main
        seed_everything(t.seed)
        self.learner, self.optimizer = build_learner(config, self.ranks)  # laid out over the ranks
        self.reference = None  # algorithm.kl's frozen π_ref: the starting weights, copied before any restore
        if config.algorithm.kl.coef > 0:
            from rollcorr.train.reference import FrozenReference

            self.reference = FrozenReference(self.learner)
        self.checkpointer = self.ranks.checkpointer(self.learner, self.optimizer)
        from rollcorr.train.amp import LossScaler

        self.loss_scaler = LossScaler.for_learner(config.model.learner)  # fp16 mixed precision only
        # a user's prompts, as the sampler will get them: encodable, and within the model's positions (the hf
        # sampler would run past them)
        try:
            chat = uses_chat(self.learner.tokenizer, config.task.chat)
            data_items = getattr(getattr(self.env, "task", self.env), "items", [])  # a data set's rows
            inputs = [model_input(self.learner.tokenizer, item["prompt"], chat) for item in data_items]
        except ValueError as err:  # no template, a template that fails, a conversation with task.chat=false
            raise ConfigError(f"task.chat: {err}") from None
        if getattr(self.env, "needs_chat", False) and not chat:  # an environment that talks in messages
            raise ConfigError(f"task.env: environment {self.env.name!r} sends messages, which need the model's chat "
                              "template; this model has none, or task.chat is false")
        check_prompts(self.learner.tokenizer, inputs, config.rollout.max_new_tokens,
                      getattr(self.learner.model.config, "max_position_embeddings", None),
                      f"task.name: {config.task.name} prompt")
        # the sampler is built where it runs: here (sync, simulated_async), in a sampler process (async) or in
        # Ray actors (trainer.executor=ray)
        self.executor = rank_executor(config, self.ranks)
        if self.proximal.follows_sampler:
            follow_sampler(self.proximal, self.executor, self.learner)
        self.evaluates = config.task.eval_prompts > 0  # every rank: the weights are gathered for rank 0
        self.evaluated_at: int | None = None
        self.evaluator = build_evaluator(config, self.env, self.learner.tokenizer, self.learner) if main else None
        # the loss's own randomness (clip_cov's token draw): one stream per run, saved in checkpoints
        self.loss_generator = torch.Generator().manual_seed(t.seed)
        self.step = 0
        self.version = 0
        self.bad_steps = 0
        self.initial_accuracy: float | None = None
        self.final_accuracy: float | None = None
        if state is not None:
            self._restore(state, checkpoint_dir(self.run_dir, int(state["step"])))  # the one that loaded
        if resumed and main:  # keep every intact metrics line up to the checkpoint (none from step 0: its
            # evaluation runs again, so a kept step-0 line would be written twice)
            for name in (METRICS_FILE, SAMPLES_FILE):
                notes.append(repair_metrics(self.run_dir, self.step if state is not None and self.step > 0 else -1, name))
        self.stop_signal: int | None = None
        self._waiting_for_sampler = False
        self.told_checkpoint_size = False
        if main:
            self.logger = RunLogger(self.run_dir, t.steps, tensorboard=t.tensorboard, wandb=t.wandb, progress=t.progress,
                                    config=config.to_dict(), resume_step=self.step if resumed else None,
                                    wandb_project=t.wandb_project, line_every_s=t.log_every_s)
        else:
            self.logger = SilentLogger()
        kl = config.algorithm.kl
        said = self.reference.describe(kl.coef, kl.estimator, kl.where) if self.reference is not None else None
        for note in [*notes, *getattr(getattr(self.env, "task", self.env), "notes", []),
                     data_parallel_note(config, self.ranks, self.learner), said]:
            if note:
                self.logger.message(note)
        self.samples = SampleLog(self.run_dir, self.learner.tokenizer, self.logger.tb) if main else None
        if not resumed:
            self._start_warnings(config)

    def _start_warnings(self, config: TrainConfig) -> None:
        """Said once when a run starts: a learning rate far above the model's usual range (counting the weights
        that train: LoRA's adapters), and top-k / top-p compared in the mode that keeps the kept-mass offset."""
        params = list(self.learner.model.parameters())
        n_params = sum(p.numel() for p in params)  # a DTensor counts its whole size
        trainable = sum(p.numel() for p in params if p.requires_grad)  # LoRA: the adapters
        sampling = sampling_params(config)
        for said in (lr_warning(n_params, config.optim.lr, trainable),
                     truncation_warning(sampling.top_k, sampling.top_p, sampling.truncated,
                                        config.algorithm.correction.sampler_distribution)):
            if said:
                self.logger.message(said)

    # ---- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run's state for a checkpoint; the learner's weights and optimizer state are the checkpointer's
        (``Ranks.checkpointer``: in state.pt for one process, in dcp/ for a sharded learner)."""
        return {
            "step": self.step,
            "version": self.version,
            "executor": self.executor.state_dict(),
            "proximal": self.proximal.state_dict(),
            "rng": rng_state(),
            "loss_generator": self.loss_generator.get_state(),
            "loop": {"bad_steps": self.bad_steps, "initial_accuracy": self.initial_accuracy},
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            "config": self.config.to_dict(),
        }

    def save(self) -> Path:
        path = self.checkpointer.save(self.run_dir, self.step, self.state_dict(), keep=self.config.trainer.keep_checkpoints)
        if self.ranks.is_main and not self.told_checkpoint_size:  # once a run: what each checkpoint costs
            self.told_checkpoint_size = True
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            keep = self.config.trainer.keep_checkpoints
            self.logger.message(f"checkpoint of step {self.step}: {size / 1e9:.2f} GB on disk; the run keeps the newest "
                                f"{keep} (trainer.keep_checkpoints), up to {keep * size / 1e9:.2f} GB")
        return path

    def _restore(self, state: dict[str, Any], path: Path) -> None:
        self.checkpointer.load(path, state, self.proximal)  # weights, optimizer, the strategy (resharded to ours)
        self.step, self.version = int(state["step"]), int(state["version"])
        self.bad_steps = int(state["loop"]["bad_steps"])
        self.initial_accuracy = state["loop"]["initial_accuracy"]
        if self.loss_scaler is not None and state.get("loss_scaler"):  # fp16 amp: the scale where it was
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        # an executor's state may refer to the learner's weights (a sync run's sampler holds them): handed back here
        self.executor.load_state_dict(with_learner_weights(state["executor"], self._weights()))
        set_rng_state(state["rng"])
        # checkpoints written before the loss generator was saved restart its stream at the seed
        if "loss_generator" in state:
            self.loss_generator.set_state(state["loss_generator"])

    # ---- the loop --------------------------------------------------------------------------------------
    def _lr(self, step: int) -> float:
        """Linear warm-up, then constant or cosine decay to ``min_lr_ratio`` · lr at ``trainer.steps``."""
        o, total = self.config.optim, self.config.trainer.steps
        scale = min(1.0, (step + 1) / o.warmup_steps) if o.warmup_steps > 0 else 1.0
        if o.schedule == "cosine" and total > o.warmup_steps:
            progress = min(1.0, max(0.0, (step - o.warmup_steps) / (total - o.warmup_steps)))
            scale *= o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return o.lr * scale

    def _weights(self) -> dict[str, torch.Tensor]:
        """The full weights for the sampler and the evaluator (a sharded learner gathers them on every rank's
        call, rank 0 gets them, once per publish)."""
        return self.learner.state_dict()

    def _evaluate(self) -> dict[str, float]:
        if not self.evaluates:
            return {}
        self.evaluated_at = self.step
        weights = self._weights()
        return {} if self.evaluator is None else self.evaluator(weights, self.version)

    def _publish(self) -> float:
        """Weights of the new version to the π_old strategy and the executor; returns the seconds it took."""
        start = time.perf_counter()
        if publishes(self.step_config, self.version):
            if not self.proximal.follows_sampler:
                self.proximal.on_publish(self.version, self.learner.model)
            self.executor.publish(self._weights(), self.version)
        return time.perf_counter() - start

    def _stopping(self) -> bool:
        """A signal arrived (on any rank: all stop after the same step)."""
        return not self.ranks.all_true(self.stop_signal is None)

    def _on_signal(self, signum: int, _frame) -> None:
        """First SIGINT/SIGTERM/SIGHUP: finish the current step, save a checkpoint, stop. A second one: stop now.
        While the sampler is awaited (async) or user code runs here (a reward: ``rollcorr.user_code``), the step is
        left at once instead: nothing of it is kept, the checkpoint is the one of the step before."""
        self.stop_signal = signum
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        self.logger.message(f"[yellow]{signal.Signals(signum).name}:[/yellow] saving a checkpoint after this "
                            "step (send it again to stop at once)")
        running = "waiting for the sampler" if self._waiting_for_sampler else user_code.waiting()
        if running:  # do not wait on the sampler, nor on user code that may never return
            raise TrainingStopped(f"{signal.Signals(signum).name} at step {self.step} (while {running}); "
                                  f"continue with rollcorr train --resume {self.run_dir}")

    def run(self) -> RunResult:
        """Train to ``trainer.steps``; a SIGINT, SIGTERM or SIGHUP (the terminal closed) stops after the current step
        with a checkpoint."""
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            return self._run()
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            self.lock.release()

    def _warm_correction(self) -> None:
        """With ``ROLLCORR_FUSED=1``: compile the correction's fused statistics kernel now, before the first step
        (correction/fused.py), so that no step ever waits for a compile; otherwise nothing (the default path)."""
        from rollcorr.correction import fused

        if os.environ.get(fused.ENV) != "1":
            return
        start = time.perf_counter()
        if fused.warm(self.step_config.correction, torch.float32):
            self.logger.message(f"{fused.ENV}=1: compiled the fused correction kernel in "
                                f"{time.perf_counter() - start:.1f} s, before the first step")

    def _run(self) -> RunResult:
        t = self.config.trainer
        start = time.perf_counter()
        stopped = stop_signal = None
        self.alerts = RunAlerts.of_run(self.run_dir)  # a resumed run keeps its counts
        self._warm_correction()
        try:
            if self.step == 0:
                if not self.proximal.follows_sampler:
                    self.proximal.on_publish(0, self.learner.model)
                self.executor.start(self._weights(), 0)
                ev = self._evaluate()
                self.initial_accuracy = ev.get("eval/accuracy")
                self.logger.log(0, ev, advance=False)
                self.alerts.seen_evaluation(ev)
                if ev and self.samples is not None:
                    self.samples.write(0, evaluated=self.evaluator.last)
                if self.initial_accuracy is not None:
                    self.logger.message(
                        f"step 0: greedy accuracy {self.initial_accuracy:.3f} on held-out prompts"
                    )
            ev = {}
            while self.step < t.steps and not self._stopping():
                ev = self._one_step()
            if self.step < t.steps:  # every rank is here: the ranks stop together (``_stopping``)
                stop_signal = int(self.ranks.all_reduce(torch.tensor([float(self.stop_signal or 0)]), "max").item())
                where = "" if self.stop_signal is not None else " on another rank"
                raise TrainingStopped(f"{signal.Signals(stop_signal).name}{where} at step {self.step}; continue "
                                      f"with rollcorr train --resume {self.run_dir}")
            if self.evaluates and self.evaluated_at != self.step:  # the final step was not an eval step
                ev = self._evaluate()
                self.logger.log(self.step, ev, advance=False)
            self.final_accuracy = ev.get("eval/accuracy")
        except TrainingStopped as err:
            stopped = str(err)
            stop_signal = stop_signal if self.stop_signal is None else self.stop_signal
            self.logger.message(f"[red]stopped:[/red] {err}")
        finally:
            self.executor.close()
            self.proximal.wait()
        self.save()
        seconds = time.perf_counter() - start
        summary = self.alerts.summary()
        if summary:
            self.logger.message(summary)
        if self.samples is not None:
            self.samples.close()
        self.logger.close()
        plotter = None
        if t.plot and self.ranks.is_main:  # curves.png from a detached process, once metrics.jsonl is complete
            from rollcorr.train.plots import start_plot

            plotter = start_plot(self.run_dir)
        return RunResult(self.run_dir, self.step, self.version, self.initial_accuracy, self.final_accuracy, seconds,
                         stopped, stop_signal, plotter)

    def _one_step(self) -> dict[str, float]:
        t = self.config.trainer
        step_start = time.perf_counter()
        # async: a signal while the sampler process is awaited ends the step at once (a stopped or slow sampler
        # cannot hold the first SIGTERM); the flag is set before stop_signal is read, so none slips between.
        # A lone rank only: the ranks of a group stop together after a step (``_stopping``), never one of them
        # mid-collective
        self._waiting_for_sampler = self.config.trainer.mode == "async" and self.ranks.world == 1
        try:
            if self._waiting_for_sampler and self.stop_signal is not None:
                raise TrainingStopped(f"{signal.Signals(self.stop_signal).name} at step {self.step}; continue "
                                      f"with rollcorr train --resume {self.run_dir}")
            rollout, metrics = self.executor.next_rollout(self.step, self.version)
        finally:
            self._waiting_for_sampler = False
        if rollout.rollout_log_prob is None:
            raise missing_log_probs_error(self.proximal, self.config)

        # a strategy that pauses the sampler (interrupt): exact old logits of in-flight tokens while the learner
        # still holds `version`
        in_flight = self.executor.pause() if self.proximal.pauses_sampler else []
        stall = self.proximal.before_publish(self.learner, in_flight)
        lr = self._lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        result = train_step(rollout, self.learner, self.optimizer, self.proximal, self.step_config, self.version,
                            generator=self.loss_generator, ranks=self.ranks, loss_scaler=self.loss_scaler,
                            reference=self.reference)
        metrics.update(result.metrics)
        metrics["learner/ranks"] = float(self.ranks.world)
        metrics["proximal/stall_s"] = float(stall)
        self.step += 1
        self.version += 1
        metrics["time/publish_s"] = self._publish()
        self.executor.resume()

        if result.skipped_updates:
            self.bad_steps += 1
            self.logger.message(f"step {self.step}: non-finite log-prob, loss, gradient or updated weights, update skipped "
                                f"({self.bad_steps} in a row)")
        else:
            self.bad_steps = 0
        metrics["train/bad_steps_in_row"] = float(self.bad_steps)
        metrics["time/step_s"] = time.perf_counter() - step_start
        metrics["train/lr"] = lr

        ev: dict[str, float] = {}
        if t.eval_every and self.step % t.eval_every == 0 or self.step == t.steps:
            ev = self._evaluate()
            metrics.update(ev)
        for text in self.alerts.observe(self.step, metrics):  # rejected most / all, zero gradient
            self.logger.message(text)
        self.logger.log(self.step, metrics)
        if self.samples is not None and (self.step == 1 or ev):
            self.samples.write(self.step, result.rollout, self.evaluator.last if ev and self.evaluator else None)
        if self.bad_steps >= t.max_bad_steps:
            raise TrainingStopped(
                f"{self.bad_steps} consecutive steps had a non-finite log-prob, loss, gradient or updated weights "
                f"(last at step {self.step}; with optim.lr={self.config.optim.lr:g} — a learning rate too large "
                f"makes the weights diverge); "
                f"the weights are those from before them, saved in {self.run_dir / 'checkpoints'}"
            )
        if t.checkpoint_every and self.step % t.checkpoint_every == 0 and self.step < t.steps:
            self.save()
        return ev


def rank_facts(config: TrainConfig, run_dir, resume, overwrite: bool) -> dict[str, Any]:
    """What every rank of a data-parallel run must share, as flat "key": value pairs: the resolved config, the
    run-folder arguments, rollcorr's version and the model's files (name and size of each, config.json's bytes)."""
    import hashlib

    import rollcorr

    def flat(prefix: str, value: Any, out: dict[str, Any]) -> dict[str, Any]:
        if isinstance(value, dict):
            for key, item in value.items():
                flat(f"{prefix}{key}.", item, out)
        else:
            out[prefix.rstrip(".")] = value
        return out

    facts = flat("", config.to_dict(), {})
    facts |= {"--out": str(run_dir) if run_dir is not None else None, "--resume": str(resume) if resume else None,
              "--overwrite": bool(overwrite), "rollcorr version": rollcorr.__version__}
    model = Path(config.model.path)
    if model.is_dir():
        for path in sorted(p for p in model.rglob("*") if p.is_file()):
            facts[f"model file {path.relative_to(model)}"] = path.stat().st_size
        if (model / "config.json").is_file():
            facts["model config.json sha256"] = hashlib.sha256((model / "config.json").read_bytes()).hexdigest()
    return facts


def run(config: TrainConfig, run_dir: Path | None = None, resume: Path | None = None,
        overwrite: bool = False) -> RunResult:
    """Train with ``config``; ``resume`` continues the run in that folder from its newest checkpoint;
    ``overwrite`` replaces the run in a non-empty ``trainer.out`` (otherwise refused). In one of torchrun's
    processes this process is one rank of the data-parallel learner (docs/distributed.md), else a group of one."""
    if config.trainer.threads > 0:
        torch.set_num_threads(config.trainer.threads)
    ranks = join()
    joined(ranks)  # every rank is here (the missing ones named) ...
    agree(ranks, rank_facts(config, run_dir, resume, overwrite))  # ... with one config, before any work
    if config.trainer.ranks not in (1, ranks.world):
        raise ConfigError(f"trainer.ranks: {config.trainer.ranks}, but this run has {ranks.world} learner process(es); "
                          "`rollcorr train trainer.ranks=N` starts N (leave trainer.ranks unset under torchrun)")
    trainer = Trainer(config, run_dir=run_dir, resume=resume, overwrite=overwrite, ranks=ranks)
    return trainer.run()
