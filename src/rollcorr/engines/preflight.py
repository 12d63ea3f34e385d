"""Check an engine spec and a model path before anything heavy is loaded: the one home of these checks.

``preflight(spec, model_path, role=..., gguf_file=...)`` is called by ``rollcorr audit`` (before sampling or
dequantising a GGUF) and by the trainer's config check (before a run folder is created). It reads only small
files (config.json, the safetensors headers) and asks ``importlib`` whether an optional package is
installed, without importing it. Every problem is a ``PreflightError`` whose ``field`` says which input was
wrong, so each caller names its own key (``model.path`` in a train config, ``--model`` on the audit CLI):

    spec       the engine spec, and what its backend refuses (``Backend.check_spec``: an unknown backend or
               option, a backend without learners as a learner, hf:int8 as a learner, ...) or refuses of the
               model (``Backend.check_model``: e.g. an architecture llamacpp's GGUF writer does not know)
    extra      the optional package of the spec's backend is not installed (``Backend.extra``: llama-cpp-python,
               vLLM), or gguf for ``gguf_file``
    path       the model folder (missing, a Hub id, a file, empty, bad config.json, corrupt safetensors)
    gguf_file  the GGUF file or the package needed to read it
"""

from __future__ import annotations

import importlib.util
import json
import re
import struct
from pathlib import Path

from rollcorr.engines.spec import BACKENDS, EngineSpec, check_role
from rollcorr.models.builtin import BUILTIN, builtin_path

# extra name in pyproject.toml -> (python modules it provides, what the user knows it as); a backend names its own
# (``Backend.extra``)
EXTRAS = {
    "llamacpp": (("llama_cpp", "gguf"), "llama-cpp-python"),
    "vllm": (("vllm",), "vLLM"),
    "gguf": (("gguf",), "reading a GGUF model (the gguf package)"),
}
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


def _check_safetensors(file: Path) -> dict:
    """Read a .safetensors header (8-byte length + JSON) and check the file holds every tensor's bytes;
    returns the header ({name: {"dtype", "shape", "data_offsets"}})."""
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
    return {k: v for k, v in header.items() if k != "__metadata__"}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _check_shards(path: Path) -> list[Path]:
    """The weight files of ``path``: those a ``*.safetensors.index.json`` names (each must exist) or else
    every ``*.safetensors``."""
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if not indexes:
        return sorted(path.glob("*.safetensors"))
    try:
        weight_map = json.loads(indexes[0].read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as err:
        raise PreflightError("path", f"{str(indexes[0])!r} is not a valid shard index ({err})") from None
    missing = [name for name in shards if not (path / name).is_file()]
    if missing:
        raise PreflightError("path", f"{str(indexes[0])!r} names {len(missing)} shard(s) that are not in the "
                             f"folder: {', '.join(missing[:3])}")
    return [path / name for name in shards]


def _expected_tensors(path: Path, data: dict) -> tuple[dict[str, tuple[int, ...]], set[str], str]:
    """The state-dict names and shapes config.json implies (a model built on the meta device: no memory),
    the names that may be absent (tied weights), and the base-model prefix. Never runs the folder's own
    code: an ``auto_map`` model whose ``model_type`` transformers does not know is refused."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError) as err:
        custom = " (its code is in the folder, auto_map; rollcorr never runs a model's own code)" if "auto_map" in data else ""
        raise PreflightError("path", f"{str(path / 'config.json')!r}: model_type {data['model_type']!r} is not "
                             f"known to this transformers{custom}: {str(err).splitlines()[0][:120]}") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as err:
        raise PreflightError("path", f"{str(path / 'config.json')!r}: transformers cannot build a causal LM "
                             f"from it ({str(err).splitlines()[0][:160]})") from None
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = set(getattr(model, "_tied_weights_keys", None) or []) if getattr(config, "tie_word_embeddings", False) else set()
    return shapes, tied, getattr(model, "base_model_prefix", "model")


def check_weights_match_config(path: Path, data: dict, headers: dict[str, dict]) -> None:
    """PreflightError(field="path") when the safetensors miss a tensor the config needs (transformers would
    initialise it at random), hold one it does not know, or a shape disagrees with config.json."""
    expected, tied, prefix = _expected_tensors(path, data)
    found = {name: tuple(h.get("shape", ())) for name, h in headers.items()}
    if not set(found) & set(expected):  # saved from the base model: names without "model."
        found = {f"{prefix}.{name}": shape for name, shape in found.items()}
    missing = sorted(set(expected) - set(found) - tied)
    extra = sorted(set(found) - set(expected))
    if missing:
        raise PreflightError("path", f"{str(path)!r}: the weights miss {len(missing)} tensor(s) config.json "
                             f"needs ({', '.join(missing[:3])}); transformers would initialise them at random")
    if extra:
        raise PreflightError("path", f"{str(path)!r}: the weights hold {len(extra)} tensor(s) the model of "
                             f"config.json does not have ({', '.join(extra[:3])})")
    for name, shape in expected.items():
        if name in found and found[name] != shape:
            raise PreflightError("path", f"{str(path)!r}: tensor {name!r} has shape {list(found[name])}, "
                                 f"config.json implies {list(shape)}")


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
                                 "make it with the pretraining command in docs/builtin-model.md")
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
    weights = _check_shards(path)
    if not weights:
        if any(path.glob("*.bin")):
            raise PreflightError(
                "path", f"{str(model_path)!r} holds *.bin weights only; rollcorr loads *.safetensors"
            )
        raise PreflightError("path", f"{str(model_path)!r} has no *.safetensors weights")
    headers: dict[str, dict] = {}
    for file in weights:
        headers.update(_check_safetensors(file))
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise PreflightError("path", f"{str(model_path)!r} has no tokenizer files (one of "
                             f"{', '.join(TOKENIZER_FILES)}); copy them from the model's original folder")
    check_weights_match_config(path, data, headers)
    check_tokenizer_fits(path, data)


def check_tokenizer_fits(path: Path, data: dict) -> None:
    """The folder's tokenizer loads and every id fits the embedding (``vocab_size`` rows)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - any tokenizer file transformers cannot read
        raise PreflightError("path", f"{str(path)!r}: its tokenizer does not load "
                             f"({str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__})") from None
    vocab = data.get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise PreflightError("path", f"{str(path)!r}: the tokenizer has {len(tokenizer)} tokens but config.json's "
                             f"embedding only {vocab} rows: the tokenizer does not belong to this model")


def check_spec(spec: str, role: str = "sampler") -> EngineSpec:
    """The parsed spec, or PreflightError(field="spec"): the grammar and what its backend refuses for ``role``."""
    try:
        return check_role(spec, role)
    except PreflightError:
        raise
    except ValueError as err:
        raise PreflightError("spec", str(err)) from None


def check_prompts(
    tokenizer, prompts: list[str | list[int]], max_new_tokens: int, max_positions: int | None, what: str
) -> None:
    """PreflightError(field="prompts") for a prompt the tokenizer cannot encode (an ``<unk>``, or characters
    it drops) or one whose tokens plus ``max_new_tokens`` exceed the model's ``max_positions``. A prompt given
    as token ids (through a chat template) is checked for its length only."""
    from transformers.utils import logging as hf_logging

    unk = getattr(tokenizer, "unk_token_id", None)
    vocab = tokenizer.get_vocab() if is_char_tokenizer(tokenizer) else None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "sequence length is longer than ..." is what this check says, in one line
    try:
        encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p)
                   for p in prompts]
    finally:
        hf_logging.set_verbosity(verbosity)
    for i, (text, ids) in enumerate(zip(prompts, encoded)):
        if not isinstance(text, str):
            continue
        unknown = sorted({c for c in text if c not in vocab}) if vocab is not None else []
        if unknown:
            raise PreflightError("prompts", f"{what} {i}: characters the tokenizer cannot encode "
                                 f"({''.join(unknown[:10])!r}); it would drop them")
        if unk is not None and unk in ids:
            raise PreflightError("prompts", f"{what} {i}: text the tokenizer cannot encode (it becomes its "
                                 "unknown token)")
    longest = max(map(len, encoded), default=0)
    if max_positions is not None and longest + max_new_tokens > max_positions:
        raise PreflightError("prompts", f"{what}: the longest is {longest} tokens; with {max_new_tokens} new "
                             f"tokens that is past the model's {max_positions} positions")


def is_char_tokenizer(tokenizer) -> bool:
    """The built-in character tokenizer (one token per character)."""
    from rollcorr.models.builtin import CHARACTERS, SPECIAL_TOKENS

    return len(tokenizer) == len(SPECIAL_TOKENS) + len(CHARACTERS) and all(c in tokenizer.get_vocab() for c in "09aZ")


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
    backend = BACKENDS[parsed.backend]
    if backend.extra is not None:
        check_extra(backend.extra)
    check_model_dir(model_path, gguf_file)
    try:
        backend.check_model(parsed, spec, model_path, gguf_file)
    except PreflightError:
        raise
    except ValueError as err:
        raise PreflightError("spec", str(err)) from None
    if gguf_file is not None:
        try:
            check_extra("gguf")
        except PreflightError as err:
            raise PreflightError("gguf_file", str(err)) from None
