"""``rollcorr train [key=value ...] [--config FILE] [--out DIR [--overwrite]] [--resume RUN_DIR]``.

With no arguments: the built-in model learns the built-in addition task with the shipped default config.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
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
                             "(default: runs/<timestamp>-<random suffix>)")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the run already in --out (default: refuse a non-empty folder)")  # fmt: skip
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its newest checkpoint (overrides apply on top; "
                             "only some keys may change, see docs/training.md)")  # fmt: skip
    parser.add_argument("--print-config", action="store_true",
                        help="check and print the resolved config, then exit")  # fmt: skip
    parser.add_argument("--measure-engines", action="store_true",
                        help="time real steps of this config with each sampler engine, sync and async, within a "
                             "time budget; print which is faster here, then exit (no run folder is made)")  # fmt: skip
    parser.add_argument("--measure-budget", default=None, metavar="SECONDS",
                        help="with --measure-engines: seconds for the whole measurement (default 10); what does not "
                             "fit is listed as skipped")  # fmt: skip


def measure_budget(args: argparse.Namespace) -> float:
    """``--measure-budget`` in seconds (default 10), checked before anything is built."""
    from rollcorr.train.config import ConfigError
    from rollcorr.train.engine_choice import BUDGET_S

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


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt:  # Ctrl-C while checking or loading (a training run handles its own signals)
        print("rollcorr train: interrupted", file=sys.stderr)
        return 130


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
            from rollcorr.train.engine_choice import run as measure_engines

            print(measure_engines(config, budget))
            return 0
        under_launcher = launched()
        if not under_launcher and learner_processes(config) > 1:  # start the N learner processes (distributed/launch.py)
            check_components(config)  # once, before any process starts (each then checks its own, in the run)
            return _launch(args, config)
    except ConfigError as err:
        print(f"rollcorr train: config error: {err}", file=sys.stderr)
        return 2
    except DistributedError as err:  # RANK / WORLD_SIZE / ... left in the shell: one line, before any collective
        print(f"rollcorr train: {err}", file=sys.stderr)
        return 2
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
    how = f"name it again on the command line: rollcorr train --resume {args.resume} task.reward={config.task.reward}"
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

    from rollcorr.checkpoint import CheckpointError
    from rollcorr.distributed.group import DistributedError, join, launched
    from rollcorr.engines.preflight import PreflightError
    from rollcorr.safe_io import UnsafePathError, describe_os_error
    from rollcorr.train.config import ConfigError
    from rollcorr.train.loop import run as run_training
    from rollcorr.train.rundir import RunFinished, RunFolderError
    from rollcorr.user_code import UserCodeError

    try:
        ranks = join()  # this process's ranks, as the run gets them (``run`` joins the same group)
        main = ranks.is_main
    except DistributedError as err:  # the launcher's environment is incomplete: nothing started yet
        print(f"rollcorr train: {err}", file=sys.stderr)
        return 2

    hf_logging.disable_progress_bar()  # checkpoints call save_pretrained; rollcorr's own bar is the one to read
    try:
        result = run_training(config, resume=args.resume, overwrite=args.overwrite)
    except (UnsafePathError, CheckpointError) as err:  # a link in the run folder, a checkpoint that cannot be written
        print(f"rollcorr train: {err}", file=sys.stderr)
        return 2
    except PreflightError as err:  # prompts the model cannot take (found once the tokenizer is loaded)
        print(f"rollcorr train: config error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, a file-size limit, a read-only folder: nothing lost, one line
        if err.errno == errno.ENOMEM:  # out of memory is said in one place, rollcorr.cli's handler
            raise
        where = f"{err.filename}: " if err.filename else ""
        print(f"rollcorr train: {where}{describe_os_error(err)}; {_resume_hint(args)}", file=sys.stderr)
        return 1
    except RunFinished as done:
        if main:
            print(f"rollcorr train: {done}")
        return _leave_together(ranks, 0)
    except ConfigError as err:  # a resume override the checkpoint cannot take (rank 0's check: said once)
        if main:
            print(f"rollcorr train: config error: {err}", file=sys.stderr)
        return _leave_together(ranks, 2)
    except RunFolderError as err:  # rank 0 checks the run folder and every rank raises its error: said once
        if main:
            print(f"rollcorr train: {err}", file=sys.stderr)
        return _leave_together(ranks, 2)
    except DistributedError as err:  # ranks started differently, or one that never joined: rank 0 says it once
        if main:
            print(f"rollcorr train: {err}", file=sys.stderr)
        return 2
    except FloatingPointError as err:  # the weights diverged (NaN logits in the sampler): no traceback to read
        print(f"rollcorr train: {err}", file=sys.stderr)
        return 1
    except UserCodeError as err:  # a reward that raised, hung or returned what it may not: its one line
        print(f"rollcorr train: {err}; {_resume_hint(args)}", file=sys.stderr)
        return 1
    except RuntimeError as err:  # the sampler process died, failed or stopped beating: one line, not a chain
        from rollcorr.train.sampler_process import SamplerProcessError

        cause = err if isinstance(err, SamplerProcessError) else err.__cause__
        if not isinstance(cause, SamplerProcessError):
            raise
        first, _, details = str(cause).partition("\n")
        print(f"rollcorr train: {first}; {_resume_hint(args)}", file=sys.stderr)
        if details:  # an exception inside the sampler: its own traceback, once
            print(details, file=sys.stderr)
        return 1
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
