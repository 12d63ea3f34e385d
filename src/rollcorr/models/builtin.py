"""The built-in models: small Hugging Face causal LMs (Qwen2, and one Qwen3-MoE) with a character-level tokenizer.

Each ships as a Hugging Face directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json), trained by ``scripts/pretrain_builtin.py`` on one built-in task:

    "builtin"                  assets/                  3-digit reversed addition (rollcorr.tasks.addition)
    "builtin:chain"            assets_chain/            a chain of 14 numbers, 70-token answers
                                                        (rollcorr.tasks.chain)
    "builtin:moe"              assets_moe/              3-digit reversed addition, a 0.18 M-parameter
                                                        Qwen3-MoE (8 experts, top-2, 2 layers)

``BUILTIN_MODELS`` is the one table of them (directory, task, architecture changes); ``builtin_path`` turns a
spelling into its directory. ``load_model`` loads them or any other local HF directory.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

BUILTIN_DIR = Path(__file__).resolve().parent / "assets"
BUILTIN = "builtin"


@dataclass(frozen=True)
class BuiltinModel:
    """One shipped checkpoint: its directory, the task it was pretrained on (a ``make_task`` name) and the
    changes to ``builtin_config``'s architecture it was built with."""

    directory: Path
    task: str
    architecture: dict = field(default_factory=dict)


# The mixture-of-experts architecture of "builtin:moe": a standard transformers Qwen3-MoE, every layer sparse,
# gate weights renormalised over the top-k (norm_topk_prob, as the released Qwen3-MoE checkpoints).
MOE_ARCHITECTURE = dict(
    model_type="qwen3_moe",
    hidden_size=64,
    intermediate_size=128,  # dense MLP width; unused (no mlp_only_layers)
    moe_intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)

# model.path spelling → checkpoint. "builtin" stays today's addition model; "builtin:<name>" names the others.
BUILTIN_MODELS = {
    BUILTIN: BuiltinModel(BUILTIN_DIR, "addition"),
    f"{BUILTIN}:chain": BuiltinModel(BUILTIN_DIR.with_name("assets_chain"), "chain"),
    f"{BUILTIN}:moe": BuiltinModel(BUILTIN_DIR.with_name("assets_moe"), "addition", MOE_ARCHITECTURE),
}


def is_builtin(path: str | Path | None) -> bool:
    """True for None (the default model) and for the spellings of ``BUILTIN_MODELS``."""
    return path is None or str(path) in BUILTIN_MODELS


def model_location(path: str | Path | None) -> str:
    """The one reading of a ``model.path`` (``--model``) as the engines take it, wherever they are built: a
    built-in spelling as it is (None: ``"builtin"``), any other path absolute when it exists (a sampler process
    or a Ray worker may run in another folder), else as written (the engine says it is missing). An unknown
    ``"builtin:<name>"`` is a ValueError listing the known ones."""
    if is_builtin(path):
        return BUILTIN if path is None else str(path)
    builtin_path(path)  # refuses an unknown built-in spelling
    return str(Path(path).resolve()) if Path(path).exists() else str(path)


def builtin_path(path: str | Path | None) -> Path | str | None:
    """The directory of a built-in spelling ("builtin", "builtin:chain", None = "builtin"); any
    other path is returned unchanged. An unknown "builtin:<name>" is a ValueError listing the known ones."""
    if path is None:
        return BUILTIN_DIR
    text = str(path)
    if text in BUILTIN_MODELS:
        return BUILTIN_MODELS[text].directory
    if text.startswith(f"{BUILTIN}:"):
        raise ValueError(f"unknown built-in model {text!r}; use one of {sorted(BUILTIN_MODELS)}")
    return path


PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
# printable ASCII without \r \x0b \x0c: digits first, so token id of digit d is len(SPECIAL_TOKENS) + d
CHARACTERS = [c for c in string.digits + string.ascii_letters + string.punctuation + " \n\t"]

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast``: one token per character, specials pad/bos/eos/unk.

    Built with the ``tokenizers`` library as a BPE model with no merges (every character is its own token,
    unknown characters map to ``<unk>``) and a ``Fuse`` decoder (tokens join without spaces). No special
    token is added automatically when encoding.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.add_special_tokens(SPECIAL_TOKENS)
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


def builtin_config(vocab_size: int, model_type: str = "qwen2", **overrides):
    """The architecture of a built-in model: Qwen2 with ~1 M parameters by default; ``model_type`` and
    ``overrides`` (a ``BuiltinModel.architecture``) change the family and sizes (e.g. ``MOE_ARCHITECTURE``)."""
    from transformers import AutoConfig

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
    )
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` or one of "fp32" / "bf16" / "fp16" (and the long names) → a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of float32, bfloat16, float16")
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}") from None


def load_model(
    path_or_builtin: str | Path = BUILTIN,
    dtype: torch.dtype | str = torch.float32,
    attn: str = "eager",
    gguf_file: str | None = None,
    skeleton: bool = False,
) -> tuple[nn.Module, object]:
    """Load (model, tokenizer) from a local HF directory or a ``BUILTIN_MODELS`` spelling, eval mode.

    ``skeleton``: the model built from its config on the meta device, without reading or holding any weights
    (a data-parallel rank > 0, whose shards come from rank 0: ``distributed.shard``); same parameter names,
    shapes, dtypes and tied weights as the loaded model. Local files only: nothing is downloaded. Raises FileNotFoundError for a missing path and ValueError
    when the tokenizer's vocabulary does not fit the model's embedding matrix, or for an unknown dtype /
    attention implementation.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    if attn not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {attn!r}; use one of {ATTN_IMPLEMENTATIONS}")
    path = Path(builtin_path(path_or_builtin))
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a directory (expected a Hugging Face model dir)")
    if gguf_file is None and not (path / "config.json").exists():
        raise FileNotFoundError(f"{str(path)!r} has no config.json: not a Hugging Face model directory")
    # never a model's own code (config.json's auto_map): transformers would otherwise ask on the terminal
    extra = {"trust_remote_code": False, **({} if gguf_file is None else {"gguf_file": gguf_file})}
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **extra)
    if skeleton:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, local_files_only=True, **extra)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attn)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch_dtype, attn_implementation=attn, **extra
        )
    model.eval()
    check_tokenizer_matches(model, tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def check_tokenizer_matches(model: nn.Module, tokenizer) -> None:
    """Raise ValueError if some token id of ``tokenizer`` is outside the model's embedding matrix."""
    n_embed = model.get_input_embeddings().weight.shape[0]
    n_tokens = len(tokenizer)
    if n_tokens > n_embed:
        raise ValueError(
            f"tokenizer has {n_tokens} tokens but the model's embedding has only {n_embed} rows: "
            "the tokenizer does not belong to this model"
        )
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token: generation could never stop")


def load_builtin(
    dtype: torch.dtype | str = torch.float32, attn: str = "eager", name: str = BUILTIN
) -> tuple[nn.Module, object]:
    """(model, tokenizer) of a shipped built-in checkpoint (``name``: a ``BUILTIN_MODELS`` spelling)."""
    directory = builtin_path(name)
    if not is_builtin(name):
        raise ValueError(f"unknown built-in model {name!r}; use one of {sorted(BUILTIN_MODELS)}")
    if not (directory / "model.safetensors").exists():
        raise FileNotFoundError(
            f"built-in checkpoint missing in {directory}; run scripts/pretrain_builtin.py to create it"
        )
    return load_model(name, dtype=dtype, attn=attn)
