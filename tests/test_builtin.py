"""The built-in model and its character tokenizer."""

import json

import pytest
import torch

from rollcorr.models.builtin import (
    BUILTIN_DIR,
    CHARACTERS,
    SPECIAL_TOKENS,
    build_tokenizer,
    load_builtin,
    load_model,
    resolve_dtype,
)
from rollcorr.tasks import AdditionTask

needs_checkpoint = pytest.mark.skipif(
    not (BUILTIN_DIR / "model.safetensors").exists(), reason="no built-in checkpoint"
)


def test_tokenizer_is_one_token_per_character():
    tok = build_tokenizer()
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARACTERS)
    text = "123+456=975 Hello, world!\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok("7")["input_ids"] == [len(SPECIAL_TOKENS) + 7]  # digit d has id 4 + d; no specials added
    assert tok("é")["input_ids"] == [tok.unk_token_id]
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text


def test_tokenizer_round_trips_through_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    build_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.padding_side == "left"
    batch = tok(["1+1=", "12+34="], padding=True, add_special_tokens=False)
    assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0][:2] == [0, 0]


def test_resolve_dtype():
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8")
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype(torch.int8)


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="attention"):
        load_model("builtin", attn="flash")


@needs_checkpoint
def test_checkpoint_is_small_qwen2_with_matching_tokenizer():
    size = sum(f.stat().st_size for f in BUILTIN_DIR.iterdir())
    assert size < 20e6
    config = json.loads((BUILTIN_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    model, tok = load_builtin()
    n = sum(p.numel() for p in model.parameters())
    assert 0.5e6 < n < 4e6
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    assert tok.eos_token_id == model.config.eos_token_id
    bf16, _ = load_builtin(dtype="bf16", attn="sdpa")
    assert next(bf16.parameters()).dtype is torch.bfloat16


@needs_checkpoint
def test_checkpoint_is_partly_competent():
    """Greedy accuracy on held-out 3-digit addition sits near the [0.15, 0.40] window RL starts from."""
    model, tok = load_builtin()
    task = AdditionTask(3)
    items = task.sample(200, seed=2024, split="test")
    ids = torch.tensor([tok(i["prompt"], add_special_tokens=False)["input_ids"] for i in items])
    with torch.no_grad():
        for _ in range(5):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    texts = [tok.decode(row[8:], skip_special_tokens=False).split("<eos>")[0] for row in ids.tolist()]
    ended = ["<eos>" in tok.decode(row[8:]) for row in ids.tolist()]
    acc = sum(task.reward(i, t) == 1.0 and e for i, t, e in zip(items, texts, ended)) / len(items)
    assert 0.08 <= acc <= 0.5, acc
    assert sum(ended) / len(ended) > 0.9  # it has learned the format: digits then EOS


@pytest.mark.slow
def test_pretrain_script_writes_a_loadable_deterministic_checkpoint(tmp_path):
    import hashlib
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "pretrain_builtin.py"
    digests = []
    for run in ("a", "b"):
        out = tmp_path / run
        cmd = [sys.executable, str(script), "--out", str(out), "--max-steps", "10", "--eval-every", "5"]
        cmd += ["--eval-size", "20", "--final-eval-size", "20"]
        subprocess.run(cmd, check=False, capture_output=True, timeout=600)
        model, tok = load_model(out)
        assert model.config.vocab_size == len(tok)
        info = json.loads((out / "training_info.json").read_text())
        assert info["steps"] == 10 and 0.0 <= info["final_greedy_score_test"] <= 1.0
        digests.append(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]


def test_model_location_is_the_one_reading_of_a_model_path(tmp_path, monkeypatch):
    """``model.path`` as the engines take it wherever they are built: the built-in spellings as they are (None is
    "builtin"), an existing folder absolute (a sampler process may run elsewhere), a missing one as written."""
    from rollcorr.models.builtin import BUILTIN_MODELS, model_location

    assert model_location(None) == "builtin" and all(model_location(name) == name for name in BUILTIN_MODELS)
    (tmp_path / "my_model").mkdir()
    monkeypatch.chdir(tmp_path)
    assert model_location("my_model") == str(tmp_path / "my_model")
    assert model_location("not_there") == "not_there"
    (tmp_path / "builtin").mkdir()  # a folder named like the built-in model: the spelling still means the model
    assert model_location("builtin") == "builtin"
    with pytest.raises(ValueError, match="unknown built-in model 'builtin:nope'"):
        model_location("builtin:nope")
