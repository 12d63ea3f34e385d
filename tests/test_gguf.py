"""rollcorr's GGUF writer: block quantisation against ggml's formats, and files read back with gguf.GGUFReader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf", reason="the gguf package (GGUF container writer) is not installed")

from rollcorr.engines.gguf import (  # noqa: E402
    QUANT_TYPES,
    dequantize_q4_0,
    dequantize_q8_0,
    encode_tensor,
    gguf_tensor_name,
    quantize_q4_0,
    quantize_q8_0,
    write_gguf,
)
from rollcorr.models.builtin import build_tokenizer, builtin_config  # noqa: E402

T = gguf.GGMLQuantizationType


def rows(seed: int, shape=(16, 128)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = rng.uniform(1e-3, 5.0, size=(shape[0], 1))
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize(
    "quantize,dequantize,ggml_type",
    [(quantize_q8_0, dequantize_q8_0, T.Q8_0), (quantize_q4_0, dequantize_q4_0, T.Q4_0)],
)
def test_quantisation_matches_ggml_reference_bytes(quantize, dequantize, ggml_type):
    x = rows(0)
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    x[1, 5] = -40.0  # a block dominated by a negative weight (q4_0 keeps the sign of the extreme)
    ours = quantize(x)
    block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    assert ours.dtype == np.uint8 and ours.shape == (16, 128 // block * type_size)
    # the gguf package ships a numpy port of ggml's quantize_row_*_ref: same bytes
    np.testing.assert_array_equal(ours, gguf.quants.quantize(x, ggml_type))
    np.testing.assert_array_equal(dequantize(ours), gguf.quants.dequantize(ours, ggml_type))


@settings(deadline=None, max_examples=25)
@given(seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-6, 4))
def test_quantisation_error_bounds(seed, log_scale):
    x = rows(seed, (4, 64)) * np.float32(10.0**log_scale)
    blocks = x.reshape(4, 2, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    # the fp16 scale d16 has relative error ≤ 2⁻¹¹, or absolute ≤ 2⁻²⁵ when subnormal (d < 2⁻¹⁴)
    # q8_0: |x − x̂| ≤ d/2 from rounding + 127·|d − d16|, d = amax/127
    err8 = np.abs(dequantize_q8_0(quantize_q8_0(x)).reshape(blocks.shape) - blocks)
    assert (err8 <= amax / 127 * (0.5 + 127 * 2**-11) + 127 * 2**-25).all()
    # q4_0: step d = amax/8; rounding gives d/2, but the +8 end is clamped to 7 so the error reaches d
    err4 = np.abs(dequantize_q4_0(quantize_q4_0(x)).reshape(blocks.shape) - blocks)
    assert (err4 <= amax / 8 * (1 + 8 * 2**-11) + 8 * 2**-25).all()
    if amax.min() > 0.01:  # scales in fp16's normal range: 4 bits lose more than 8
        assert err4.mean() > err8.mean()


def test_quantisation_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(np.ones((2, 40), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        quantize_q4_0(np.full((1, 32), np.nan, np.float32))
    with pytest.raises(ValueError, match="unknown quant type"):
        encode_tensor(np.ones((2, 32)), "q5_k")
    # rows that are not whole blocks fall back to f16, 1-D tensors stay f32
    assert encode_tensor(np.ones((2, 40)), "q4_0")[1] == T.F16
    assert encode_tensor(np.ones(64), "q8_0")[1] == T.F32


def test_tensor_names():
    assert gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_tensor_name("model.layers.3.self_attn.k_proj.bias") == "blk.3.attn_k.bias"
    assert gguf_tensor_name("model.layers.0.mlp.down_proj.weight") == "blk.0.ffn_down.weight"
    assert gguf_tensor_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    with pytest.raises(ValueError, match="cannot map"):
        gguf_tensor_name("model.layers.0.mlp.experts.0.weight")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    from transformers import Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = builtin_config(len(tokenizer), num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    model = Qwen2ForCausalLM(config).eval()
    return model, config, tokenizer


def field(reader, key):
    return reader.get_field(key).contents()


@pytest.mark.parametrize("quant", QUANT_TYPES)
def test_written_file_reads_back(tiny, tmp_path, quant):
    model, config, tokenizer = tiny
    path = write_gguf(tmp_path / f"m-{quant}.gguf", model.state_dict(), config, tokenizer, quant)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
    reader = gguf.GGUFReader(path)

    assert field(reader, "general.architecture") == "qwen2"
    assert field(reader, "qwen2.block_count") == 2
    assert field(reader, "qwen2.embedding_length") == 64
    assert field(reader, "qwen2.attention.head_count_kv") == config.num_key_value_heads
    assert field(reader, "qwen2.rope.freq_base") == pytest.approx(10000.0)
    assert field(reader, "tokenizer.ggml.model") == "gpt2"
    assert field(reader, "tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == config.vocab_size
    # character tokens in GPT-2 byte-level form: space → "Ġ", newline → "Ċ"; specials verbatim
    vocab = tokenizer.get_vocab()
    assert tokens[vocab["7"]] == "7" and tokens[vocab[" "]] == "Ġ" and tokens[vocab["\n"]] == "Ċ"
    assert tokens[tokenizer.eos_token_id] == "<eos>"

    state = model.state_dict()
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors  # tied embeddings: llama.cpp reuses token_embd
    assert len(tensors) == 2 + 12 * 2 - 0  # embd + output_norm + 12 per layer (2 norms, q/k/v w+b, o, 3 mlp)
    expected_type = {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}[quant]
    tol = {"f32": 0.0, "f16": 1e-3, "q8_0": 0.01, "q4_0": 0.2}[quant]  # relative to the row's max |w|
    for hf_name, ours in [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.layers.1.self_attn.k_proj.weight", "blk.1.attn_k.weight"),
        ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
    ]:
        t = tensors[ours]
        assert t.tensor_type == expected_type
        w = state[hf_name].numpy()
        back = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
        row_max = np.abs(w).max(-1, keepdims=True)
        assert (np.abs(back - w) <= tol * row_max + 1e-7).all(), ours
    norm = tensors["blk.0.attn_norm.weight"]
    assert norm.tensor_type == T.F32
    np.testing.assert_array_equal(norm.data, state["model.layers.0.input_layernorm.weight"].numpy())


def test_write_is_atomic_and_checks_input(tiny, tmp_path):
    model, config, tokenizer = tiny
    path = tmp_path / "m.gguf"
    path.write_bytes(b"old")
    bad = dict(model.state_dict())
    bad["model.layers.0.mlp.up_proj.weight"] = torch.full_like(
        bad["model.layers.0.mlp.up_proj.weight"], float("nan")
    )
    with pytest.raises(ValueError, match="NaN"):
        write_gguf(path, bad, config, tokenizer, "q8_0")
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
    with pytest.raises(ValueError, match="unknown quant"):
        write_gguf(path, model.state_dict(), config, tokenizer, "int3")
    missing = {k: v for k, v in model.state_dict().items() if "embed_tokens" not in k}
    with pytest.raises(ValueError, match="token_embd"):
        write_gguf(path, missing, config, tokenizer)
    no_layer = {k: v for k, v in model.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="blk.1.ffn_up"):
        write_gguf(path, no_layer, config, tokenizer)
    with pytest.raises(ValueError, match="architecture"):
        write_gguf(path, model.state_dict(), {"model_type": "gpt2"}, tokenizer)


def test_llama_rope_permutation(tmp_path):
    """Llama q/k rows are reordered from HF's rotate-half layout to llama.cpp's interleaved one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    path = write_gguf(tmp_path / "llama.gguf", model.state_dict(), config, tokenizer, "f32")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    q_file = tensors["blk.0.attn_q.weight"].data.reshape(q.shape)
    head_dim = 16
    # within head h, file row 2i is HF row i and file row 2i+1 is HF row i + head_dim/2
    for h in range(4):
        for i in range(head_dim // 2):
            np.testing.assert_array_equal(q_file[h * head_dim + 2 * i], q[h * head_dim + i])
            np.testing.assert_array_equal(
                q_file[h * head_dim + 2 * i + 1], q[h * head_dim + i + head_dim // 2]
            )
    assert field(reader, "llama.rope.dimension_count") == head_dim
    v = model.state_dict()["model.layers.0.self_attn.v_proj.weight"].numpy()
    np.testing.assert_array_equal(tensors["blk.0.attn_v.weight"].data.reshape(v.shape), v)


# ---- the reader: gguf_to_hf / rollcorr gguf-to-hf -------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gguf_to_hf_round_trips_an_f32_file_bit_for_bit(tmp_path, arch):
    """A model rollcorr wrote as f32 comes back as the same HF weights (llama: q/k rows un-permuted)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, LlamaConfig

    from rollcorr.engines.gguf import gguf_to_hf

    tokenizer = build_tokenizer()
    if arch == "qwen2":
        config = builtin_config(len(tokenizer), num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    else:
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    path = write_gguf(tmp_path / "m.gguf", model.state_dict(), config, tokenizer, "f32")
    out = gguf_to_hf(path, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) >= ["config.json", "model.safetensors"]
    back = load_file(str(out / "model.safetensors"))
    expected = {k: v for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    assert sorted(back) == sorted(expected)
    for name, w in expected.items():
        assert torch.equal(back[name], w), name
    again = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)
    text = "279+440= 9\n"
    assert AutoTokenizer.from_pretrained(out)(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_gguf_to_hf_dequantises_a_quantised_file(tiny, tmp_path):
    from safetensors.torch import load_file

    from rollcorr.engines.gguf import gguf_to_hf

    model, config, tokenizer = tiny
    path = write_gguf(tmp_path / "m.gguf", model.state_dict(), config, tokenizer, "q8_0")
    back = load_file(str(gguf_to_hf(path, tmp_path / "hf") / "model.safetensors"))
    w = model.state_dict()["model.layers.0.mlp.up_proj.weight"]
    expected = dequantize_q8_0(quantize_q8_0(w.numpy()))
    np.testing.assert_array_equal(back["model.layers.0.mlp.up_proj.weight"].numpy(), expected)
    assert back["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32


def test_gguf_to_hf_command(tiny, tmp_path, capsys):
    from rollcorr.cli import main

    model, config, tokenizer = tiny
    path = write_gguf(tmp_path / "m.gguf", model.state_dict(), config, tokenizer, "f16")
    assert main(["gguf-to-hf", str(path), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file() and "saved" in capsys.readouterr().out
    # an existing folder is never overwritten; a missing file is one line
    assert main(["gguf-to-hf", str(path), str(tmp_path / "hf")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert main(["gguf-to-hf", str(tmp_path / "nope.gguf"), str(tmp_path / "new")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "new").exists()
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    assert main(["gguf-to-hf", str(tmp_path / "junk.gguf"), str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollcorr gguf-to-hf: error: ") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()
