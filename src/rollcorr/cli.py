"""The ``rollcorr`` command. Each sub-command lives in its app package and is imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> module exposing add_arguments(parser) and run(args) -> int
COMMANDS = {
    "analyze": (
        "rollcorr.analyze.cli",
        "apply a correction config to rollout dumps and explain what it does",
    ),
    "audit": ("rollcorr.audit.cli", "measure sampler vs learner token-probability mismatch, with plots"),
    "train": ("rollcorr.train.cli", "RL training with a separate sampler and learner"),
    "gguf-to-hf": ("rollcorr.convert", "save a GGUF model as a Hugging Face folder (float32 weights)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser. Only ``command``'s module is imported to add its arguments (the apps import
    torch, ~2 s), so ``rollcorr --help`` stays instant; ``None`` adds every command's arguments."""
    parser = argparse.ArgumentParser(prog="rollcorr", description=__doc__)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if command is not None and name != command:
            continue
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as err:  # an app that is not built yet
            if err.name != module:
                raise
            p.set_defaults(_missing=module)
    return parser


# `rollcorr train` takes dotted keys, not the audit's flags: the key each such flag means there
TRAIN_KEYS = {"--sampler": "model.sampler", "--learner": "model.learner", "--model": "model.path",
              "--steps": "trainer.steps", "--seed": "trainer.seed", "--preset": "algorithm.correction.preset"}  # fmt: skip


def train_flag_hint(argv: list[str]) -> str | None:
    """One line for ``rollcorr train --sampler vllm`` and the like: the dotted override it means."""
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag in TRAIN_KEYS:
            value = value or (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else "...")
            return (
                f"rollcorr train: {flag} is not an option of train; settings are dotted keys: "
                f"rollcorr train {TRAIN_KEYS[flag]}={value}"
            )
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # the sub-command is the first argument that names one (top-level options take no values)
    command = next((a for a in argv if a in COMMANDS), "")
    if command == "train" and (hint := train_flag_hint(argv[argv.index("train") + 1 :])):
        print(hint, file=sys.stderr)
        return 2
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.version:
        from rollcorr import __version__

        print(__version__)
        return 0
    if not args.command:
        parser.print_help()
        return 0
    if getattr(args, "_missing", None):
        print(f"rollcorr {args.command}: not available in this build", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except (MemoryError, RuntimeError) as err:  # a memory limit (ulimit -v, a container) hit anywhere in the command
        if not out_of_memory(err):
            raise
        print(f"rollcorr {args.command}: out of memory ({_first_line(err) or type(err).__name__}); nothing is "
              "half-written (a training run's checkpoints are whole: --resume it with more memory)",
              file=sys.stderr)  # fmt: skip
        return 1


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation that failed: Python's MemoryError, torch's CPU allocator refusing (a
    RuntimeError "DefaultCPUAllocator: can't allocate memory"), or a thread whose stack could not be mapped."""
    text = str(err)
    return isinstance(err, MemoryError) or any(
        sign in text for sign in ("can't allocate memory", "std::bad_alloc", "can't start new thread")
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else ""


if __name__ == "__main__":
    sys.exit(main())
