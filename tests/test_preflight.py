"""Engine / model problems are one-line errors naming the key, before any heavy work or run folder.

A missing optional package is simulated honestly: a subprocess blocks the module with
``sys.modules[name] = None`` (so ``importlib.util.find_spec`` and ``import`` both fail) and runs the CLI.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from rollcorr.cli import main
from rollcorr.engines.preflight import PreflightError, preflight
from rollcorr.models.builtin import BUILTIN_DIR
from rollcorr.train.build import check_components
from rollcorr.train.config import ConfigError, load_config

HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"


def _cli_without(modules: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``rollcorr ARGV`` in a fresh interpreter where ``modules`` cannot be imported."""
    code = (
        "import sys\n"
        f"for name in {modules!r}:\n"
        "    sys.modules[name] = None\n"
        "from rollcorr.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


# ---- missing optional packages: audit and train, exit 2, install hint that works from the checkout ----


@pytest.mark.parametrize(
    ("modules", "spec", "extra"),
    [(["llama_cpp"], "llamacpp:q8_0", "llamacpp"), (["vllm"], "vllm:bf16", "vllm")],
)
def test_missing_backend_package_is_one_line_with_exit_2(tmp_path, modules, spec, extra):
    out = tmp_path / "out"
    audit = _cli_without(modules, ["audit", "--sampler", spec, "--out", str(out)])
    assert audit.returncode == 2
    line = _one_line(audit.stderr)
    assert line.startswith("rollcorr audit: error: --sampler: ")
    assert "not installed" in line
    assert (
        f'pip install -e ".[{extra}]"' in line and f"ROLLCORR_OPTIONAL={extra} bash scripts/setup.sh" in line
    )
    train = _cli_without(modules, ["train", f"model.sampler={spec}", "--out", str(out)])
    assert train.returncode == 2
    line = _one_line(train.stderr)
    assert line.startswith("rollcorr train: config error: model.sampler: ")
    assert f'pip install -e ".[{extra}]"' in line
    assert not out.exists()  # no report folder, no run folder


def test_missing_gguf_reader_fails_before_dequantising(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.gguf").write_bytes(b"GGUF")  # never read: the check comes first
    out = tmp_path / "out"
    run = _cli_without(["gguf"], ["audit", "--model", str(model), "--gguf-file", "model.gguf", "--out", str(out)])
    assert run.returncode == 2
    line = _one_line(run.stderr)
    assert line.startswith("rollcorr audit: error: --gguf-file: ") and "no module 'gguf'" in line
    assert 'pip install -e ".[gguf]"' in line
    assert not out.exists()


# ---- model paths: the same checks for audit (--model) and train (model.path) ----


def _corrupt_safetensors(path):
    shutil.copytree(BUILTIN_DIR, path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated download
    return path


def _garbage_safetensors(path):
    shutil.copytree(BUILTIN_DIR, path)
    (path / "model.safetensors").write_bytes(b"\x00" * 64)
    return path


def _bad_config(path):
    shutil.copytree(BUILTIN_DIR, path)
    (path / "config.json").write_text('{"model_type": "qwen2",')
    return path


def _no_model_type(path):
    shutil.copytree(BUILTIN_DIR, path)
    (path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    return path


def _empty(path):
    path.mkdir()
    return path


def _a_file(path):
    path.write_text("not a folder")
    return path


BAD_MODELS = [
    (lambda p: p / "missing", "does not exist"),
    (_empty, "empty folder"),
    (_a_file, "is a file"),
    (_bad_config, "not valid JSON"),
    (_no_model_type, 'no "model_type"'),
    (_corrupt_safetensors, "truncated or corrupt"),
    (_garbage_safetensors, "not a valid safetensors file"),
]


@pytest.mark.parametrize(("make", "message"), BAD_MODELS)
def test_bad_model_path_is_a_config_error(tmp_path, make, message):
    path = make(tmp_path / "model")
    with pytest.raises(ConfigError, match=r"^model\.path: ") as err:
        check_components(load_config(None, [f"model.path={path}"]))
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(PreflightError) as err:
        preflight("hf", path, role="learner")
    assert err.value.field == "path"


@pytest.mark.parametrize(("make", "message"), [BAD_MODELS[1], BAD_MODELS[5]])
def test_bad_model_path_leaves_no_run_or_report_folder(tmp_path, capsys, make, message):
    path, out = make(tmp_path / "model"), tmp_path / "out"
    assert main(["train", f"model.path={path}", "--out", str(out)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("rollcorr train: config error: model.path: ") and message in line
    assert main(["audit", "--model", str(path), "--out", str(out)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("rollcorr audit: error: --model: ") and message in line
    assert not out.exists()


def test_hub_id_says_weights_load_from_a_local_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder called Qwen/ here
    assert main(["audit", "--model", HUB_ID]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "Hugging Face Hub id" in line and "local folder" in line
    assert f"hf download {HUB_ID} --local-dir models/Qwen2.5-0.5B-Instruct" in line
    assert main(["train", f"model.path={HUB_ID}"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("rollcorr train: config error: model.path: ") and "Hub id" in line
    assert not (tmp_path / "runs").exists()


def test_int8_learner_and_non_hf_learner_are_spec_errors():
    with pytest.raises(ConfigError, match=r"^model\.learner: 'hf:int8': int8 quantisation is for samplers"):
        check_components(load_config(None, ["model.learner=hf:int8"]))
    with pytest.raises(ConfigError, match=r"^model\.learner: learners exist for the hf backend only"):
        check_components(load_config(None, ["model.learner=llamacpp:q8_0"]))
    # as a sampler, int8 is fine
    check_components(load_config(None, ["model.sampler=hf:int8"]))


def test_a_valid_model_folder_passes(tmp_path):
    shutil.copytree(BUILTIN_DIR, tmp_path / "m")
    preflight("hf:bf16", tmp_path / "m", role="sampler")
    preflight("hf", tmp_path / "m", role="learner")
    check_components(load_config(None, [f"model.path={tmp_path / 'm'}"]))


def test_builtin_spellings_pass_and_an_unknown_one_is_named():
    from rollcorr.engines.preflight import PreflightError, check_model_dir
    from rollcorr.models.builtin import BUILTIN_MODELS

    for name in BUILTIN_MODELS:
        check_model_dir(name)  # each shipped checkpoint is a loadable folder
    with pytest.raises(PreflightError, match="unknown built-in model 'builtin:nope'"):
        check_model_dir("builtin:nope")
