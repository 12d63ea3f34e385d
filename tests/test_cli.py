"""The top-level ``rollcorr`` command: help without importing the apps, version, dispatch."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from rollcorr.cli import COMMANDS, build_parser, main

CHECK = """
import sys
from rollcorr.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print(sorted(m for m in ("torch", *{apps!r}) if m in sys.modules))
"""


def imported_by(argv: list[str]) -> list[str]:
    """Modules among torch and the apps' CLI modules that running ``rollcorr argv`` imported."""
    apps = [module for module, _ in COMMANDS.values()]
    code = CHECK.format(argv=argv, apps=apps)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def test_top_level_help_imports_no_app_and_no_torch():
    assert imported_by(["--help"]) == []
    assert imported_by(["--version"]) == []


def test_a_command_imports_only_its_own_app():
    loaded = imported_by(["analyze", "--help"])
    assert "rollcorr.analyze.cli" in loaded
    assert "rollcorr.train.cli" not in loaded and "rollcorr.audit.cli" not in loaded


def test_version_and_unknown_command(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip()
    with pytest.raises(SystemExit):
        main(["no-such-command"])
    assert "invalid choice" in capsys.readouterr().err


def test_full_parser_knows_every_command_option():
    parser = build_parser()  # every app's arguments (what documentation tools would read)
    args = parser.parse_args(["train", "--print-config", "trainer.steps=3"])
    assert args.command == "train" and args.print_config


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["train", "--sampler", "vllm"], "rollcorr train model.sampler=vllm"),
        (["train", "trainer.steps=2", "--model=models/x"], "rollcorr train model.path=models/x"),
    ],
)
def test_train_with_an_audit_flag_points_to_the_dotted_key(capsys, argv, hint):
    from rollcorr.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert hint in err and len(err.strip().splitlines()) == 1


def test_no_help_text_loads_torch():
    """Every sub-command's --help is argument parsing only: torch (about 2 s to import) is not loaded."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io\nfrom rollcorr.cli import COMMANDS, main\n"
            "for name in COMMANDS:\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        main([name, '--help'])\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_train_stops_through_one_table(capsys):
    """``rollcorr train``'s exit codes come from one table (``train.cli.stops``): no row is hidden by an earlier one
    (a subclass comes before its base), each kind is said as its row says, and an exception raised from the
    sampler process's error is that error."""
    import argparse

    from rollcorr.train.cli import stopped, stops
    from rollcorr.train.config import ConfigError
    from rollcorr.train.rundir import RunFinished
    from rollcorr.train.sampler_process import SamplerProcessError

    rows = stops()
    for i, row in enumerate(rows):
        hidden = [earlier.kinds for earlier in rows[:i] if any(issubclass(k, earlier.kinds) for k in row.kinds)]
        assert not hidden, f"{row.kinds} is matched earlier by {hidden}"
    args = argparse.Namespace(resume=None, out=None)
    assert stopped(ConfigError("trainer.steps: bad"), args) == 2
    assert capsys.readouterr().err == "rollcorr train: config error: trainer.steps: bad\n"
    assert stopped(RunFinished("done"), args) == 0 and capsys.readouterr().out == "rollcorr train: done\n"
    try:
        try:
            raise SamplerProcessError("the sampler process failed: boom\nTraceback ...")
        except SamplerProcessError as cause:
            raise RuntimeError("the executor stopped") from cause
    except RuntimeError as err:
        assert stopped(err, args) == 1
    said = capsys.readouterr().err.splitlines()
    assert said[0].startswith("rollcorr train: the sampler process failed: boom; ") and said[1] == "Traceback ..."
    assert stopped(RuntimeError("not a stop"), args) is None and stopped(MemoryError(), args) is None
    assert stopped(OSError(12, "Cannot allocate memory"), args) is None  # rollcorr.cli says out of memory
