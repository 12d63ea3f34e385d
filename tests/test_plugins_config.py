"""Plugins named in the config (docs/plugins.md), followed as a user meets them: the page's ``toy_ext.py`` (a loss,
a rejection rule, a π_old strategy and a sampler engine) and ``toy_run.yaml`` written to a folder rollcorr is not
in, and the page's commands run there as written, in fresh processes — the ``rollcorr`` command itself, whose
Python path holds neither that folder nor the tests, so each process finds the plugin by the config alone.

    command                              processes that must import the plugin            here
    rollcorr train --config toy_run.yaml   the command                                      2 steps
    ... plugins=toy_ext <overrides>      the command                                      the same config
    ... trainer.ranks=2                  the command, then 2 ranks (python -m rollcorr)   slow; probe: ranks 0, 1
    ... trainer.mode=async               the command, the sampler process                 2 steps
    torchrun ... -m rollcorr train       2 ranks                                          slow; probe: ranks 0, 1
    ... trainer.executor=ray             the command, a Ray worker                        slow
    rollcorr analyze / audit --plugins   the command                                      the rule explained; audited

The probe (``rank_probe``, a test-only plugin listed after ``toy_ext``) wraps the toy rule's ``apply`` to note
the rank whose process applied it: a rule missing from a rank would be silently off there (the loss, strategy
and engine would stop it with an "unknown ..." line), so the probe is what shows every rank applied it.

Also: an installed package with an entry point in ``rollcorr.plugins`` (a throwaway ``.dist-info`` on
``PYTHONPATH``, never the shared environment) is loaded with no line; a misspelt or failing plugin is one line
before any model loads (in the command, under ``trainer.ranks=2``, in each rank's process); a run folder's
``config.yaml`` imports nothing by itself (``--resume``, ``audit --from-run``); ``SourceSpec.build`` imports the
run's plugins where the sampler is built.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "plugins.md"
SHORT = ["trainer.steps=2", "task.eval_prompts=0", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "rollout.max_new_tokens=4", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false"]
PROBE = '''"""Test-only plugin: the toy rule's apply, wrapped to note the rank whose process applied it."""
import dataclasses
import os

from rollcorr.correction import rejection

at = next(i for i, rule in enumerate(rejection.RULES) if rule.kind == "toy_far_rows")
toy = rejection.RULES[at]


def apply(*args):
    with open(os.environ["TOY_PROBE"], "a") as out:
        out.write(os.environ.get("RANK", "0") + "\\n")
    return toy.apply(*args)


rejection.RULES[at] = dataclasses.replace(toy, apply=apply)
'''
WITH_PROBE = "plugins=[toy_ext,rank_probe]"


def doc_block(first_line_start: str) -> str:
    """The fenced block of docs/plugins.md whose first line starts with ``first_line_start``."""
    blocks = re.findall(r"^```\w*\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.S | re.M)
    (body,) = [b for b in blocks if b.startswith(first_line_start)]
    return body


def doc_commands(first_line_start: str) -> list[str]:
    return [line for line in doc_block(first_line_start).splitlines() if line.strip()]


TRAIN_LINES = doc_commands("rollcorr train --config toy_run.yaml")
FAILED_LINE = doc_block("rollcorr train: config error: plugins: 'toy_extt'").strip()


def argv_of(line: str) -> list[str]:
    """A page's command as argv in this environment: ``rollcorr`` is the installed command beside this Python
    (its path holds no folder of ours), ``torchrun`` is torch's launcher."""
    args = shlex.split(line)
    command = Path(sys.executable).with_name("rollcorr")
    if args[0] == "rollcorr":
        return [str(command) if command.is_file() else sys.executable, *(["-m", "rollcorr"] * (not command.is_file())),
                *args[1:]]
    assert args[0] == "torchrun", line
    return [sys.executable, "-m", "torch.distributed.run", *args[1:]]


def run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``argv`` in ``cwd``, this checkout's rollcorr first on the Python path (and nothing else of ours)."""
    path = os.pathsep.join([str(ROOT / "src"), *env.pop("PYTHONPATH", "").split(os.pathsep)]).rstrip(os.pathsep)
    full = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **env}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        if key not in env:
            full.pop(key, None)
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=full, timeout=900)


def steps(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The page's plugin and config, and the test's probe, in a folder of their own."""
    where = tmp_path_factory.mktemp("user")
    (where / "toy_ext.py").write_text(doc_block("# toy_ext.py"), encoding="utf-8")
    (where / "toy_run.yaml").write_text(doc_block("# toy_run.yaml"), encoding="utf-8")
    (where / "rank_probe.py").write_text(PROBE, encoding="utf-8")
    return where


def train_line(folder: Path, index: int, out: str, *extra: str, probe: bool = True
               ) -> tuple[subprocess.CompletedProcess, Path | None]:
    """The page's ``index``-th train line, made short (with the probe), writing to ``folder/out``."""
    noted = folder / f"{out}.probe"
    noted.unlink(missing_ok=True)
    done = run([*argv_of(TRAIN_LINES[index]), *SHORT, *[WITH_PROBE] * probe, f"trainer.out={out}", *extra], folder,
               TOY_PROBE=str(noted))
    return done, noted if probe else None


def check_the_toys_ran(done: subprocess.CompletedProcess, run_dir: Path, probe: Path | None, ranks: set[str]) -> None:
    """2 steps with the toy strategy's and rule's metrics and the toy loss's in the first (a later one may have no
    kept token: async's lag moves ℓ past the rule's limit; at step 1 sampler and learner hold the same float32
    weights, |ℓ| ~ 1e-6 ≪ log 1.5); the toy sampler in the saved config; the rule applied in the process of
    every rank of ``ranks``."""
    assert done.returncode == 0, done.stderr[-3000:]
    got = steps(run_dir)
    assert len(got) == 2 and "actor/toy_clipped_share" in got[0]  # the toy loss computed it
    assert [s["proximal/toy_calls"] for s in got] == [1.0, 2.0]  # the strategy, asked once a step
    assert all(0.0 <= s["rollout_corr/toy_far_rows_fraction"] <= 1.0 for s in got)  # the rule's metric
    saved = (run_dir / "config.yaml").read_text()
    assert "sampler: toy_fp32" in saved and "- toy_ext" in saved and "toy_far_rows:" in saved
    assert probe is None or set(probe.read_text().split()) == ranks


@pytest.fixture(scope="module")
def toy_run(folder) -> Path:
    """``rollcorr train --config toy_run.yaml`` for 2 steps, in ``runs/toy`` (the page's resume line's folder)."""
    done, probe = train_line(folder, 0, "runs/toy", probe=False)
    check_the_toys_ran(done, folder / "runs/toy", probe, {"0"})
    return folder / "runs/toy"


def test_plain_rollcorr_train_imports_the_plugin_the_config_names(toy_run, folder):
    """The config file's line trains with the four toys; the override line is the same config (both resolved by
    ``--print-config``, each in its own process)."""
    assert steps(toy_run)[-1]["step"] == 2
    printed = [run([*argv_of(TRAIN_LINES[i]), "--print-config"], folder) for i in (0, 1)]
    assert all(done.returncode == 0 for done in printed), printed[-1].stderr[-3000:]
    by_file, by_line = (yaml.safe_load(done.stdout) for done in printed)
    assert by_file == by_line and by_file["plugins"] == ["toy_ext"]
    assert by_file["algorithm"]["correction"]["rules"] == {"toy_far_rows": {"limit": 1.5}}


def test_the_async_sampler_process_imports_it(folder):
    done, probe = train_line(folder, 3, "async")
    assert "trainer.mode=async" in TRAIN_LINES[3]
    check_the_toys_ran(done, folder / "async", probe, {"0"})


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("index", [2, 4], ids=["trainer.ranks=2", "torchrun"])
def test_every_rank_imports_it(folder, index):
    """``trainer.ranks=2`` (rollcorr's launcher) and torchrun: each rank is a fresh ``python -m rollcorr`` that
    reads the config; the probe shows the rule applied in both ranks' processes."""
    done, probe = train_line(folder, index, f"ranks{index}")
    check_the_toys_ran(done, folder / f"ranks{index}", probe, {"0", "1"})


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_a_ray_worker_imports_it(folder):
    """The sampler in a Ray actor (built from the run's ``SourceSpec``, which carries ``plugins``)."""
    done, probe = train_line(folder, 0, "ray", "trainer.executor=ray", "trainer.ray_workers=1")
    check_the_toys_ran(done, folder / "ray", probe, {"0"})


def test_analyze_and_audit_take_plugins(folder, tmp_path):
    analyze, audit = doc_commands("rollcorr train --config toy_run.yaml")[5:]
    out = tmp_path / "analysis.json"
    done = run([*argv_of(analyze), "--json", str(out)], folder)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["rule"] for r in report["rules"]] == ["toy_far_rows"]  # explained rule by rule, as a built-in one
    audit_argv = argv_of(audit)
    audit_argv[audit_argv.index("-n") + 1] = "4"
    done = run([*audit_argv, "--max-new-tokens", "4", "--out", str(tmp_path / "audit")], folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "audit" / "summary.json").read_text())["source"]["sampler"] == "toy_fp32"


def test_an_installed_plugin_needs_no_line(folder, tmp_path):
    """The page's entry point, installed into a temporary folder (a ``.dist-info`` with its ``entry_points.txt``
    beside the module, on ``PYTHONPATH``): trained with from another folder, with no ``plugins`` line; with
    ``ROLLCORR_PLUGIN_AUTOLOAD=0`` its names are unknown again."""
    table = tomllib.loads(doc_block("# pyproject.toml"))["project"]["entry-points"]["rollcorr.plugins"]
    site = tmp_path / "site"
    info = site / "toy_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rollcorr.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in table.items()))
    (site / "toy_ext.py").write_text(doc_block("# toy_ext.py"), encoding="utf-8")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    argv = [*argv_of("rollcorr train"), "model.sampler=toy_fp32", "algorithm.loss=toy_clipped_pg", *SHORT,
            "trainer.steps=1", "trainer.out=run"]
    done = run(argv, elsewhere, PYTHONPATH=str(site))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "actor/toy_clipped_share" in steps(elsewhere / "run")[0]
    assert "plugins: []" in (elsewhere / "run" / "config.yaml").read_text()  # no line: it came installed
    done = run(argv, elsewhere, PYTHONPATH=str(site), ROLLCORR_PLUGIN_AUTOLOAD="0")
    (said,) = lines(done.stderr)
    assert done.returncode == 2 and said.startswith("rollcorr train: config error: algorithm.loss: unknown loss "
                                                    "'toy_clipped_pg'; use one of ('ppo_clip',")


def test_a_misspelt_or_failing_plugin_is_one_line_before_anything_loads(folder, tmp_path):
    """The page's line, exit 2, no run folder: from the command, and from ``trainer.ranks=2`` (said once, before
    any rank starts); each rank's own process (torchrun's environment) says it too; a module that raises is
    named with where; ``--plugins`` of audit and analyze likewise."""
    misspelt = ["plugins=toy_extt", f"trainer.out={tmp_path / 'never'}"]
    for extra in ([], ["trainer.ranks=2"]):
        done = run([*argv_of("rollcorr train"), *misspelt, *extra], folder)
        assert done.returncode == 2 and lines(done.stderr) == [FAILED_LINE], done.stderr
    ranks = [subprocess.Popen([*argv_of("rollcorr train"), *misspelt], cwd=folder, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "RANK": str(r), "LOCAL_RANK": str(r),
                                   "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555",
                                   "TORCHELASTIC_RUN_ID": "plugins-test"})
             for r in range(2)]
    for rank in ranks:  # each rank checks on its own, before it would wait for any peer
        assert rank.wait(timeout=300) == 2 and lines(rank.stderr.read()) == [FAILED_LINE]
    said = re.search(r"\(`plugins: 'toy_ext': failed while importing:\s+(.*?)`\)", DOC.read_text(), re.S)
    broken = tmp_path / "broken"
    broken.mkdir()
    source = doc_block("# toy_ext.py").splitlines()
    assert source[1] == "import math"  # line 2 of the file, where the page's example goes wrong
    (broken / "toy_ext.py").write_text("\n".join([source[0], "torchh", *source[2:]]))
    done = run([*argv_of("rollcorr train"), "plugins=toy_ext", f"trainer.out={tmp_path / 'never'}"], broken)
    assert done.returncode == 2 and lines(done.stderr) == [
        f"rollcorr train: config error: plugins: 'toy_ext': failed while importing: {' '.join(said.group(1).split())}"
    ]
    for tool in ("audit", "analyze"):
        done = run([*argv_of(f"rollcorr {tool}"), "--plugins", "toy_extt"], folder)
        assert done.returncode == 2 and lines(done.stderr) == [
            f"rollcorr {tool}: error: --plugins: 'toy_extt': no module named 'toy_extt' on the Python path or in "
            "the current folder"
        ]
    assert not (tmp_path / "never").exists() and not (folder / "runs" / "never").exists()


def test_a_run_folder_imports_nothing_by_itself(toy_run, folder, tmp_path):
    """``--resume`` and ``audit --from-run`` of the run refuse in one line until the command names its plugins
    (the page's two lines, which then work); the file alone never imported the module."""
    from rollcorr.train.config import ConfigError, load_config

    # in this process: a run folder whose config names a module that would leave a mark if it were imported
    marked = tmp_path / "marked"
    (tmp_path / "mark_on_import.py").write_text(f"open({str(marked)!r}, 'w').close()\n")
    copy = tmp_path / "run"
    copy.mkdir()
    (copy / "config.yaml").write_text("plugins: [mark_on_import]\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ConfigError) as refused:
            load_config(copy / "config.yaml", inside_run=True)
    finally:
        sys.path.remove(str(tmp_path))
    assert not marked.exists() and "mark_on_import" not in sys.modules
    assert str(refused.value) == (
        f"plugins: {copy / 'config.yaml'} names mark_on_import, not imported: a run folder's file never imports code; "
        "name them yourself (rollcorr train --resume RUN_DIR plugins=[mark_on_import]; rollcorr audit --plugins "
        "mark_on_import)"
    )
    said = ("plugins: runs/toy/config.yaml names toy_ext, not imported: a run folder's file never imports code; name "
            "them yourself (rollcorr train --resume RUN_DIR plugins=[toy_ext]; rollcorr audit --plugins toy_ext)")
    resume, audit = doc_commands("rollcorr train --resume runs/toy")
    done = run([*argv_of("rollcorr train"), "--resume", "runs/toy", "trainer.steps=3"], folder)
    assert done.returncode == 2 and lines(done.stderr) == [f"rollcorr train: config error: {said}"]
    done = run(argv_of(resume), folder, TOY_PROBE=str(tmp_path / "probe"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s["step"] for s in steps(toy_run)] == [1, 2, 3] and "proximal/toy_calls" in steps(toy_run)[-1]
    audit_argv = argv_of(audit)
    audit_argv[audit_argv.index("-n") + 1] = "4"
    without = [a for a in audit_argv if a not in ("--plugins", "toy_ext")]
    done = run([*without, "--max-new-tokens", "4", "--out", str(tmp_path / "refused")], folder)
    assert done.returncode == 2 and "names toy_ext, not imported" in lines(done.stderr)[0], done.stderr
    done = run([*audit_argv, "--max-new-tokens", "4", "--out", str(tmp_path / "audit")], folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "audit" / "summary.json").read_text())["source"]["sampler"] == "toy_fp32"


def test_the_sampler_side_imports_the_runs_plugins(tmp_path, monkeypatch):
    """``SourceSpec`` carries the run's ``plugins`` and ``build`` imports them first (the sampler process and each
    Ray worker build their source with it)."""
    from rollcorr.train.config import load_config
    from rollcorr.train.source import SourceSpec

    (tmp_path / "marker_plugin.py").write_text("from rollcorr.tasks import register_reward\n"
                                              "register_reward('marker_reward', lambda item, text: 1.0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(None, ["plugins=[marker_plugin]", "task.name=addition:1"])
    spec = SourceSpec.from_config(config)
    assert spec.plugins == ("marker_plugin",)
    sys.modules.pop("marker_plugin")  # as in a fresh process
    from rollcorr.tasks import REWARDS

    del REWARDS["marker_reward"]
    spec.build()
    assert "marker_plugin" in sys.modules and "marker_reward" in REWARDS
    del REWARDS["marker_reward"]


def test_train_names_its_plugins_in_the_config(capsys):
    """``rollcorr train --plugins x`` (the audit's flag) says the key it means, importing nothing."""
    from rollcorr.cli import main

    assert main(["train", "--plugins", "never_imported_ext"]) == 2
    assert capsys.readouterr().err.strip() == ("rollcorr train: --plugins is not an option of train; settings are "
                                               "dotted keys: rollcorr train plugins=[never_imported_ext]")
    assert "never_imported_ext" not in sys.modules
