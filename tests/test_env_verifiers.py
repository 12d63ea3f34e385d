"""verifiers environments through rollcorr.envs.verifiers (docs/multi-turn.md, "Environments you already have:
verifiers"): the docs' environment played turn by turn against the library's own run_rollout, a SingleTurnEnv
with the library's XMLParser, the refusals, and the docs' command training the built-in model for 2 steps."""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from pathlib import Path

import pytest

vf = pytest.importorskip("verifiers", reason="needs verifiers 0.3.x (ROLLCORR_OPTIONAL=verifiers bash scripts/setup.sh)")
if not hasattr(vf, "MultiTurnEnv"):
    pytest.skip("needs verifiers 0.3.x (0.4 has no MultiTurnEnv)", allow_module_level=True)

from verifiers.legacy.clients.client import Client  # noqa: E402
from verifiers.legacy.types import Response, ResponseMessage  # noqa: E402

from rollcorr.engines import SamplingParams, make_sampler  # noqa: E402
from rollcorr.envs import Limits, Renderer, Turn, make_env, play  # noqa: E402
from rollcorr.envs.verifiers import plain  # noqa: E402
from rollcorr.tasks import make_task  # noqa: E402
from rollcorr.user_code import UserCodeError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs/multi-turn.md"
ROWS = [(3, 4), (12, 34), (5, 5), (20, 7), (8, 1)]
RETRY = {"name": "verifiers", "load": "retry_env:load_environment", "args": {"max_turns": 3}}


@pytest.fixture(scope="module", autouse=True)
def retry_env(tmp_path_factory):
    """The docs' retry_env.py, written to a folder on sys.path and imported (as `plugins: [retry_env]` does)."""
    folder = tmp_path_factory.mktemp("plugin")
    code = re.search(r"```python\n(# retry_env\.py.*?)```", DOC.read_text(), re.S).group(1)
    (folder / "retry_env.py").write_text(code)
    sys.path.insert(0, str(folder))
    import retry_env

    yield retry_env
    sys.path.remove(str(folder))
    sys.modules.pop("retry_env", None)


def rows_file(folder: Path) -> Path:
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b),
                                        "split": "test" if i == len(ROWS) - 1 else "train"}) + "\n"
                            for i, (a, b) in enumerate(ROWS)))
    return path


class Scripted(Client):
    """A verifiers client of the test's own that answers each request with the next scripted text."""

    def __init__(self, texts: list[str]) -> None:
        super().__init__(None)
        self.texts, self.requests = list(texts), []

    def setup_client(self, config):
        raise NotImplementedError

    async def to_native_tool(self, tool):
        return tool

    async def to_native_prompt(self, messages):
        return messages, {}

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        self.requests.append([plain(m) for m in prompt])
        return self.texts.pop(0)

    async def raise_from_native_response(self, response):
        return None

    async def from_native_response(self, response):
        message = ResponseMessage(content=response, finish_reason="stop", is_truncated=False)
        return Response(id="t", created=int(time.time()), model="m", message=message)

    async def close(self):
        return None


def library_rollout(env, row: dict, texts: list[str]):
    """verifiers' own run_rollout of ``row`` with a scripted model: (its output, the requests it made)."""
    import asyncio

    client = Scripted(texts)
    output = asyncio.run(env.env.run_rollout(env.row_input(row), client, "m", {}))
    return output, client.requests


@pytest.mark.parametrize("texts", [["5", "7"], ["1", "2", "3"], ["7"]], ids=["right second", "never", "right first"])
def test_an_episode_is_the_librarys_rollout_turn_by_turn(tmp_path, texts):
    env = make_env(make_task(str(rows_file(tmp_path))), RETRY)
    row = next(r for r in env.sample(4, seed=0) if r["answer"] == "7")
    output, requests = library_rollout(env, row, texts)
    episode = env.reset(row)
    assert episode.prompt == requests[0] == [{"role": "user", "content": "3+4="}]
    turns = [episode.step(text) for text in texts[: len(requests)]]
    # each observation is what the library appended before its next request; the last turn ends with its reward
    for k, turn in enumerate(turns[:-1]):
        assert turn == Turn(observation=requests[k + 1][len(requests[k]) + 1:], reward=0.0, done=False)
        assert turn.observation == [{"role": "user", "content": "wrong, again:"}]
    assert turns[-1] == Turn(observation=None, reward=output["reward"], done=True)
    assert output["reward"] == (1.0 if "7" in texts else 0.0) and len(turns) == len(requests)


def test_rows_are_formatted_as_the_library_formats_a_question_row(tmp_path):
    """system_prompt first, few_shot before a text prompt's user message: the environment's own dataset's prompt
    column for the same question."""
    parser = vf.XMLParser(["answer"])
    shots = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "<answer>2</answer>"}]
    env = vf.SingleTurnEnv(dataset=_dataset("3+4=", "7"), system_prompt="Answer in tags.", few_shot=shots,
                           parser=parser, rubric=vf.Rubric(funcs=[_tagged], parser=parser))
    sys.modules["retry_env"].single = lambda: env
    adapter = make_env(make_task(str(rows_file(tmp_path))), {"name": "verifiers", "load": "retry_env:single"})
    library = [dict(m) for m in env.get_dataset()[0]["prompt"]]
    assert adapter.row_input({"prompt": "3+4=", "answer": 7})["prompt"] == library
    assert adapter.row_input({"prompt": "3+4=", "answer": 7})["answer"] == "7"
    # one turn, scored by the rubric through the library's parser
    assert adapter.max_turns == 1
    right, wrong = adapter.reset({"prompt": "3+4=", "answer": "7"}), adapter.reset({"prompt": "3+4=", "answer": "7"})
    assert right.step("<answer>7</answer>") == Turn(observation=None, reward=1.0, done=True)
    assert wrong.step("<answer>8</answer>") == Turn(observation=None, reward=0.0, done=True)


def _dataset(question: str, answer: str):
    from datasets import Dataset

    return Dataset.from_list([{"question": question, "answer": answer}])


def _tagged(completion, answer, parser, **kwargs) -> float:
    return float(parser.parse_answer(completion) == answer)


def test_what_cannot_be_played_is_refused_in_one_line(tmp_path, retry_env):
    task = make_task(str(rows_file(tmp_path)))
    with pytest.raises(ValueError, match=r"^verifiers: module 'not_imported' is not imported; name it in the "
                                         r"config's plugins$"):
        make_env(task, {"name": "verifiers", "load": "not_imported:load_environment"})
    with pytest.raises(ValueError, match=r"^verifiers: load must be 'module:function', got 'retry_env'$"):
        make_env(task, {"name": "verifiers", "load": "retry_env"})
    retry_env.not_an_env = lambda: object()
    with pytest.raises(ValueError, match=r"returned object, not a verifiers MultiTurnEnv"):
        make_env(task, {"name": "verifiers", "load": "retry_env:not_an_env"})

    class Rewrites(retry_env.Retry):  # a get_prompt_messages that does not append: the turn's text rewritten
        async def get_prompt_messages(self, state):
            messages = await super().get_prompt_messages(state)
            return [m if m.role != "assistant" else vf.AssistantMessage(content="edited") for m in messages]

    class Fails(retry_env.Retry):  # a tool's failure: verifiers records it in state["error"] and stops
        async def env_response(self, messages, state, **kwargs):
            raise vf.ToolError("the tool is down")

    for name, cls in (("rewrites", Rewrites), ("fails", Fails)):
        setattr(retry_env, name, lambda cls=cls: cls(dataset=_dataset("q", "1"), rubric=vf.Rubric(funcs=[retry_env.right])))
    episode = make_env(task, {"name": "verifiers", "load": "retry_env:rewrites"}).reset(task.sample(1, 0)[0])
    with pytest.raises(ValueError, match=r"^verifiers:retry_env:rewrites: the environment rewrote the conversation"):
        episode.step("0")
    episode = make_env(task, {"name": "verifiers", "load": "retry_env:fails"}).reset(task.sample(1, 0)[0])
    with pytest.raises(ValueError, match=r"^verifiers:retry_env:fails: the rollout ended with an error: .*tool is down"):
        episode.step("0")


def test_a_failing_environment_names_itself_and_the_row(tmp_path, retry_env):
    class Raises(retry_env.Retry):
        async def env_response(self, messages, state, **kwargs):
            raise RuntimeError("boom")

    retry_env.raises = lambda: Raises(dataset=_dataset("q", "1"), rubric=vf.Rubric(funcs=[retry_env.right]))
    env = make_env(make_task(str(rows_file(tmp_path))), {"name": "verifiers", "load": "retry_env:raises", "text": True})
    sampler = make_sampler("hf:fp32")
    with pytest.raises(UserCodeError, match=r"environment 'verifiers:retry_env:raises' \(step\) on row 0 .* failed: "
                                            r"RuntimeError: boom"):
        play(sampler, env, env.sample(1, seed=0), Renderer(sampler.tokenizer, chat=False),
             SamplingParams(max_new_tokens=4), limits=Limits(timeout=60))


def docs_command() -> list[str]:
    """docs/multi-turn.md's `rollcorr train plugins=[retry_env] …` line, as argv after `rollcorr`."""
    (line,) = re.findall(r"^rollcorr train plugins=\[retry_env\] .*$", DOC.read_text(), re.M)
    return shlex.split(line)[1:]


def test_a_verifiers_environment_trains_two_steps(tmp_path):
    """The docs' `rollcorr train` line on the built-in model (text: true): the docs' retry environment for 2
    steps. Each row's answer is its sum written four times, which no 4-token turn can hold, so the library's
    rubric gives 0 and its max_turns (3) ends every rollout: each trajectory has 3 model turns and the
    environment's 'wrong, again:' between them. What is checked is the path, not learning."""
    from rollcorr.cli import main

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b) * 4,
                                        "split": "test" if i == len(ROWS) - 1 else "train"}) + "\n"
                            for i, (a, b) in enumerate(ROWS)))
    argv = [a.replace("rows.jsonl", str(data)) for a in docs_command()]
    assert argv[0] == "train" and "plugins=[retry_env]" in argv
    argv += ["trainer.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
             "task.eval_prompts=1", "trainer.eval_every=2", "optim.skip_zero_grad=false", "trainer.progress=false",
             "trainer.plot=false", "trainer.tensorboard=false", f"trainer.out={tmp_path / 'run'}"]
    assert main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["loss/policy"] == r["loss/policy"] for r in steps)
    assert all(r["env/turns_mean"] == r["env/turns_max"] == 3 and r["env/cut_share"] == 0 for r in steps)
    assert all(r["env/observation_token_share"] > 0 and r["reward/mean"] == 0 for r in steps)
    samples = [json.loads(line) for line in (tmp_path / "run/samples.jsonl").read_text().splitlines()]
    assert samples and all(s["reward"] == 0.0 for s in samples)
