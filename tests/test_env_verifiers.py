"""verifiers environments through rollcorr.envs.verifiers (docs/multi-turn.md, "Environments you already have:
verifiers"): the docs' environment played turn by turn against the library's own run_rollout, a SingleTurnEnv
with the library's XMLParser, the refusals, and the docs' command training the built-in model for 2 steps; the
docs' ToolEnv with tool_parser: hermes — its tool run on a parsed call, its tools in the template, 2 steps."""

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


# ---- tool calls: the docs' ToolEnv (tool_env.py) played with tool_parser: hermes ------------------------------

TOOLS = {"name": "verifiers", "load": "tool_env:load_environment", "tool_parser": "hermes"}


@pytest.fixture(scope="module", autouse=True)
def tool_env_module(tmp_path_factory):
    """The docs' tool_env.py (a verifiers ToolEnv with one Python tool, add(a, b)), imported as a plugin is."""
    folder = tmp_path_factory.mktemp("tool_plugin")
    code = re.search(r"```python\n(# tool_env\.py.*?)```", DOC.read_text(), re.S).group(1)
    (folder / "tool_env.py").write_text(code)
    sys.path.insert(0, str(folder))
    import tool_env

    yield tool_env
    sys.path.remove(str(folder))
    sys.modules.pop("tool_env", None)


def _call(a, b) -> str:  # no spaces: the built-in tokenizer's decode drops them
    return f'<tool_call>\n{{"name":"add","arguments":{{"a":{a},"b":{b}}}}}\n</tool_call>'


@pytest.fixture
def task(tmp_path):
    return make_task(str(rows_file(tmp_path)))


def test_a_hermes_call_runs_the_tool_and_its_result_is_the_next_observation(task):
    episode = make_env(task, TOOLS).reset({"prompt": "3+4=", "answer": "7"})
    assert episode.prompt == [{"role": "user", "content": "3+4="}]
    (schema,) = episode.tools  # the environment's tool, as verifiers' OpenAI client sends it
    assert schema["type"] == "function" and schema["function"]["name"] == "add"
    assert schema["function"]["description"] == "Add two integers."
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    turn = episode.step("I add them.\n" + _call(3, 4))
    assert turn == Turn(observation=[{"role": "tool", "content": "7", "tool_call_id": "call_0"}], reward=0.0)
    assert episode.sent[1] == {"role": "assistant", "content": "I add them.\n", "tool_calls": [  # what ToolEnv got
        {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]}
    # two calls in one turn: both run, in order, their ids going on from the episode's count
    turn = episode.step(_call(1, 2) + _call(10, 20))
    assert turn == Turn(observation=[{"role": "tool", "content": "3", "tool_call_id": "call_1"},
                                     {"role": "tool", "content": "30", "tool_call_id": "call_2"}], reward=0.0)
    assert episode.step("7") == Turn(observation=None, reward=1.0, done=True)  # no call: the rollout ends, scored


@pytest.mark.parametrize("text", ['<tool_call>{"name": "add", "arguments": {"a": 3,}}</tool_call>', "7"],
                         ids=["malformed JSON", "no call"])
def test_a_turn_without_a_call_ends_the_rollout(task, text):
    """Malformed JSON inside the tag is no call (the hermes parser's all-or-nothing rule, vLLM's): the library's
    ToolEnv ends the rollout as on any turn without a call, and its rubric scores the text."""
    episode = make_env(task, TOOLS).reset({"prompt": "3+4=", "answer": "7"})
    assert episode.step(text) == Turn(observation=None, reward=float(text == "7"), done=True)


def test_without_a_tool_parser_a_call_is_text_and_no_tools_are_shown(task):
    episode = make_env(task, {k: v for k, v in TOOLS.items() if k != "tool_parser"}).reset(
        {"prompt": "3+4=", "answer": "7"})
    assert episode.tools is None
    assert episode.step(_call(3, 4)) == Turn(observation=None, reward=0.0, done=True)


def test_an_unknown_tool_parser_is_one_line_before_the_environment_loads(task, tool_env_module):
    loaded = []
    tool_env_module.counted = lambda: loaded.append(1) or tool_env_module.load_environment()
    with pytest.raises(ValueError, match=r"^verifiers: tool_parser: unknown tool parser 'qwen9'; registered: \["):
        make_env(task, {**TOOLS, "load": "tool_env:counted", "tool_parser": "qwen9"})
    assert loaded == []


# a Hermes-shaped template on the built-in character-level tokenizer: the tools' names and arguments first
TOOLS_TEMPLATE = ("{% if tools %}<bos>system:{% for t in tools %}{{ t['function']['name'] }}"
                  "({{ t['function']['parameters']['required'] | join(',') }}){% endfor %}<eos>\n{% endif %}"
                  "{% for m in messages %}<bos>{{ m['role'] }}:{{ m['content'] or '' }}<eos>\n{% endfor %}"
                  "{% if add_generation_prompt %}<bos>assistant:{% endif %}")


def _first_turns(drawn: list[list[int]]):
    """A sampler's first batch: one finished row per list of ``drawn`` ids, right-padded, behind a 1-token prompt."""
    import torch

    from rollcorr.rollout import Rollout

    width = max(map(len, drawn))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in drawn])
    mask = torch.tensor([[k < len(r) for k in range(width)] for r in drawn])
    n = len(drawn)
    return Rollout(prompt_ids=torch.ones(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.bool),
                   response_ids=ids, response_mask=mask, rollout_log_prob=torch.zeros(ids.shape),
                   version=torch.zeros(ids.shape, dtype=torch.long), group_ids=torch.zeros(n, dtype=torch.long),
                   meta=[{"finished": True} for _ in drawn])


def test_tools_reach_the_template_and_the_sampled_call_stays_as_drawn(task):
    """Through rollcorr's episode loop (``Episodes``) on the built-in tokenizer with a template that describes
    tools: the prompt names the tool; a turn that calls it keeps its ids as drawn (tags and all, the model's), and
    the tool's result is appended after them as the environment's, rendered by the template alone; and the
    token-in-token-out check's re-tokenised conversation (``rollcorr audit``) describes the same tools."""

    from rollcorr.envs import Episodes
    from rollcorr.models.builtin import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    item = {"prompt": "3+4=", "answer": "7"}
    episodes = Episodes(make_env(task, TOOLS), [item, item], Renderer(tok, chat=True), Limits())
    assert tok.decode(episodes.prompts()[0]) == "<bos>system:add(a,b)<eos>\n<bos>user:3+4=<eos>\n<bos>assistant:"
    drawn = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in (_call(3, 4), "7")]
    rollout = episodes.advance(_first_turns(drawn), version=0)
    assert rollout.response_ids[0][rollout.response_mask[0]].tolist() == drawn[0]  # the call, as drawn
    observed = rollout.response_ids[0][rollout.observation_mask[0]].tolist()
    assert tok.decode(observed) == "\n<bos>tool:7<eos>\n<bos>assistant:"
    assert episodes.over == [False, True] and episodes.rewards == [[0.0], [1.0]]
    sampled = episodes.prompts()[0] + rollout.response_ids[0][rollout.token_mask[0]].tolist()
    conversation = episodes.messages(rollout, 0)
    assert conversation.tools == episodes.episodes[0].tools and conversation.tools
    again = Renderer(tok, chat=True).conversation_ids(conversation, conversation.tools)
    assert sampled[: len(again)] == again and tok.decode(sampled[len(again):]) == "<bos>assistant:"
    assert Renderer(tok, chat=True).conversation_ids(conversation)[: len(again)] != again  # the tools matter


def test_a_tool_environment_trains_two_steps(tmp_path):
    """The docs' `rollcorr train plugins=[tool_env] …` line, MODEL being the built-in model given a template that
    describes tools (TOOLS_TEMPLATE): 2 steps through the chat path with the tool in every prompt. The built-in
    model writes digits and never a call, so the ToolEnv ends every rollout after its first turn, scored by the
    docs' rubric (the row's sum written as is, which the model can write): what is checked is the path."""
    import shutil

    from rollcorr.cli import main
    from rollcorr.models.builtin import BUILTIN_MODELS

    model = tmp_path / "tool-model"
    shutil.copytree(BUILTIN_MODELS["builtin"].directory, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    (line,) = re.findall(r"^rollcorr train plugins=\[tool_env\] .*$", DOC.read_text(), re.M)
    argv = [a.replace("rows.jsonl", str(rows_file(tmp_path))).replace("MODEL", str(model))
            for a in shlex.split(line)[1:]]
    assert argv[0] == "train" and "plugins=[tool_env]" in argv and f"model.path={model}" in argv
    argv += ["trainer.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
             "task.eval_prompts=1", "trainer.eval_every=2", "optim.skip_zero_grad=false", "trainer.progress=false",
             "trainer.plot=false", "trainer.tensorboard=false", f"trainer.out={tmp_path / 'run'}"]
    assert main(argv) == 0
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["loss/policy"] == r["loss/policy"] for r in steps)
    assert all(r["env/turns_mean"] == r["env/turns_max"] == 1 and r["env/cut_share"] == 0 for r in steps)
    assert all(r["env/observation_token_share"] == 0 for r in steps)


# ---- the hermes path on the chat templates Qwen ships -----------------------------------------------------------


def _qwen_tokenizer(template: str):
    """A byte-level BPE tokenizer (Qwen's kind, without merges) with ChatML's tokens as Qwen's tokenizers have them:
    ``<|im_start|>`` / ``<|im_end|>`` special (EOS ``<|im_end|>``), the tool and think tags added but not special;
    its chat template ``template`` (``trl/chat_templates/<name>.jinja``: the models' own, which TRL compares byte for
    byte against the Hub's)."""
    import importlib.util

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spec = importlib.util.find_spec("trl")
    if spec is None:
        pytest.skip("TRL is not installed (ROLLCORR_OPTIONAL=trl): its package holds the Qwen chat templates")
    byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                      merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    byte_level.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=byte_level)
    tok.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"])
    tok.chat_template = (Path(spec.submodule_search_locations[0]) / "chat_templates" / f"{template}.jinja").read_text()
    return tok


@pytest.mark.parametrize("template", ["qwen2_5", "qwen3"])
def test_the_hermes_path_on_the_chat_templates_qwen_ships(task, template):
    """With Qwen2.5's and Qwen3's own chat templates: the prompt describes the tool as the template does; a call
    written as the template writes one (an assistant message with ``tool_calls``) is read back by the ``hermes``
    parser as that call; through the episode loop its ids stay as drawn, tags and all (decoded without special
    tokens, the tags are kept: added, not special), and the tool's result is appended as the template renders a
    tool message — a ``<tool_response>`` in a user turn, after the ``\\n`` that follows ``<|im_end|>``."""

    from rollcorr.audit.tito import align
    from rollcorr.envs import Episodes
    from rollcorr.envs.tool_calls import parse_tool_calls

    tok = _qwen_tokenizer(template)
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}
    messages = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    written = tok.apply_chat_template(messages, tokenize=False)
    turn = written.split("<|im_start|>assistant\n")[-1].split("<|im_end|>")[0]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>' in turn
    parsed = parse_tool_calls(turn, "hermes")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        ("add", {"a": 3, "b": 4})]
    item = {"prompt": "3+4=", "answer": "7"}
    episodes = Episodes(make_env(task, TOOLS), [item, item], Renderer(tok, chat=True), Limits())
    prompt = tok.decode(episodes.prompts()[0])
    assert "<tools>\n" in prompt and '"name": "add"' in prompt and '"required": ["a", "b"]' in prompt
    assert prompt.endswith("<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n")
    drawn = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in (turn, "7")]
    assert tok.decode(drawn[0][:-1], skip_special_tokens=True) == turn  # the tags survive the environment's decode
    rollout = episodes.advance(_first_turns(drawn), version=0)
    assert rollout.response_ids[0][rollout.response_mask[0]].tolist() == drawn[0]  # the call, as drawn
    observed = tok.decode(rollout.response_ids[0][rollout.observation_mask[0]].tolist())
    assert observed == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert episodes.over == [False, True] and episodes.rewards == [[0.0], [1.0]]
    # a pipeline that templates the conversation again: Qwen2.5's gives back the sampled ids; Qwen3's renders the
    # first turn without the empty think block it wrote there as the last turn (6 sampled tokens lack a counterpart)
    sampled = episodes.prompts()[0] + rollout.response_ids[0][rollout.token_mask[0]].tolist()
    opening = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]  # the next turn's, appended
    assert sampled[-len(opening) :] == opening
    conversation = episodes.messages(rollout, 0)
    again = Renderer(tok, chat=True).conversation_ids(conversation, conversation.tools)
    drift = align(sampled[: -len(opening)], again)
    think = tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert (drift["sampled"], drift["retokenized"], drift["trailing"]) == (
        (0, 0, 0) if template == "qwen2_5" else (len(think), 0, 0))
    if template == "qwen3":
        assert len(think) == 6 and sampled[drift["first"] : drift["first"] + 6] == think
