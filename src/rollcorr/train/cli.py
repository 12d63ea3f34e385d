"""``rollcorr train [key=value ...] [--config FILE] [--out DIR [--overwrite]] [--resume RUN_DIR]``.

With no arguments: the built-in model learns the built-in addition task with the shipped default config.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted config overrides, e.g. algorithm.name=dapo trainer.mode=async trainer.max_staleness=2",
    )
    parser.add_argument(
        "--config", type=Path, default=None, help="YAML config (default: the shipped default.yaml)"
    )
    parser.add_argument("--out", type=Path, default=None,
                        help="run folder, new or empty, taken as a path (never YAML; a leading ~ is your home) "
                             "(default: runs/<timestamp>-<random suffix>)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the run already in --out (default: refuse a non-empty folder)")
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its newest checkpoint (overrides apply on top; "
                             "only some keys may change, see docs/training.md)")
    parser.add_argument("--print-config", action="store_true",
                        help="check and print the resolved config, then exit")
    parser.add_argument("--measure-engines", action="store_true",
                        help="time real steps of this config with each sampler engine, sync and async, within a "
                             "time budget; print which is faster here, then exit (no run folder is made)")
    parser.add_argument("--measure-budget", default=None, metavar="SECONDS",
                        help="with --measure-engines: seconds for the whole measurement (default 10); what does not "
                             "fit is listed as skipped")


def measure_budget(args: argparse.Namespace) -> float:
    """``--measure-budget`` in seconds (default 10), checked before anything is built."""
    from rollcorr.train.config import ConfigError
    from rollcorr.train.measure_engines import BUDGET_S

    if args.measure_budget is None:
        return BUDGET_S
    if not args.measure_engines:
        raise ConfigError("--measure-budget: only with --measure-engines")
    try:
        budget = float(args.measure_budget)
    except ValueError:
        budget = float("nan")
    if not 0 < budget < float("inf"):
        raise ConfigError(f"--measure-budget: {args.measure_budget!r} is not a positive number of seconds")
    return budget


@dataclass(frozen=True)
class Stop:
    """How ``rollcorr train`` stops on one kind of exception: its exit code and its one line (``line`` returns
    None for an exception of the kind that is not its to say: it is raised on). Once the ranks have joined:
    whether rank 0 alone says it (every rank raises it alike) and whether the ranks leave together (rank 0's
    check stopped them all; a rank leaving first would have the launcher stop the others while rank 0 is still
    saying why). ``or_cause``: an exception raised *from* one of ``kinds`` is that kind too."""

    kinds: tuple[type[BaseException], ...]
    code: int
    line: Callable[[BaseException, argparse.Namespace], str | None]
    main_says: bool = False
    together: bool = False
    stdout: bool = False
    or_cause: bool = False

    def matches(self, err: BaseException) -> BaseException | None:
        """The exception this row says (``err`` or, with ``or_cause``, its cause), None when it is not one."""
        if isinstance(err, self.kinds):
            return err
        return err.__cause__ if self.or_cause and isinstance(err.__cause__, self.kinds) else None


def stops() -> list[Stop]:
    """The one table of what stops ``rollcorr train`` and its exit code, in the order an exception is matched (a
    subclass before its base). Built when asked: its exception types import the trainer's modules (torch)."""
    from rollcorr.checkpoint import CheckpointError
    from rollcorr.distributed.ranks import DistributedError
    from rollcorr.engines.preflight import PreflightError
    from rollcorr.safe_io import UnsafePathError
    from rollcorr.train.config import ConfigError
    from rollcorr.train.rundir import RunFinished, RunFolderError
    from rollcorr.train.sampler_process import SamplerProcessError
    from rollcorr.user_code import UserCodeError

    said = lambda err, args: str(err)  # noqa: E731
    config = lambda err, args: f"config error: {err}"  # noqa: E731
    return [
        Stop((KeyboardInterrupt,), 130, lambda err, args: "interrupted"),  # Ctrl-C while checking or loading
        Stop((UnsafePathError, CheckpointError), 2, said),  # a link in the run folder, an unwritable checkpoint
        Stop((PreflightError,), 2, config),  # prompts the model cannot take (found once the tokenizer is loaded)
        Stop((OSError,), 1, _disk_said),  # a full disk, a file-size limit, a read-only folder: nothing lost
        Stop((RunFinished,), 0, said, main_says=True, together=True, stdout=True),
        Stop((ConfigError,), 2, config, main_says=True, together=True),  # a resume override the checkpoint refuses
        Stop((RunFolderError,), 2, said, main_says=True, together=True),  # rank 0 checks the run folder
        Stop((DistributedError,), 2, said, main_says=True),  # ranks started differently, one that never joined
        Stop((FloatingPointError,), 1, said),  # the weights diverged (NaN logits in the sampler)
        Stop((UserCodeError,), 1, lambda err, args: f"{err}; {_resume_hint(args)}"),  # a reward that raised or hung
        Stop((SamplerProcessError,), 1, _sampler_said, or_cause=True),  # it died, failed or stopped beating
    ]


def stopped(err: BaseException, args: argparse.Namespace, ranks=None) -> int | None:
    """Say ``err`` as the table says and return its exit code; None when the table has no row for it (the caller
    raises it on). ``ranks``: this process's ranks once joined (None before: every process says it)."""
    for stop in stops():
        said = stop.matches(err)
        line = None if said is None else stop.line(said, args)
        if line is None:
            continue
        if ranks is None or not stop.main_says or ranks.is_main:
            print(f"rollcorr train: {line}", file=sys.stdout if stop.stdout else sys.stderr)
        return _leave_together(ranks, stop.code) if stop.together and ranks is not None else stop.code
    return None


def _disk_said(err: BaseException, args: argparse.Namespace) -> str | None:
    """An OSError in one line with what the run left; out of memory is said in one place, rollcorr.cli's."""
    from rollcorr.safe_io import describe_os_error

    if err.errno == errno.ENOMEM:
        return None
    where = f"{err.filename}: " if err.filename else ""
    return f"{where}{describe_os_error(err)}; {_resume_hint(args)}"


def _sampler_said(err: BaseException, args: argparse.Namespace) -> str:
    """The sampler process's failure: its own line, what the run left, then its traceback (once) if it had one."""
    first, _, details = str(err).partition("\n")
    return f"{first}; {_resume_hint(args)}" + (f"\n{details}" if details else "")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt as err:  # while checking or loading (a training run handles its own signals)
        return stopped(err, args)


def _run(args: argparse.Namespace) -> int:
    import yaml

    from rollcorr.distributed.group import DistributedError, launched
    from rollcorr.train.build import check_components
    from rollcorr.train.config import ConfigError, learner_processes, load_config

    try:
        budget = measure_budget(args)
        if args.resume is not None:
            if args.config is not None:
                raise ConfigError("--resume: the run's own config.yaml is used; drop --config")
            if args.out is not None or args.overwrite:
                raise ConfigError("--resume: the run continues in RUN_DIR; drop --out / --overwrite")
            config_path = args.resume / "config.yaml"
            if not os.path.lexists(config_path):
                raise ConfigError(f"--resume: {str(config_path)!r} does not exist (not a run folder?)")
            config = load_config(config_path, args.overrides, inside_run=True)  # a link there is refused
            _check_run_reward(config, args)
        else:
            overrides = list(args.overrides)
            if args.out is not None:
                overrides.append(f"trainer.out={args.out}")
            config = load_config(args.config, overrides)
        if args.print_config:
            check_components(config)
            print(yaml.safe_dump(config.to_dict(), sort_keys=False))
            return 0
        if args.measure_engines:
            check_components(config)
            from rollcorr.train.measure_engines import run as measure_engines

            print(measure_engines(config, budget))
            return 0
        under_launcher = launched()
        if not under_launcher and learner_processes(config) > 1:  # start the N learner processes (distributed/launch.py)
            check_components(config)  # once, before any process starts (each then checks its own, in the run)
            return _launch(args, config)
    except (ConfigError, DistributedError) as err:  # before any rank joined (RANK / WORLD_SIZE left in the shell)
        return stopped(err, args)
    if under_launcher:
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(_train)(args, config)  # a raising rank's error reaches the launcher's one-line report
    return _train(args, config)


def _check_run_reward(config, args: argparse.Namespace) -> None:
    """--resume: the run folder's ``task.reward`` module is imported only when the command names it again
    (``task.reward=...``) or this process imported it already (docs/security.md); ConfigError otherwise."""
    from rollcorr.tasks.verifiers import check_named_reward
    from rollcorr.train.config import ConfigError, parse_override

    if any(parse_override(text)[0] == ["task", "reward"] for text in args.overrides):
        return
    reward = config.task.reward  # a list as the shell passes it whole: quoted, no spaces
    again = f"'task.reward=[{','.join(reward)}]'" if isinstance(reward, list) else f"task.reward={reward}"
    how = f"name it again on the command line: rollcorr train --resume {args.resume} {again}"
    try:
        check_named_reward(config.task.reward, f"--resume: {args.resume / 'config.yaml'}", how)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _launch(args: argparse.Namespace, config) -> int:
    """``rollcorr train`` again as ``trainer.ranks`` processes, in a run folder chosen now."""
    from rollcorr.distributed.launch import launch
    from rollcorr.train.config import learner_processes
    from rollcorr.train.rundir import new_run_dir

    argv = [*args.overrides]
    if args.config is not None:
        argv += ["--config", str(args.config)]
    if args.resume is not None:
        argv += ["--resume", str(args.resume)]
        run_dir = args.resume
    else:
        run_dir = args.out if args.out is not None else new_run_dir(config.trainer.out)
        argv += ["--out", str(run_dir)] + (["--overwrite"] if args.overwrite else [])
    return launch(argv, learner_processes(config), str(run_dir))


def _resume_hint(args: argparse.Namespace) -> str:
    """What a stopped run left, said as it is: the newest checkpoint of the run folder (when the command named the
    folder), that there is none yet (and, when the run had started there, that ``--resume`` restarts it from step
    0: ``loop.open_resume``), or — a new run in a folder chosen at start — how to continue."""
    from rollcorr.checkpoint import list_checkpoints

    folder = args.resume if args.resume is not None else args.out
    if folder is None:
        return "checkpoints are never half-written: continue with rollcorr train --resume RUN_DIR once fixed"
    try:
        saved = list_checkpoints(folder)
    except Exception:  # an unreadable or vanished folder: say nothing it cannot show
        saved = []
    if not saved:
        if not os.path.isfile(Path(folder) / "config.yaml"):  # nothing was started there: nothing to continue
            return f"{folder} holds no checkpoint yet"
        return f"{folder} holds no checkpoint yet: rollcorr train --resume {folder} starts it again from step 0"
    return f"{folder} keeps its last checkpoint ({saved[-1].name}): continue with rollcorr train --resume {folder}"


def _leave_together(ranks, code: int) -> int:
    """``code``, once every rank is here: rank 0's check stopped them all, and a rank leaving first would have
    the launcher stop the others (SIGTERM) while rank 0 is still saying why."""
    import contextlib

    with contextlib.suppress(Exception):  # a group already broken: leave as we are
        ranks.barrier()
    return code


def _train(args: argparse.Namespace, config) -> int:
    """Train in this process (one of several under torchrun: rank 0 prints the summary)."""
    from transformers.utils import logging as hf_logging

    from rollcorr.distributed.group import DistributedError, join, launched
    from rollcorr.train.loop import run as run_training

    try:
        ranks = join()  # this process's ranks, as the run gets them (``run`` joins the same group)
        main = ranks.is_main
    except DistributedError as err:  # the launcher's environment is incomplete: nothing started yet
        return stopped(err, args)

    hf_logging.disable_progress_bar()  # checkpoints call save_pretrained; rollcorr's own bar is the one to read
    try:
        result = run_training(config, resume=args.resume, overwrite=args.overwrite)
    except Exception as err:  # what the table says (stops()); anything else is raised on
        code = stopped(err, args, ranks)
        if code is None:
            raise
        return code
    acc = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    # stopped on a signal under the launcher: 128 + its number, so the launcher says "stopped", not "failed"
    stopped_exit = 128 + result.stop_signal if result.stop_signal and launched() else 1
    if not main:
        return stopped_exit if result.stopped else 0
    print(
        f"run folder: {result.run_dir}\n"
        f"steps: {result.steps}  wall time: {result.seconds:.1f} s  "
        f"greedy accuracy: {acc(result.initial_accuracy)} -> {acc(result.final_accuracy)}"
    )
    if result.stopped:
        print(f"stopped early: {result.stopped}", file=sys.stderr)
        return stopped_exit
    return 0
