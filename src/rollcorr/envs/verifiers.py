"""``verifiers``: an environment of the verifiers library (PyPI ``verifiers`` 0.3.x, prime-rl's environments: a
``MultiTurnEnv``, ``SingleTurnEnv`` or a subclass of theirs) played as a rollcorr environment.

    plugins: [my_env]                                       # the module that builds it, imported as a plugin
    task.env: {name: verifiers, load: "my_env:load_environment", args: {...}, tool_parser: hermes}

``load`` names a function of a module the run already imported (``plugins:``; never imported here) that returns
the environment — a verifiers environment package's ``load_environment`` — called with ``args``.

A verifiers environment plays a rollout itself — ``env.run_rollout(input, client, model, sampling_args)``: its
own loop (``setup_state``; until a stop condition fires: the prompt messages → the client → the model's
message, then ``env_response``), then its rubric's ``score_rollout`` — and asks a *client* for each model turn.
The adapter is that client: a request hands its messages to rollcorr and waits for the turn rollcorr's sampler
draws, so the library's loop, stop conditions and rubric run as they are, one rollout per trajectory:

    reset(item)     run_rollout on the row, up to its first request: the episode's prompt (those messages)
    step(text)      the model's message answers the request; run on to the next request — Turn(observation =
                    the messages env_response added, reward 0) — or to the end: Turn(None, the rubric's reward,
                    done); a rollout that ends with an error (verifiers' ``state["error"]``) is one that failed

Rows: the task's (``task.name``), as verifiers formats a question row — the prompt as messages (a text prompt is
one user message, after the environment's ``few_shot``), the environment's ``system_prompt`` first unless the
row starts with one; ``answer`` as text; ``info`` the row's, else {}. Rewards: ``reward_range: [low, high]``
maps the rubric's reward onto [0, 1] (as for ``skyrl``); rollcorr checks it is in [0, 1].

Tokens: the model's turn goes back as the text of the tokens it sampled; the trajectory keeps those tokens and
appends each observation rendered on its own (``envs.render``). An environment that rewrites the conversation
(``get_prompt_messages`` not appending to it) cannot be played token in, token out: refused in one line. A
rollout that a rollcorr limit cuts is dropped where it stands (its cleanup handlers do not run). ``text: true``
hands a model without a chat template the messages' contents as text.

Tool calls (a ``ToolEnv``): ``tool_parser`` names a parser of ``envs.tool_calls`` (``hermes``: Qwen2.5's and
Qwen3's ``<tool_call>`` JSON, read as vLLM's ``hermes`` parser reads it). Each model turn is then handed back as
the parser's content and ``tool_calls`` (ids ``call_0``, ``call_1``, … over the episode), so ``env_response``
runs the tools and its ``tool`` messages (with their ``tool_call_id``) are the next observation; the first
request's tools (the environment's ``tool_defs``, in the OpenAI chat format its OpenAI client sends) are the
episode's ``tools``, which the chat template describes in the prompt (not with ``text: true``). Parsing decides
only what the environment sees: the trajectory keeps the sampled tokens. Without ``tool_parser`` the turn is its
text, no tools are described, and a ``ToolEnv`` sees a turn without a call and ends. An unknown parser is refused
in one line before the environment loads.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rollcorr.envs.base import Turn, register_env, reward_scale
from rollcorr.envs.tool_calls import ToolParser, parse_tool_calls, tool_parser
from rollcorr.tasks.base import Task, excerpt
from rollcorr.tasks.chat import Prompt, messages_of

MAX_TURNS = 16  # model turns an episode may take when the environment sets no max_turns (task.env.max_turns: fewer)
MODEL = "rollcorr"  # the model name the environment's state records


def _verifiers():
    try:
        import verifiers
        from verifiers.legacy import Environment, MultiTurnEnv  # noqa: F401  (0.3.x: the classic stack)
    except ImportError:
        raise ValueError("environment 'verifiers' needs the verifiers package (0.3.x): ROLLCORR_OPTIONAL=verifiers "
                         "bash scripts/setup.sh") from None
    return verifiers


def named_parser(name: Any) -> ToolParser:
    """``tool_parser``'s function (``envs.tool_calls``); ValueError naming an unknown one."""
    try:
        return tool_parser(name)
    except ValueError as err:
        raise ValueError(f"verifiers: tool_parser: {err}") from None


def loaded_function(load: Any) -> Any:
    """``"module:function"`` of a module already imported (``plugins:``) → the function; ValueError otherwise."""
    module_name, sep, fn_name = load.partition(":") if isinstance(load, str) else ("", "", "")
    if not sep or not module_name or not fn_name:
        raise ValueError(f"verifiers: load must be 'module:function', got {load!r}")
    if module_name not in sys.modules:
        raise ValueError(f"verifiers: module {module_name!r} is not imported; name it in the config's plugins")
    fn = getattr(sys.modules[module_name], fn_name, None)
    if not callable(fn):
        raise ValueError(f"verifiers: module {module_name!r} has no function {fn_name!r}")
    return fn


class VerifiersEnv:
    """A verifiers environment (``load(**args)``) over the task's rows, one library rollout per episode."""

    def __init__(self, task: Task, load: str, args: Mapping[str, Any] | None = None,
                 reward_range: Sequence[float] | None = None, text: bool = False,
                 tool_parser: str | None = None) -> None:
        self.tool_parser = None if tool_parser is None else named_parser(tool_parser)  # before the library loads
        vf = _verifiers()
        if args is not None and not isinstance(args, Mapping):
            raise ValueError(f"verifiers: args must be a mapping, got {args!r}")
        env = loaded_function(load)(**dict(args or {}))
        if not isinstance(env, vf.legacy.MultiTurnEnv):
            raise ValueError(f"verifiers: {load} returned {type(env).__name__}, not a verifiers MultiTurnEnv "
                             "(SingleTurnEnv, ToolEnv, ... are ones)")
        self.task, self.env, self.text = task, env, bool(text)
        self.scale = reward_scale(reward_range, "verifiers")
        self.name = f"verifiers:{load}"
        self.max_turns = env.max_turns if env.max_turns > 0 else MAX_TURNS
        self.needs_chat = not self.text  # verifiers talks in messages, unless handed over as text
        self.client_class = _client_class()

    def sample(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        return self.task.sample(n, seed, split)

    def held_out(self, n: int, seed: int) -> list[dict[str, Any]]:
        return self.task.held_out(n, seed)

    def reset(self, item: dict[str, Any]) -> VerifiersEpisode:
        return VerifiersEpisode(self, self.row_input(item))

    def row_input(self, item: dict[str, Any]) -> dict[str, Any]:
        """The row as verifiers' ``RolloutInput`` (the module docstring's rule)."""
        messages = messages_of(item["prompt"])
        if isinstance(item["prompt"], str) and self.env.few_shot:
            messages = [*self.env.few_shot, *messages]
        if self.env.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages = [{"role": "system", "content": self.env.system_prompt}, *messages]
        return {"prompt": messages, "answer": str(item.get("answer", "")), "info": item.get("info") or {},
                "example_id": int(item.get("example_id", 0))}

    def as_prompt(self, messages: list[dict[str, str]]) -> Prompt:
        """Messages as the run's model takes them: as they are, or (``text``) their contents as text."""
        return "\n".join(m["content"] or "" for m in messages) if self.text else messages

    def answer(self, response_text: str, first_id: int) -> dict[str, Any]:
        """The model's turn as the assistant message handed back: its text, or (``tool_parser``) the parser's
        content and ``tool_calls`` (ids from ``call_<first_id>``)."""
        if self.tool_parser is None:
            return {"role": "assistant", "content": response_text}
        content, calls = parse_tool_calls(response_text, self.tool_parser, first_id)
        if not calls:  # a message without a call has text content, empty if need be
            return {"role": "assistant", "content": content or ""}
        return {"role": "assistant", "content": content, "tool_calls": calls}


class VerifiersEpisode:
    """One row's verifiers rollout, run on its own event loop a request at a time (``reset``, then ``step``)."""

    def __init__(self, adapter: VerifiersEnv, row: dict[str, Any]) -> None:
        self.adapter, self.loop = adapter, asyncio.new_event_loop()
        self.loop.set_exception_handler(_quiet_when_dropped)
        self.answer: asyncio.Future | None = None  # what the rollout waits on: the model's turn
        self.asked: asyncio.Future | None = None  # set by the next request: its messages
        self.requested_tools: list[dict[str, Any]] | None = None  # the last request's tools (OpenAI format)
        self.calls = 0  # tool calls parsed so far: the next one's id is call_<calls>
        client = adapter.client_class(self)
        self.rollout = self.loop.create_task(adapter.env.run_rollout(row, client, MODEL, {}))
        first = self._run()
        if first is None:
            self._close()
            raise ValueError(f"{adapter.name}: the rollout ended before asking the model for a turn")
        self.sent = first
        self.prompt = adapter.as_prompt(first)
        # the first request's tools, for the chat template: shown only when calls are parsed, and only to a template
        parsed = adapter.tool_parser is not None and not adapter.text
        self.tools = self.requested_tools if parsed else None

    async def ask(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The client's request: post the messages (the first one's tools kept), wait for the model's message."""
        self.requested_tools = tools or None
        self.answer = self.loop.create_future()
        self.asked.set_result(messages)
        return await self.answer

    def _run(self) -> list[dict[str, str]] | None:
        """Run the rollout on to its next request (its messages) or its end (None)."""
        self.asked = self.loop.create_future()
        waiting = asyncio.wait({self.asked, self.rollout}, return_when=asyncio.FIRST_COMPLETED)
        self.loop.run_until_complete(waiting)
        return self.asked.result() if self.asked.done() else None

    def step(self, response_text: str) -> Turn:
        if self.answer is None or self.answer.done():
            raise ValueError(f"{self.adapter.name}: a step after the rollout ended")
        message = self.adapter.answer(response_text, self.calls)
        self.calls += len(message.get("tool_calls", ()))
        self.answer.set_result(message)
        messages = self._run()
        if messages is None:
            return self._end()
        turn = len(self.sent)
        if messages[:turn] != self.sent or messages[turn] != message:
            raise ValueError(f"{self.adapter.name}: the environment rewrote the conversation (get_prompt_messages); "
                             "rollcorr appends to a trajectory and cannot play it token in, token out")
        self.sent = messages
        return Turn(observation=self.adapter.as_prompt(messages[turn + 1:]), reward=0.0, done=False)

    def _end(self) -> Turn:
        try:
            output = self.rollout.result()  # the library's exception, if one left the rollout
        finally:
            self._close()
        if output.get("error") is not None:
            raise ValueError(f"{self.adapter.name}: the rollout ended with an error: {output['error']}")
        return Turn(observation=None, reward=self.adapter.scale(output["reward"]), done=True)

    def _close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()

    def __del__(self) -> None:  # a rollout a limit cut: dropped where it stands
        loop = getattr(self, "loop", None)
        if loop is not None and not loop.is_closed() and not loop.is_running():
            loop.close()


def _quiet_when_dropped(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """An episode's loop: a rollout dropped unfinished (a cut trajectory) is expected; anything else is said."""
    if context.get("message") != "Task was destroyed but it is pending!":
        loop.default_exception_handler(context)


def plain(message: Any) -> dict[str, Any]:
    """A verifiers message as {"role", "content"} (text content; parts joined when all are text), with an
    assistant's ``tool_calls`` (OpenAI chat format; its content may then be None) and a tool's ``tool_call_id``."""
    content, calls = message.content, getattr(message, "tool_calls", None)
    if isinstance(content, list) and all(getattr(p, "type", None) == "text" for p in content):
        content = "".join(p.text for p in content)
    if not isinstance(content, str) and not (content is None and calls):
        raise ValueError(f"verifiers: a {message.role} message whose content is not text ({excerpt(content)})")
    out = {"role": message.role, "content": content}
    if calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in calls]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    return out


@functools.cache
def _client_class() -> type:
    """verifiers' ``Client`` whose model is rollcorr's sampler: each request goes to the episode (``ask``)."""
    from verifiers.legacy.clients.client import Client
    from verifiers.legacy.types import Response, ResponseMessage, ToolCall

    class SamplerClient(Client):
        def __init__(self, episode: VerifiersEpisode) -> None:
            super().__init__(episode)

        def setup_client(self, config: Any) -> Any:
            raise ValueError("verifiers: rollcorr's client is its sampler, not a configured endpoint")

        async def to_native_tool(self, tool: Any) -> dict[str, Any]:  # as verifiers' OpenAI chat client sends it
            function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
            return {"type": "function", "function": function if tool.strict is None else {**function,
                                                                                           "strict": tool.strict}}

        async def to_native_prompt(self, messages: Any) -> tuple[list[dict[str, Any]], dict]:
            return [plain(m) for m in messages], {}

        async def get_native_response(self, prompt: list[dict[str, Any]], model: str, sampling_args: Any,
                                      tools: Any = None, **kwargs: Any) -> dict[str, Any]:
            return await self.client.ask(prompt, tools)

        async def raise_from_native_response(self, response: dict[str, Any]) -> None:
            return None

        async def from_native_response(self, response: dict[str, Any]) -> Any:
            calls = [ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                     for c in response.get("tool_calls", ())]
            message = ResponseMessage(content=response["content"], tool_calls=calls or None, is_truncated=False,
                                      finish_reason="tool_calls" if calls else "stop")
            return Response(id="rollcorr", created=int(time.time()), model=MODEL, message=message)

        async def close(self) -> None:
            return None

    return SamplerClient


register_env("verifiers", VerifiersEnv)
