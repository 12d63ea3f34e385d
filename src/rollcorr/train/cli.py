"""``rollcorr train [key=value ...] [--config FILE] [--out DIR] [--resume RUN_DIR]``.

With no arguments: the built-in model learns the built-in addition task with the shipped default config.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--out", type=Path, default=None, help="run folder (default: runs/<timestamp>)")
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its newest checkpoint (overrides apply on top)")  # fmt: skip
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def run(args: argparse.Namespace) -> int:
    import yaml

    from rollcorr.train.config import ConfigError, load_config

    try:
        if args.resume is not None:
            if args.config is not None:
                raise ConfigError("--resume: the run's own config.yaml is used; drop --config")
            config_path = args.resume / "config.yaml"
            if not config_path.is_file():
                raise ConfigError(f"--resume: {str(config_path)!r} does not exist (not a run folder?)")
            config = load_config(config_path, args.overrides)
        else:
            overrides = list(args.overrides)
            if args.out is not None:
                overrides.append(f"trainer.out={args.out}")
            config = load_config(args.config, overrides)
        if args.print_config:
            print(yaml.safe_dump(config.to_dict(), sort_keys=False))
            return 0
        from rollcorr.train.loop import check_components
        from rollcorr.train.loop import run as run_training

        check_components(config)
    except ConfigError as err:
        print(f"rollcorr train: config error: {err}", file=sys.stderr)
        return 2

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # checkpoints call save_pretrained; rollcorr's own bar is the one to read
    result = run_training(config, resume=args.resume)
    acc = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    print(
        f"run folder: {result.run_dir}\n"
        f"steps: {result.steps}  wall time: {result.seconds:.1f} s  "
        f"greedy accuracy: {acc(result.initial_accuracy)} -> {acc(result.final_accuracy)}"
    )
    if result.stopped:
        print(f"stopped early: {result.stopped}", file=sys.stderr)
        return 1
    return 0
