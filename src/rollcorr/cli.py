"""The ``rollcorr`` command. Each sub-command lives in its app package and is imported only when used."""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import resource  # imported here: under the memory limit it reports, loading its module could fail too
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
# the commands that take --plugins (train names its plugins in its config: plugins=[...])
TAKE_PLUGINS = ("analyze", "audit")


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
        if name in TAKE_PLUGINS:
            p.add_argument("--plugins", action="append", default=[], metavar="MODULE[,MODULE]",
                           help="modules to import first: they register engines, rules, losses, rewards "
                                "(docs/plugins.md); installed plugins load without it")
    return parser


# `rollcorr train` takes dotted keys, not the audit's flags: the key each such flag means there
TRAIN_KEYS = {"--sampler": "model.sampler", "--learner": "model.learner", "--model": "model.path",
              "--steps": "trainer.steps", "--seed": "trainer.seed", "--preset": "algorithm.correction.preset",
              "--plugins": "plugins"}


def train_flag_hint(argv: list[str]) -> str | None:
    """One line for ``rollcorr train --sampler vllm`` and the like: the dotted override it means."""
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag in TRAIN_KEYS:
            value = value or (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else "...")
            if flag == "--plugins":
                value = f"[{value}]"
            return (
                f"rollcorr train: {flag} is not an option of train; settings are dotted keys: "
                f"rollcorr train {TRAIN_KEYS[flag]}={value}"
            )
    return None


def main(argv: list[str] | None = None) -> int:
    as_command = argv is None  # the `rollcorr` command itself (its entry point, python -m rollcorr), not a caller
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
    if args.command in TAKE_PLUGINS and (refused := import_plugins(args.plugins)):
        print(f"rollcorr {args.command}: error: {refused}", file=sys.stderr)
        return 2
    # said as it is when even saying why fails at the limit (made now, while there is memory to make it)
    last_words = (f"rollcorr {args.command}: out of memory; nothing is half-written (a training run's checkpoints "
                  "are whole: --resume it with more memory)\n").encode()
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except Exception as err:  # a memory limit hit anywhere (any error: under `ulimit -v` many lose their MemoryError)
        try:
            if not out_of_memory(err):
                raise
            print(f"rollcorr {args.command}: out of memory ({_what_ran_out(err)}); nothing is "
                  "half-written (a training run's checkpoints are whole: --resume it with more memory)",
                  file=sys.stderr)
        except MemoryError:  # the check or the message ran out too: the words made before, and leave
            os.write(2, last_words)
            os._exit(1)
        if as_command:  # the interpreter's own teardown at the limit prints "Exception ignored ... MemoryError"
            sys.stdout.flush()  # dozens of times (half-imported modules): the line said, leave without it
            sys.stderr.flush()
            os._exit(1)
        return 1


def import_plugins(given: list[str]) -> str | None:
    """Import the installed plugins and those ``--plugins`` names (``rollcorr.plugins``); the one line that says
    why one failed, None when all imported."""
    from rollcorr.plugins import PluginError, load_plugins

    names = [name.strip() for text in given for name in text.split(",") if name.strip()]
    try:
        load_plugins(names, source="--plugins")
    except PluginError as err:
        return str(err)
    return None


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation that failed: Python's MemoryError, torch's CPU allocator refusing (a
    RuntimeError "DefaultCPUAllocator: can't allocate memory"), an OSError ENOMEM (the import system listing a
    folder), a thread whose stack could not be mapped; and, in a process whose address space is limited
    (`ulimit -v`), a failure that lost its MemoryError: a compiled module that could not be mapped (an
    ImportError "failed to map segment from shared object": safetensors' or tokenizers' at 0.6 GB), or any
    error raised once the process has reached the limit (``_at_the_limit``) — CPython's SystemError "error
    return without exception set" and torch's RuntimeError "Unable to instantiate PyTypeObject for …" inside
    ``import torch`` at 0.55 GB are the allocation's, not bugs."""
    if _allocator_said_so(err):
        return True
    if _address_space_limit() is None:
        return False
    return "failed to map segment from shared object" in str(err) or _at_the_limit()


def _allocator_said_so(err: BaseException) -> bool:
    """An allocation failure that says so itself (any process, limit or not)."""
    text = str(err)
    return isinstance(err, MemoryError) or getattr(err, "errno", None) == errno.ENOMEM or any(
        sign in text for sign in ("can't allocate memory", "std::bad_alloc", "can't start new thread")
    )


def _address_space_limit() -> int | None:
    """The process's address-space limit in bytes (``ulimit -v``), None when there is none."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _at_the_limit() -> bool:
    """Whether this process's address space has reached 90 % of its limit (then a failure is the allocation's)."""
    limit = _address_space_limit()
    return limit is not None and _peak_address_space() >= 0.9 * limit


def _peak_address_space() -> int:
    """This process's largest address space so far in bytes (VmPeak), 0 when it cannot be read."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmPeak:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _what_ran_out(err: BaseException) -> str:
    """The allocator's words, or the address-space limit when the failure lost them."""
    limit = _address_space_limit()
    if _allocator_said_so(err) or limit is None:
        return _first_line(err) or type(err).__name__
    return f"an allocation failed under the address-space limit of {limit / 2**30:.2g} GiB"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else ""


if __name__ == "__main__":
    sys.exit(main())
