"""The ``rollcorr`` command. Each sub-command lives in its app package and is imported only when used."""

from __future__ import annotations

import argparse
import errno
import importlib
import resource
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
    except (MemoryError, RuntimeError, SystemError, OSError, ImportError) as err:  # a memory limit hit anywhere
        if not out_of_memory(err):
            raise
        print(f"rollcorr {args.command}: out of memory ({_what_ran_out(err)}); nothing is "
              "half-written (a training run's checkpoints are whole: --resume it with more memory)",
              file=sys.stderr)  # fmt: skip
        return 1


# how an allocation that failed reads when it does not arrive as a MemoryError
ALLOCATION_FAILED = ("can't allocate memory", "cannot allocate memory", "std::bad_alloc", "can't start new thread")
# how it reads when only the address-space limit (ulimit -v) tells it from an internal error: CPython's C function
# that lost its MemoryError, the dynamic loader unable to map a library while a module is imported
LIMIT_HIT = {SystemError: "error return without exception set", ImportError: "failed to map segment"}


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation that failed anywhere in a command: Python's MemoryError, an OSError
    ENOMEM, torch's CPU allocator refusing (a RuntimeError "DefaultCPUAllocator: can't allocate memory"), a
    thread whose stack could not be mapped — or, in a process with an address-space limit, the two ways a
    failed allocation shows up under ``ulimit -v`` while torch and transformers are imported (LIMIT_HIT)."""
    text = str(err).lower()
    for kind, sign in LIMIT_HIT.items():
        if isinstance(err, kind):
            return sign in text and address_space_limit() is not None
    if isinstance(err, OSError):
        return err.errno == errno.ENOMEM
    return isinstance(err, MemoryError) or any(sign in text for sign in ALLOCATION_FAILED)


def address_space_limit() -> int | None:
    """The process's address-space limit in bytes (``ulimit -v``), or None when there is none. (``resource`` is
    imported with this module: under the limit, importing it in the handler can itself fail to map.)"""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def _what_ran_out(err: BaseException) -> str:
    """The allocator's words, or the address-space limit when CPython lost them."""
    if isinstance(err, (SystemError, ImportError)):
        return f"an allocation failed under the address-space limit of {address_space_limit() / 2**30:.2g} GiB"
    return _first_line(err) or type(err).__name__


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else ""


if __name__ == "__main__":
    sys.exit(main())
