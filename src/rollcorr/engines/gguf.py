"""rollcorr's own GGUF writer: a Qwen2 / Llama Hugging Face checkpoint → one GGUF file for llama.cpp.

The container is written with the ``gguf`` package's ``GGUFWriter``; the block quantisation is done here,
following ggml's reference formats (``ggml-common.h`` / ``quantize_row_*_ref`` in ``ggml-quants.c``):

    q8_0  block of 32 weights = fp16 scale d + 32 × int8 q;   d = max|x| / 127,  q = round(x / d)
          (34 bytes, 8.5 bits / weight);  x̂ = d · q
    q4_0  block of 32 weights = fp16 scale d + 16 bytes of 4-bit q;  d = m / −8 where m is the weight of
          largest magnitude (sign kept), q = min(15, ⌊x / d + 8.5⌋) ∈ [0, 15];  byte j holds q_j in its
          low nibble and q_{j+16} in its high nibble (18 bytes, 4.5 bits / weight);  x̂ = d · (q − 8)

Weight matrices (2-D, rows a multiple of 32 wide) take the requested type; norms and biases stay f32.
The tokenizer is written as a llama.cpp "gpt2" (byte-level BPE) vocabulary: a byte-level tokenizer is copied
as is, and a character-level one (the built-in model) is mapped character → byte-level string with no
merges, so llama.cpp detokenizes every token to the same text as the HF tokenizer.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

QUANT_TYPES = ("f32", "f16", "q8_0", "q4_0")
BLOCK_SIZE = 32  # weights per q8_0 / q4_0 block
SUPPORTED_ARCHITECTURES = ("qwen2", "llama")
NO_MERGE = "[rollcorr:no-merges]"


# --------------------------------------------------------------------------- block quantisation


def _blocks(x: np.ndarray, name: str) -> np.ndarray:
    """(..., n) → (..., n // 32, 32) float32, checking that rows split into whole blocks."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(f"{name}: row length {x.shape[-1:] or 'scalar'} is not a multiple of {BLOCK_SIZE}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: input contains NaN or inf")
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)


def _pack(d: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Scales (..., nb) and quants (..., nb, k) uint8 → rows of blocks [d fp16 LE | qs] as (..., nb·(2+k))."""
    d_bytes = d.astype("<f2").view(np.uint8).reshape(*d.shape, 2)
    blocks = np.concatenate([d_bytes, qs], axis=-1)
    return blocks.reshape(*blocks.shape[:-2], -1)


def _unpack(data: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``_pack``: (..., nb·(2+k)) uint8 → scales (..., nb) float32 and quants (..., nb, k) uint8."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if data.shape[-1] % (2 + k) != 0:
        raise ValueError(f"byte rows of length {data.shape[-1]} are not whole {2 + k}-byte blocks")
    blocks = data.reshape(*data.shape[:-1], -1, 2 + k)
    d = np.ascontiguousarray(blocks[..., :2]).view("<f2")[..., 0].astype(np.float32)
    return d, blocks[..., 2:]


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C ``roundf``: halves round away from zero (numpy's ``round`` rounds them to even)."""
    return np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """(..., n) float → (..., n/32·34) uint8 q8_0 blocks, as ggml's ``quantize_row_q8_0_ref``."""
    xb = _blocks(x, "q8_0")
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(127)
    inv_d = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = _round_half_away(xb * inv_d[..., None]).astype(np.int8)
    return _pack(d, q.view(np.uint8))


def dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """(..., nb·34) uint8 → (..., nb·32) float32."""
    d, qs = _unpack(data, BLOCK_SIZE)
    x = d[..., None] * qs.view(np.int8).astype(np.float32)
    return x.reshape(*x.shape[:-2], -1)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """(..., n) float → (..., n/32·18) uint8 q4_0 blocks, as ggml's ``quantize_row_q4_0_ref``."""
    xb = _blocks(x, "q4_0")
    idx = np.abs(xb).argmax(axis=-1)[..., None]
    m = np.take_along_axis(xb, idx, axis=-1)[..., 0]  # signed weight of largest magnitude
    d = m / np.float32(-8)
    inv_d = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    # x/d + 8.5 ∈ [0.5, 16.5]: C's (int8_t) truncation is floor here
    q = np.minimum(15, np.floor(xb * inv_d[..., None] + np.float32(8.5))).astype(np.uint8)
    half = BLOCK_SIZE // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    return _pack(d, packed)


def dequantize_q4_0(data: np.ndarray) -> np.ndarray:
    """(..., nb·18) uint8 → (..., nb·32) float32."""
    d, qs = _unpack(data, BLOCK_SIZE // 2)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32) - 8
    x = d[..., None] * q
    return x.reshape(*x.shape[:-2], -1)


def encode_tensor(x: np.ndarray, quant: str) -> tuple[np.ndarray, Any]:
    """Encode one weight for the GGUF file: returns (array, ggml type) for ``GGUFWriter.add_tensor``.

    1-D tensors (norms, biases) are always f32; a matrix whose rows do not split into 32-weight blocks
    falls back from q8_0 / q4_0 to f16 (as llama.cpp's converter does).
    """
    from gguf import GGMLQuantizationType as T

    if quant not in QUANT_TYPES:
        raise ValueError(f"unknown quant type {quant!r}; use one of {QUANT_TYPES}")
    x = np.asarray(x, dtype=np.float32)
    if x.ndim < 2 or quant == "f32":
        return np.ascontiguousarray(x), T.F32
    if quant in ("q8_0", "q4_0") and x.shape[-1] % BLOCK_SIZE != 0:
        quant = "f16"
    if quant == "f16":
        return x.astype(np.float16), T.F16
    if quant == "q8_0":
        return quantize_q8_0(x), T.Q8_0
    return quantize_q4_0(x), T.Q4_0


# --------------------------------------------------------------------------- tensor names


_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def gguf_tensor_name(hf_name: str) -> str | None:
    """HF parameter name → llama.cpp tensor name; None for buffers llama.cpp does not store.

    Raises ValueError for a parameter this writer does not know (so nothing is silently dropped).
    """
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    match = _LAYER_RE.match(hf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"blk.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"cannot map parameter {hf_name!r} to a GGUF tensor (Qwen2 / Llama layout expected)")


def _permute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Llama q/k rows: HF's rotate-half order → llama.cpp's interleaved (GGML_ROPE_TYPE_NORM) order.

    Qwen2 uses the NeoX rope layout in llama.cpp, the same as HF, and needs no permutation.
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------- config and tokenizer


def _config(config: Any) -> Any:
    """A transformers ``PretrainedConfig`` (or its dict) → the config object, checking the architecture."""
    if isinstance(config, Mapping):
        from transformers import AutoConfig

        data = dict(config)
        if "model_type" not in data:
            raise ValueError("config dict has no 'model_type'")
        config = AutoConfig.for_model(data.pop("model_type"), **data)
    arch = getattr(config, "model_type", None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; the GGUF writer handles {SUPPORTED_ARCHITECTURES}"
        )
    return config


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported by the GGUF writer (only 'default')")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _first_id(value: Any) -> int | None:
    if isinstance(value, list | tuple):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (the alphabet of byte-level BPE vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def _has_byte_level(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("type") == "ByteLevel" or any(_has_byte_level(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_byte_level(v) for v in node)
    return False


def _backend_tokenizer(tokenizer: Any):
    """A ``tokenizers.Tokenizer`` from a Tokenizer, a transformers fast tokenizer, or a tokenizer.json path."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, str | os.PathLike):
        path = Path(tokenizer)
        return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"need a tokenizers.Tokenizer, a fast HF tokenizer or a tokenizer.json path, got {type(tokenizer)}"
        )
    return backend


def gguf_vocab(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a llama.cpp "gpt2" vocabulary with exactly ``vocab_size`` entries.

    Ids without a token (embedding rows past the tokenizer) become unused ``[PAD{i}]`` tokens.
    """
    from gguf import TokenType

    backend = _backend_tokenizer(tokenizer)
    spec = json.loads(backend.to_str())
    byte_level = _has_byte_level(spec.get("pre_tokenizer")) or _has_byte_level(spec.get("decoder"))
    byte_map = _bytes_to_unicode()

    def to_byte_level(text: str) -> str:
        return text if byte_level else "".join(byte_map[b] for b in text.encode("utf-8"))

    vocab = backend.get_vocab(with_added_tokens=True)
    if max(vocab.values()) >= vocab_size:
        raise ValueError(
            f"tokenizer has ids up to {max(vocab.values())} but the model's vocab_size is {vocab_size}"
        )
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(TokenType.UNUSED)] * vocab_size
    for text, i in vocab.items():
        if text in added:
            tokens[i] = text
            types[i] = int(TokenType.CONTROL if added[text].get("special") else TokenType.USER_DEFINED)
        else:
            tokens[i] = to_byte_level(text)
            types[i] = int(TokenType.NORMAL)
    merges = []
    for merge in spec.get("model", {}).get("merges", []) or []:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merges.append(f"{to_byte_level(left)} {to_byte_level(right)}")
    return tokens, types, merges


# --------------------------------------------------------------------------- the writer


def write_gguf(
    path: str | os.PathLike,
    state_dict: Mapping[str, torch.Tensor],
    config: Any,
    tokenizer: Any,
    quant: str = "f32",
    *,
    name: str = "rollcorr",
    special_token_ids: Mapping[str, int | None] | None = None,
) -> Path:
    """Write a Qwen2 / Llama checkpoint as one GGUF file, atomically (temp file in the same dir, rename).

    state_dict   HF parameter names → tensors (any float dtype; converted to float32 before encoding)
    config       transformers config of the model (or its dict with ``model_type``)
    tokenizer    tokenizers.Tokenizer, fast HF tokenizer, or path to tokenizer.json / its directory
    quant        "f32" | "f16" | "q8_0" | "q4_0" for the weight matrices
    special_token_ids  optional {"bos": id, "eos": id, "pad": id, "unk": id} overriding the config's
    """
    from gguf import GGUFWriter, LlamaFileType

    if quant not in QUANT_TYPES:
        raise ValueError(f"unknown quant type {quant!r}; use one of {QUANT_TYPES}")
    cfg = _config(config)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = _gguf_tensors(state_dict, cfg)
    special = {
        "bos": _first_id(getattr(cfg, "bos_token_id", None)),
        "eos": _first_id(getattr(cfg, "eos_token_id", None)),
        "pad": _first_id(getattr(cfg, "pad_token_id", None)),
    }
    special.update(special_token_ids or {})
    tokens, token_types, merges = gguf_vocab(tokenizer, cfg.vocab_size)

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        writer = GGUFWriter(tmp, cfg.model_type)
        writer.add_name(name)
        writer.add_file_type(
            {
                "f32": LlamaFileType.ALL_F32,
                "f16": LlamaFileType.MOSTLY_F16,
                "q8_0": LlamaFileType.MOSTLY_Q8_0,
                "q4_0": LlamaFileType.MOSTLY_Q4_0,
            }[quant]
        )
        writer.add_quantization_version(2)  # GGML_QNT_VERSION
        _add_architecture(writer, cfg)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(token_types)
        # llama.cpp refuses a "gpt2" vocabulary without a merges key and GGUF cannot store an empty array:
        # a vocabulary with no merges gets one that can never fire (BPE symbols start as single characters
        # and only merges build longer ones, so this multi-character pair never appears)
        writer.add_token_merges(merges or [f"{NO_MERGE} {NO_MERGE}"])
        for kind, token_id in special.items():
            if token_id is not None:
                getattr(writer, f"add_{kind}_token_id")(int(token_id))
        writer.add_add_bos_token(False)
        writer.add_add_eos_token(False)

        for out_name, w in tensors.items():
            data, ggml_type = encode_tensor(w, quant)
            writer.add_tensor(out_name, data, raw_dtype=ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _heads(cfg: Any) -> tuple[int, int, int]:
    """(attention heads, key-value heads, head dimension) of a config."""
    n_head = cfg.num_attention_heads
    n_head_kv = getattr(cfg, "num_key_value_heads", None) or n_head
    return n_head, n_head_kv, getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head


def _gguf_tensors(state_dict: Mapping[str, torch.Tensor], cfg: Any) -> dict[str, np.ndarray]:
    """The state dict under GGUF's tensor names, as float32 arrays (a Llama's q / k rows permuted to GGUF's rope
    order; a tied output left out); ValueError naming a NaN / inf weight or a tensor a complete model has not."""
    arch, tied = cfg.model_type, bool(getattr(cfg, "tie_word_embeddings", False))
    n_head, n_head_kv, _ = _heads(cfg)
    tensors: dict[str, np.ndarray] = {}
    for hf_name, value in state_dict.items():
        out_name = gguf_tensor_name(hf_name)
        if out_name is None or (out_name == "output.weight" and tied):
            continue
        if not torch.is_tensor(value) or not value.is_floating_point():
            raise TypeError(f"{hf_name}: expected a floating-point tensor, got {type(value).__name__}")
        w = value.detach().to("cpu", torch.float32).numpy()
        if not np.isfinite(w).all():
            raise ValueError(f"{hf_name}: weights contain NaN or inf")
        if arch == "llama" and out_name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _permute_rope(w, n_head)
        elif arch == "llama" and out_name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _permute_rope(w, n_head_kv)
        tensors[out_name] = w
    required = ["token_embd.weight", "output_norm.weight"] + ([] if tied else ["output.weight"])
    required += [
        f"blk.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in _LAYER_NAMES.values() if "bias" not in n
    ]
    missing = [n for n in required if n not in tensors]
    if missing:
        raise ValueError(f"state dict has no tensor for {missing[:3]}: not a complete Qwen2 / Llama model")
    return tensors


def _add_architecture(writer: Any, cfg: Any) -> None:
    """The model's shape into the GGUF header: context, widths, layers, heads, norm epsilon, rope base, vocabulary
    (and the head dimension when it is not hidden / heads, or for a Llama)."""
    n_head, n_head_kv, head_dim = _heads(cfg)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_rope_freq_base(_rope_theta(cfg))
    writer.add_vocab_size(cfg.vocab_size)
    if head_dim * n_head != cfg.hidden_size or cfg.model_type == "llama":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)


# --------------------------------------------------------------------------- the reader: GGUF → HF folder


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``_permute_rope``: llama.cpp's interleaved q/k rows → HF's rotate-half order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensor_names() -> dict[str, str]:
    """llama.cpp tensor name → HF parameter name (``{i}`` stands for the layer index)."""
    names = {v: k for k, v in _GLOBAL_NAMES.items()}
    names.update({f"blk.{{i}}.{v}": f"model.layers.{{i}}.{k}" for k, v in _LAYER_NAMES.items()})
    return names


SPECIAL_TOKEN_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}
# GGUF metadata key (after "<arch>.") → transformers config field, for the architectures above
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}


def _hf_config(reader: Any, name: str) -> Any:
    """A transformers config from a GGUF's metadata (Qwen2 / Llama), ValueError for anything else."""
    from transformers import AutoConfig

    def field(key: str) -> Any:
        f = reader.get_field(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{name}: architecture {arch!r} is not supported; gguf_to_hf reads {SUPPORTED_ARCHITECTURES}")
    values = {hf: field(f"{arch}.{key}") for key, hf in _CONFIG_KEYS.items()}
    values = {k: v for k, v in values.items() if v is not None}
    if values.get("vocab_size") is None:
        values["vocab_size"] = len(field("tokenizer.ggml.tokens") or [])
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if k not in values]
    if missing or not values["vocab_size"]:
        raise ValueError(f"{name}: GGUF metadata lacks {missing or ['a vocabulary']}")
    for kind, key in SPECIAL_TOKEN_KEYS.items():
        token_id = field(f"tokenizer.ggml.{key}")
        if token_id is not None and kind != "unk":
            values[f"{kind}_token_id"] = int(token_id)
    for key in ("rms_norm_eps", "rope_theta"):  # stored as float32: back to the shortest decimal (1e-06)
        if key in values:
            values[key] = float(str(np.float32(values[key])))
    return AutoConfig.for_model(arch, **values)


def _no_merge_tokenizer(reader: Any):
    """The tokenizer of a GGUF whose "gpt2" vocabulary has no merges (rollcorr writes the built-in model's
    character vocabulary so, with the ``NO_MERGE`` placeholder that transformers' GGUF reader refuses):
    byte-level BPE over the same tokens, so every text encodes to the same ids and decodes back the same."""
    from gguf import TokenType
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def field(key: str) -> Any:
        f = reader.get_field(key)
        return None if f is None else f.contents()

    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True) for t, k in zip(tokens, types) if k == TokenType.CONTROL])
    special = {
        f"{kind}_token": tokens[i]
        for kind, key in SPECIAL_TOKEN_KEYS.items()
        if (i := field(f"tokenizer.ggml.{key}")) is not None
    }
    return PreTrainedTokenizerFast(tokenizer_object=core, clean_up_tokenization_spaces=False, **special)


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def mapped_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """The tensors of .safetensors files as views of a copy-on-write memory map: nothing is read until a
    tensor is used, and its pages are the file's (no private float copy). Float dtypes F32 / F16 / BF16."""
    out: dict[str, torch.Tensor] = {}
    for file in files:
        mm = np.memmap(file, dtype=np.uint8, mode="c")
        n = int.from_bytes(bytes(mm[:8]), "little")
        for name, info in json.loads(bytes(mm[8 : 8 + n])).items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"{file.name}: tensor {name!r} has dtype {info['dtype']}, expected a float")
            dtype, (begin, end) = SAFETENSORS_DTYPES[info["dtype"]], info["data_offsets"]
            count = (end - begin) // dtype.itemsize
            out[name] = torch.frombuffer(mm, dtype=dtype, count=count, offset=8 + n + begin).view(info["shape"])
    return out


def _write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], Any]]) -> None:
    """Write float32 tensors as one .safetensors file, producing them one at a time.

    ``tensors`` lists (name, shape, make) with ``make()`` → the (shape) float32 array. The format: an 8-byte
    little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} padded with spaces to 8
    bytes, then the raw little-endian data in header order — so only one tensor is ever in memory.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape, make in tensors:
            w = make()
            if w.shape != tuple(shape) or w.dtype != np.float32:
                raise ValueError(f"{name}: made {w.dtype} {w.shape}, header says float32 {tuple(shape)}")
            f.write(memoryview(w.astype("<f4", copy=False)).cast("B"))


def gguf_to_hf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Save a Qwen2 / Llama GGUF model (any type the ``gguf`` package dequantises: Q4_0, Q4_1, Q8_0, K-quants,
    f16, ...) as a Hugging Face folder — config.json, model.safetensors (float32), the tokenizer — and
    return ``out_dir``. Such a folder is what ``rollcorr train`` / ``audit`` load as ``model.path``.

    Memory: tensors are read from the memory-mapped file, dequantised and written one at a time, so no
    full float32 copy of the weights is ever held. The config comes from the GGUF metadata and the
    tokenizer from transformers' GGUF reader. The inverse of ``write_gguf`` up to the
    quantisation: a file rollcorr wrote as f32 comes back bit for bit.
    """
    from gguf import GGUFReader, dequantize
    from transformers import AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_file)!r} does not exist")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{str(out_dir)!r} exists and is not an empty folder; choose a new one")
    try:
        reader = GGUFReader(gguf_file)
    except (ValueError, OSError) as err:
        raise ValueError(f"{str(gguf_file)!r} is not a readable GGUF file ({err})") from None
    config = _hf_config(reader, gguf_file.name)
    model_type = config.model_type
    n_head = config.num_attention_heads
    n_head_kv = getattr(config, "num_key_value_heads", None) or n_head

    names = _hf_tensor_names()
    entries = []  # (HF name, HF shape, GGUF tensor)
    for tensor in reader.tensors:
        match = re.match(r"^blk\.(\d+)\.(.+)$", tensor.name)
        key = f"blk.{{i}}.{match.group(2)}" if match else tensor.name
        if key not in names:
            raise ValueError(f"{gguf_file.name}: tensor {tensor.name!r} has no Qwen2 / Llama counterpart")
        hf_name = names[key].format(i=match.group(1)) if match else names[key]
        entries.append((hf_name, tuple(int(n) for n in reversed(tensor.shape)), tensor))  # GGUF: innermost first

    def weight(shape: tuple[int, ...], tensor: Any) -> np.ndarray:
        """One tensor dequantised to float32 in HF layout (llama q/k rows back to rotate-half order)."""
        w = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if model_type == "llama" and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _unpermute_rope(w, n_head)
        elif model_type == "llama" and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _unpermute_rope(w, n_head_kv)
        return np.ascontiguousarray(w, dtype=np.float32)

    merges = reader.get_field("tokenizer.ggml.merges")
    if merges is not None and merges.contents() == [f"{NO_MERGE} {NO_MERGE}"]:
        tokenizer = _no_merge_tokenizer(reader)
    else:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, trust_remote_code=False)
    config.tie_word_embeddings = all(name != "lm_head.weight" for name, _, _ in entries)
    config.architectures = [{"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[model_type]]

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _write_safetensors(tmp / "model.safetensors", [(n, s, lambda s=s, t=t: weight(s, t)) for n, s, t in entries])
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for file in (tmp, *tmp.iterdir()):
            os.chmod(file, 0o755 if file.is_dir() else 0o644)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
