"""Check an engine spec and a model path before anything heavy is loaded: the one home of these checks.

``preflight(spec, model_path, role=..., gguf_file=...)`` is called by ``rollcorr audit`` (before sampling or
dequantising a GGUF) and by the trainer's config check (before a run folder is created). It reads only small
files (config.json, the safetensors headers) and asks ``importlib`` whether an optional package is
installed, without importing it. Every problem is a ``PreflightError`` whose ``field`` says which input was
wrong, so each caller names its own key (``model.path`` in a train config, ``--model`` on the audit CLI):

    spec       the engine spec (unknown backend, a learner that is not hf, hf:int8 as a learner)
    extra      an optional dependency of the spec is not installed (llama-cpp-python, vLLM, gguf)
    path       the model folder (missing, a Hub id, a file, empty, bad config.json, corrupt safetensors)
    gguf_file  the GGUF file or the package needed to read it
"""

from __future__ import annotations

import importlib.util
import json
import re
import struct
from pathlib import Path

from rollcorr.engines.spec import parse_learner_spec, parse_spec
from rollcorr.models.builtin import BUILTIN, builtin_path

# extra name in pyproject.toml -> (python modules it provides, what the user knows it as)
EXTRAS = {
    "llamacpp": (("llama_cpp", "gguf"), "llama-cpp-python"),
    "vllm": (("vllm",), "vLLM"),
    "gguf": (("gguf",), "reading a GGUF model (the gguf package)"),
}
BACKEND_EXTRA = {"llamacpp": "llamacpp", "vllm": "vllm"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")  # "Qwen/Qwen2.5-0.5B-Instruct"


class PreflightError(ValueError):
    """A spec / model problem found before loading; ``field`` is one of spec, extra, path, gguf_file."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def install_hint(extra: str) -> str:
    """How to install an extra of this project (it is installed from its repository, not from PyPI)."""
    return (
        f'install it from the rollcorr checkout with: pip install -e ".[{extra}]" '
        f"(or: ROLLCORR_OPTIONAL={extra} bash scripts/setup.sh)"
    )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module blocked with sys.modules[name] = None, or a broken one
        return False


def check_extra(extra: str) -> None:
    """PreflightError(field="extra") if a module of ``extra`` (a key of EXTRAS) is not installed."""
    modules, known_as = EXTRAS[extra]
    missing = [m for m in modules if not _installed(m)]
    if missing:
        raise PreflightError(
            "extra",
            f"{known_as}: not installed (no module {', '.join(map(repr, missing))}); {install_hint(extra)}",
        )


def _check_safetensors(file: Path) -> None:
    """Read a .safetensors header (8-byte length + JSON) and check the file holds every tensor's bytes."""
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError("header length past the end of the file")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise PreflightError("path", f"{str(file)!r} is not a valid safetensors file ({err})") from None
    if 8 + n + end != size:
        raise PreflightError(
            "path",
            f"{str(file)!r} is truncated or corrupt: its header needs {8 + n + end} bytes, it has {size}",
        )


def check_model_dir(model_path: str | Path | None, gguf_file: str | None = None) -> None:
    """PreflightError(field="path") unless ``model_path`` is "builtin"/None or a loadable local HF folder.

    With ``gguf_file`` the folder only has to hold that file (the weights, config and tokenizer are in it).
    """
    if model_path is None:
        return
    if str(model_path) == BUILTIN or str(model_path).startswith(f"{BUILTIN}:"):  # shipped: known and present
        try:
            directory = Path(builtin_path(model_path))
        except ValueError as err:
            raise PreflightError("path", str(err)) from None
        if not (directory / "config.json").is_file():
            raise PreflightError("path", f"built-in model {str(model_path)!r} is not in this installation; "
                                 "make it with the pretraining command in docs/builtin-model.md")  # fmt: skip
        return
    path = Path(model_path)
    if not path.exists():
        if HUB_ID.match(str(model_path)):
            name = str(model_path).split("/")[1]
            raise PreflightError(
                "path",
                f"{str(model_path)!r} does not exist here; it looks like a Hugging Face Hub id, but rollcorr "
                f"loads weights from a local folder only and downloads nothing. Download it first, e.g. "
                f"hf download {model_path} --local-dir models/{name} (huggingface_hub), and pass models/{name}",
            )
        raise PreflightError("path", f"{str(model_path)!r} does not exist")
    if not path.is_dir():
        raise PreflightError(
            "path", f"{str(model_path)!r} is a file; pass the Hugging Face model folder that holds it"
        )
    if gguf_file is not None:
        return
    if not any(path.iterdir()):
        raise PreflightError("path", f"{str(model_path)!r} is an empty folder (no config.json, no weights)")
    config = path / "config.json"
    if not config.is_file():
        raise PreflightError(
            "path", f"{str(model_path)!r} has no config.json: not a Hugging Face model folder"
        )
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise PreflightError("path", f"{str(config)!r} is not valid JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise PreflightError("path", f'{str(config)!r} has no "model_type": not a transformers config')
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        if any(path.glob("*.bin")):
            raise PreflightError(
                "path", f"{str(model_path)!r} holds *.bin weights only; rollcorr loads *.safetensors"
            )
        raise PreflightError("path", f"{str(model_path)!r} has no *.safetensors weights")
    for file in weights:
        _check_safetensors(file)


def check_spec(spec: str, role: str = "sampler"):
    """The parsed spec, or PreflightError(field="spec") — a learner must be hf with float weights."""
    try:
        parsed = parse_learner_spec(spec) if role == "learner" else parse_spec(spec)
    except ValueError as err:
        raise PreflightError("spec", str(err)) from None
    return parsed


def preflight(
    spec: str, model_path: str | Path | None = None, *, role: str = "sampler", gguf_file: str | None = None
) -> None:
    """Everything about ``spec`` on ``model_path`` that can be checked without loading a model.

    role       "sampler" or "learner"
    gguf_file  the model is read from this GGUF file in ``model_path`` (transformers dequantises it)
    Raises PreflightError naming the problem; ``err.field`` says which input it is about.
    """
    if role not in ("sampler", "learner"):
        raise ValueError(f"role must be 'sampler' or 'learner', got {role!r}")
    parsed = check_spec(spec, role)
    extra = BACKEND_EXTRA.get(parsed.backend)
    if extra is not None:
        check_extra(extra)
    check_model_dir(model_path, gguf_file)
    if gguf_file is not None:
        try:
            check_extra("gguf")
        except PreflightError as err:
            raise PreflightError("gguf_file", str(err)) from None
