"""Which sampler engine and which mode are faster for this run, measured on this machine (``rollcorr train
--measure-engines``): nothing is saved, no run folder is made.

Each *trial* runs real training steps of the run's config with one sampler engine and one executor — ``sync``
(the sampler in this process, one side after the other) or ``async`` (the sampler in its own process,
overlapped with the learner, as ``trainer.mode=async`` runs it) — on a learner loaded for the measurement,
whose updates are thrown away. A step is the run's: the executor's next batch (generated and rewarded), π_old,
the correction, forward + backward and the optimizer step of every mini-batch (``train_step``), and the
publish of the new weights to the sampler. The first step of a trial is a warm-up (first calls; in async the
first batch, which nothing overlaps); up to ``TIMED_STEPS`` more are timed, so an async trial's steps include
the contention of the two processes on the machine's cores. ``trainer.threads`` applies as in a run (0: torch's
default, in this process and in the sampler process). Trials use the local executor in one process, whatever
``trainer.executor`` and ``trainer.ranks`` say.

The budget (default ``BUDGET_S`` seconds) starts once the learner is loaded. Trials run in this order, each
started only while the budget lasts — the first always runs, a started trial runs to its end (an engine's
start-up cannot be cut short), and the rest are listed as skipped, with why:

    1. sync  with the configured sampler          2. async with the configured sampler
    3. sync  with hf in the same dtype, then llama.cpp (each once)
    4. async with the fastest of those in sync, when it is not the configured one
    5. sync  with vLLM — last, whichever is configured: building it here changes this process for any trial
       after it (``changes_process``); so vLLM's async is measured only when it is the configured sampler

Trial 2's sampler process (a fresh interpreter: seconds of imports) starts at once, in the background, with what
is left of the budget to come up; trial 1's timed steps wait until it is up and idle, so they run without it.
Start-up (building an engine, starting a sampler process) is printed apart: a run pays it once.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from statistics import mean

from rollcorr.engines.spec import parse_spec

BUDGET_S = 10.0  # seconds for the whole measurement, by default
TIMED_STEPS = 3  # steps timed after the warm-up step (fewer when the budget runs out; at least one)
CHANGES_PROCESS = ("vllm",)  # backends whose in-process build changes this process for later trials (see below)
NOISE = 0.05  # async pays when it is this share faster than sync and each of its steps beat each of sync's


@dataclass(frozen=True)
class Trial:
    """One engine in one mode: the mean of its timed steps (seconds), or why it was not measured."""

    engine: str
    mode: str  # sync | async
    startup_s: float | None = None  # building the sampler (sync) or starting its process (async)
    step_s: float | None = None  # a whole step, wall clock
    spread: tuple[float, float] | None = None  # the fastest and the slowest timed step
    generate_s: float | None = None  # the sampler's seconds for one batch (in async, alongside the learner)
    wait_s: float | None = None  # the learner waiting for that batch
    learn_s: float | None = None  # train_step: π_old, correction, forward + backward, optimizer step
    publish_s: float | None = None  # the new weights to the sampler
    tokens: int = 0  # response tokens of one batch
    steps: int = 0  # timed steps
    skipped: str | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.generate_s if self.generate_s else None


def candidates(config) -> list[str]:
    """The configured sampler, hf in its dtype, llama.cpp and vLLM: each once, cheapest start-up first."""
    spec = parse_spec(config.model.sampler)
    dtype = spec.dtype if spec.dtype in ("fp32", "bf16", "fp16") else "bf16"
    llamacpp = "llamacpp:q8_0" if dtype != "fp32" else "llamacpp:f32"
    out = [config.model.sampler, f"hf:{dtype}", llamacpp, f"vllm:{dtype}"]
    seen: list[str] = []
    for s in out:
        if str(parse_spec(s)) not in {str(parse_spec(x)) for x in seen}:
            seen.append(s)
    return seen


def trial_config(config, engine: str, mode: str):
    """``config`` with ``engine`` as its sampler, run by the local executor in ``mode``."""
    return replace(config, model=replace(config.model, sampler=engine),
                   trainer=replace(config.trainer, mode=mode, executor="local"))


class Budget:
    """The measurement's time budget: ``left()`` seconds of ``seconds``, counted from its creation."""

    def __init__(self, seconds: float):
        self.seconds, self.begin = seconds, time.perf_counter()

    def used(self) -> float:
        return time.perf_counter() - self.begin

    def left(self) -> float:
        return self.seconds - self.used()

    def spent(self) -> str:
        return f"the {self.seconds:g} s budget was spent ({self.used():.1f} s); raise --measure-budget to measure it"


class Prestarted:
    """The configured engine's async executor, its sampler process started in a thread: a fresh interpreter
    takes seconds to import torch and build the sampler, which overlap the sync trial's start-up and warm-up
    (its timed steps wait until the process is up and idle, so they run without it)."""

    def __init__(self, config, weights: dict, budget: Budget):
        from rollcorr.train.build import make_executor

        self.executor = make_executor(config)  # the process starts with the first weights
        self.executor.source.start_timeout_s = self.timeout_s = max(budget.left(), 1.0)
        self.seconds, self.skipped, self.budget_s = 0.0, None, budget.seconds
        self._thread = threading.Thread(target=self._start, args=(weights,), name="rollcorr-prestart",
                                        daemon=True)
        self._thread.start()

    def _start(self, weights: dict) -> None:
        start = time.perf_counter()
        try:
            self.executor.source.load_weights(weights, 0)
        except Exception as err:  # noqa: BLE001 — said in the report
            self.skipped = _failed(err)
        self.seconds = time.perf_counter() - start
        if self.skipped and self.seconds >= self.timeout_s:
            self.skipped = (f"its sampler process did not start within the {self.budget_s:g} s budget (given "
                            f"{self.timeout_s:.1f} s); raise --measure-budget to measure it")

    def wait(self) -> None:
        self._thread.join()

    def close(self) -> None:
        self.wait()
        self.executor.close()


def run_trial(config, engine: str, mode: str, learner, optimizer, budget: Budget, prestarted: Prestarted | None = None,
              before_timing: Callable[[], None] = lambda: None) -> Trial:
    """Start ``engine``'s executor in ``mode`` (or take ``prestarted``'s), take a warm-up step, call
    ``before_timing``, then time up to ``TIMED_STEPS`` real steps (at least one; no more once the budget is
    spent)."""
    from rollcorr.engines.preflight import PreflightError
    from rollcorr.train.amp import LossScaler
    from rollcorr.train.build import check_components, follow_sampler, make_executor
    from rollcorr.train.config import ConfigError
    from rollcorr.train.loop import publishes
    from rollcorr.train.step import train_step

    trial = trial_config(config, engine, mode)
    try:
        step_config, proximal, _task = check_components(trial)
    except (ConfigError, PreflightError) as err:
        return Trial(engine, mode, skipped=str(err))
    scaler = LossScaler.for_learner(trial.model.learner)
    start = time.perf_counter()
    if prestarted is not None:
        prestarted.wait()
        if prestarted.skipped:
            return Trial(engine, mode, skipped=prestarted.skipped)
        executor, startup = prestarted.executor, prestarted.seconds
        start = time.perf_counter()
    else:
        executor, startup = make_executor(trial), 0.0  # sync: builds the sampler here
        if mode == "async":
            executor.source.start_timeout_s = max(budget.left(), 1.0)
    try:
        if proximal.follows_sampler:
            follow_sampler(proximal, executor, learner)
        else:
            proximal.on_publish(0, learner.model)
        executor.start(learner.state_dict(), 0)
        startup += time.perf_counter() - start
        steps: list[dict[str, float]] = []
        for version in range(1 + TIMED_STEPS):
            if version == 1:
                before_timing()
            elif version >= 2 and budget.left() < 0:
                break
            start = time.perf_counter()
            rollout, metrics = executor.next_rollout(version, version)
            in_flight = executor.pause() if proximal.pauses_sampler else []
            proximal.before_publish(learner, in_flight)
            learning = time.perf_counter()
            train_step(rollout, learner, optimizer, proximal, step_config, version, loss_scaler=scaler)
            publishing = time.perf_counter()
            if publishes(step_config, version + 1):
                if not proximal.follows_sampler:
                    proximal.on_publish(version + 1, learner.model)
                executor.publish(learner.state_dict(), version + 1)
            executor.resume()
            end = time.perf_counter()
            steps.append({"step": end - start, "generate": metrics["time/generate_s"], "wait": metrics["time/wait_s"],
                          "learn": publishing - learning, "publish": end - publishing,
                          "tokens": float(rollout.response_mask.sum())})
    finally:
        executor.close()
        proximal.wait()
    timed = steps[1:]

    def avg(key: str) -> float:
        return mean(s[key] for s in timed)

    seconds = [s["step"] for s in timed]
    return Trial(engine, mode, startup, avg("step"), (min(seconds), max(seconds)), avg("generate"), avg("wait"),
                 avg("learn"), avg("publish"), int(avg("tokens")), len(timed))


def changes_process(engine: str) -> bool:
    """Whether building ``engine`` in this process changes process-wide settings that later trials would
    inherit: vLLM sets environment variables (``LD_PRELOAD``, ``LOCAL_WORLD_SIZE``, ...) and its CPU threads'
    setup, after which this process's learner steps ran 1.5-2.7× faster on a 2-core machine)."""
    return parse_spec(engine).backend in CHANGES_PROCESS


def plan(config) -> list[tuple[str, str]]:
    """The trials in the order they run; a sync trial of an engine that ``changes_process`` comes last (trial
    4, async with the fastest other engine, is inserted before it by ``measure`` once the rest are known)."""
    configured, *others = candidates(config)
    trials = [(configured, "sync"), (configured, "async"), *((e, "sync") for e in others)]
    return sorted(trials, key=lambda t: t[1] == "sync" and changes_process(t[0]))  # stable


def _failed(err: Exception) -> str:
    return f"failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


@dataclass(frozen=True)
class Measurement:
    """Every trial, run or skipped; the seconds loading the learner took (before the budget's clock starts: a
    run pays it too) and the seconds the trials took."""

    trials: list[Trial]
    learner_load_s: float
    used_s: float
    budget_s: float


def measure(config, budget_s: float = BUDGET_S) -> Measurement:
    """Load the learner, then run the trials of ``plan`` (and ``step_four``'s) within ``budget_s`` seconds."""
    import torch

    from rollcorr.train.build import build_learner
    from rollcorr.train.loop import seed_everything

    if config.trainer.threads > 0:  # 0: torch's default, as in a run
        torch.set_num_threads(config.trainer.threads)
    seed_everything(config.trainer.seed)
    start = time.perf_counter()
    learner, optimizer = build_learner(config)
    learner_load_s = time.perf_counter() - start
    budget = Budget(budget_s)
    queue, trials = plan(config), []
    first_async = next(t for t in queue if t[1] == "async")
    try:
        prestarted: Prestarted | None = Prestarted(trial_config(config, *first_async), learner.state_dict(),
                                                   budget)
    except Exception:  # noqa: BLE001 — a config async cannot run with: its trial says why
        prestarted = None
    try:
        while queue:
            engine, mode = queue.pop(0)
            mine = prestarted if (engine, mode) == first_async else None
            try:
                if trials and budget.left() < 0 and mine is None:  # a started sampler process is measured
                    trial = Trial(engine, mode, skipped=budget.spent())
                else:
                    wait = prestarted.wait if prestarted is not None else (lambda: None)  # time steps without it
                    trial = run_trial(config, engine, mode, learner, optimizer, budget, mine, wait)
            except Exception as err:  # noqa: BLE001 — an engine that fails here is reported, not fatal
                trial = Trial(engine, mode, skipped=_failed(err))
            if mine is not None:
                mine.close()  # closed already when it ran
                prestarted = None
            trials.append(trial)
            if all(mode == "sync" and changes_process(engine) for engine, mode in queue):
                queue = step_four(config, trials) + queue
    finally:
        if prestarted is not None:
            prestarted.close()
    if all(t.skipped for t in trials):
        raise ValueError("no engine could be measured for this config: " + "; ".join(
            f"{t.engine} {t.mode}: {t.skipped}" for t in trials))
    return Measurement(trials, learner_load_s, budget.used(), budget_s)


def step_four(config, trials: list[Trial]) -> list[tuple[str, str]]:
    """Async with the fastest engine in sync, when it was not tried yet (the configured one was); not an engine
    that ``changes_process``: its sync trial comes after this one."""
    sync = [t for t in trials if t.mode == "sync" and t.step_s is not None and not changes_process(t.engine)]
    if not sync:
        return []
    best = min(sync, key=lambda t: t.step_s).engine
    return [] if any(t.engine == best and t.mode == "async" for t in trials) else [(best, "async")]


def threads_said(configured: int, threads: int, cores: int) -> str:
    """What ``trainer.threads`` meant here: 0 is torch's default (every core, unless OMP_NUM_THREADS says less)."""
    default = " (trainer.threads=0: torch's default)" if configured == 0 else ""
    return f"{threads} torch thread(s) a process{default}, {cores} cores"


def async_pays(a: Trial, s: Trial) -> bool:
    """Async measurably faster than sync: ``NOISE`` of a step on the mean, and every timed async step faster
    than every sync one (a few steps on a busy machine vary by more than their difference)."""
    return a.step_s <= (1 - NOISE) * s.step_s and a.spread[1] < s.spread[0]


def verdict(a: Trial, s: Trial) -> str:
    if async_pays(a, s):
        return "async pays"
    if a.spread[0] > s.spread[1]:
        return "async is slower here: stay sync"
    return "no clear difference over these steps: stay sync, which is reproducible"


def report(m: Measurement, threads: str) -> str:
    """The measured table and the recommendation, in words, with the numbers behind it; ``threads`` is
    ``threads_said``'s line."""
    lines = [f"{'sampler':16s} {'mode':5s} {'start-up s':>10s} {'s/step':>7s} {'(min-max)':>13s} {'generate':>8s} "
             f"{'wait':>6s} {'learn':>6s} {'publish':>7s} {'tokens/s':>8s}"]
    for t in m.trials:
        if t.step_s is None:
            lines.append(f"{t.engine:16s} {t.mode:5s} not measured: {t.skipped}")
            continue
        spread = f"({t.spread[0]:.3f}-{t.spread[1]:.3f})"
        lines.append(f"{t.engine:16s} {t.mode:5s} {t.startup_s:10.1f} {t.step_s:7.3f} {spread:>13s} "
                     f"{t.generate_s:8.3f} {t.wait_s:6.3f} {t.learn_s:6.3f} {t.publish_s:7.3f} "
                     f"{t.tokens_per_s or 0:8.0f}")
    measured = [t for t in m.trials if t.step_s is not None]
    counts = sorted({t.steps for t in measured})
    lines.append(f"s/step: the mean of {'-'.join(map(str, counts))} real step(s) after a warm-up one; learn = "
                 "π_old, correction, forward + backward, optimizer step; generate = the sampler's seconds a "
                 "batch (in async, alongside the learner); start-up is paid once by a run")
    lines.append(f"measured in {m.used_s:.1f} s (budget {m.budget_s:g} s) after loading the learner "
                 f"({m.learner_load_s:.1f} s); {threads}")
    best_sync = min((t for t in measured if t.mode == "sync"), key=lambda t: t.step_s, default=None)
    best = min(measured, key=lambda t: t.step_s)
    if best.mode == "async" and best_sync is not None and not async_pays(best, best_sync):
        best = best_sync  # not measurably faster: sync is simpler and reproducible
    lines.append(f"fastest here: model.sampler={best.engine} trainer.mode={best.mode} "
                 f"({best.step_s:.3f} s a step).")
    for engine in dict.fromkeys(t.engine for t in measured):
        pair = {t.mode: t for t in measured if t.engine == engine}
        if "sync" in pair and "async" in pair:
            a, s = pair["async"], pair["sync"]
            lines.append(f"{engine}: async {a.step_s:.3f} vs sync {s.step_s:.3f} s a step = "
                         f"{s.step_s / a.step_s:.2f}× ({verdict(a, s)}).")
    return "\n".join(lines)


def run(config, budget_s: float = BUDGET_S) -> str:
    """Measure and report (``rollcorr train --measure-engines``)."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the engines' loading bars are not the report
    m = measure(config, budget_s)
    return report(m, threads_said(config.trainer.threads, torch.get_num_threads(), os.cpu_count() or 1))
