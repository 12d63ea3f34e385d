"""Models are checked before work: a folder that would train or audit a wrong model is refused with one line
(exit 2, no run folder left), before anything heavy is loaded (issue: inputs you can trust)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollcorr.cli import main
from rollcorr.engines import backend_of, parse_spec
from rollcorr.engines.preflight import PreflightError, check_spec, preflight

TINY = ["task.name=addition:1", "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "task.eval_prompts=0", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
        "trainer.mini_batches=1", "trainer.steps=1"]


@pytest.fixture
def model(addition_model_dir, tmp_path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(addition_model_dir, folder)
    return folder


def train_refuses(tmp_path, model_path, capsys, *extra) -> str:
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *TINY, f"model.path={model_path}", *extra]) == 2
    assert not out.exists()  # no run folder left behind
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


def edit_weights(folder: Path, change) -> None:
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def edit_config(folder: Path, **values) -> None:
    data = json.loads((folder / "config.json").read_text())
    data.update(values)
    (folder / "config.json").write_text(json.dumps(data))


def test_the_fixture_model_passes(model):
    preflight("hf:fp32", model, role="learner")


def test_missing_tensor_is_refused(model, tmp_path, capsys):
    edit_weights(model, lambda w: w.pop("model.layers.1.mlp.down_proj.weight"))
    assert "miss 1 tensor(s)" in train_refuses(tmp_path, model, capsys)  # trained a random layer, exit 0


def test_extra_tensor_is_refused(model):
    edit_weights(model, lambda w: w.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(PreflightError, match="hold 1 tensor"):
        preflight("hf:fp32", model)


def test_shapes_that_disagree_with_config_are_refused(model, tmp_path, capsys):
    data = json.loads((model / "config.json").read_text())
    edit_config(model, intermediate_size=data["intermediate_size"] * 2)
    assert "config.json implies" in train_refuses(tmp_path, model, capsys)


def test_index_naming_a_missing_shard_is_refused(model):
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PreflightError, match="names 1 shard.*00002"):
        preflight("hf:fp32", model)


def test_missing_tokenizer_files_are_refused(model, tmp_path, capsys):
    (model / "tokenizer.json").unlink()
    assert "no tokenizer files" in train_refuses(
        tmp_path, model, capsys
    )  # failed in step 1 and left a folder


def test_tokenizer_larger_than_the_embedding_is_refused(model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(vocab - len(tokenizer) + 5)])
    tokenizer.save_pretrained(model)
    with pytest.raises(PreflightError, match="does not belong to this model"):
        preflight("hf:fp32", model)


def test_auto_map_with_an_unknown_model_type_is_refused(model):
    edit_config(
        model, model_type="mystery_lm", auto_map={"AutoModelForCausalLM": "modeling_mystery.MysteryLM"}
    )
    with pytest.raises(PreflightError, match="'mystery_lm' is not known.*never runs a model's own code"):
        preflight("hf:fp32", model)


def test_llamacpp_specs_and_architectures_are_checked_before_loading(model):
    with pytest.raises(PreflightError, match="q3_k.*writes GGUF weights as f32, f16, q8_0, q4_0"):
        check_spec("llamacpp:q3_k")
    llamacpp = backend_of("llamacpp")  # its model checks, which preflight runs after the folder's own
    with pytest.raises(ValueError, match="serves a GGUF file as shipped"):
        llamacpp.check_model(parse_spec("llamacpp:file"), "llamacpp:file", model, None)
    edit_config(model, model_type="gpt2")
    with pytest.raises(ValueError, match="'gpt2'"):
        llamacpp.check_model(parse_spec("llamacpp:q8_0"), "llamacpp:q8_0", model, None)
    llamacpp.check_model(parse_spec("llamacpp:q8_0"), "llamacpp:q8_0", "builtin", None)


def test_learner_hint_never_suggests_fp16():
    with pytest.raises(PreflightError) as err:
        check_spec("hf:int8", role="learner")
    assert "fp16" not in str(err.value)


def write_task(tmp_path, prompt: str) -> Path:
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps({"prompt": prompt, "answer": "1"}) + "\n" for _ in range(10)))
    return path


def test_characters_the_builtin_tokenizer_cannot_encode_are_refused(model, tmp_path, capsys):
    task = write_task(tmp_path, "héllo wörld ✓ ")  # became "hllowrld" without a word
    err = train_refuses(tmp_path, model, capsys, f"task.name={task}")
    assert "cannot encode" in err and "é" in err


def test_prompts_longer_than_the_model_positions_are_refused(model, tmp_path, capsys):
    positions = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    task = write_task(tmp_path, "1" * positions)  # the hf sampler ran past its positions without a word
    assert f"past the model's {positions} positions" in train_refuses(
        tmp_path, model, capsys, f"task.name={task}"
    )


def test_audit_refuses_long_prompts_and_template_escapes(model, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1" * 200 + "\n")
    assert main(["audit", "--model", str(model), "--prompts", str(prompts), "--num-responses", "2",
                 "--out", str(tmp_path / "a")]) == 2
    assert "positions" in capsys.readouterr().err
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    prompts.write_text("1+1=\n")
    assert main(["audit", "--model", str(model), "--prompts", str(prompts), "--num-responses", "2", "--chat",
                 "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "chat template failed (SecurityError" in err and "Traceback" not in err
    # the trainer applies the same template the same way: the same one-line refusal
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n' * 10)
    assert main(["train", f"model.path={model}", f"task.name={data}", "trainer.steps=1", "trainer.progress=false",
                 f"trainer.out={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "chat template failed (SecurityError" in err and "Traceback" not in err


def test_gguf_cut_short_is_one_line(tmp_path, capsys):
    pytest.importorskip("gguf")
    from transformers import Qwen2ForCausalLM

    from rollcorr.engines.gguf import write_gguf
    from rollcorr.models.builtin import build_tokenizer, builtin_config

    tokenizer = build_tokenizer()
    config = builtin_config(len(tokenizer), num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    path = write_gguf(tmp_path / "m.gguf", Qwen2ForCausalLM(config).state_dict(), config, tokenizer, "f32")
    path.write_bytes(path.read_bytes()[:200])
    assert main(["gguf-to-hf", str(path), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "not a readable GGUF file (truncated or corrupt" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
