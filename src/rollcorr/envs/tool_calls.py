"""Tool calls in a model's turn: the turn's text → its content and its calls, in the OpenAI chat format.

A template that can call tools teaches the model a syntax for a call; a *tool parser* reads it back from the
text of the turn, as a serving engine does before it answers a chat request (vLLM's ``--tool-call-parser``,
verl's agent loop). What it returns is what an environment is handed — the assistant message's ``content`` and
its ``tool_calls``:

    [{"id": "call_0", "type": "function", "function": {"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}}]

``arguments`` is a JSON string, as in the OpenAI chat API. Parsing decides what the environment sees, never
what is trained: the trajectory keeps the tokens the model sampled, tags and all.

Parsers are named (``tool_parser(name)``), one registry and one door (``register_tool_parser``), as
environments are: a parser is a function ``text -> (content, [(name, arguments JSON), ...])``, and
``parse_tool_calls`` gives its calls their ids and the OpenAI shape. Built in:

``hermes`` — the Hermes format of Qwen2.5's and Qwen3's templates (NousResearch's Hermes 2 Pro), read as vLLM's
``hermes`` tool parser reads a whole response: each ``<tool_call>`` … ``</tool_call>`` (the last one may be left
unclosed, to the end of the text) holds one JSON object ``{"name": ..., "arguments": {...}}``; the calls are
those objects, their arguments re-serialised as JSON (non-ASCII kept), and the content is the text before the
first ``<tool_call>`` (None when that is empty; text after a call is not content). All or nothing: when any
tag's body is not such an object — malformed JSON, no ``name`` or ``arguments``, a name that is not a string —
there is no call and the content is the whole text, as vLLM answers (verl's agent loop instead skips the bad
call and keeps the others): an environment played here sees what it would see from a vLLM server started with
``--tool-call-parser hermes``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, NamedTuple

Call = tuple[str, str]  # (function name, arguments as a JSON string)
ToolParser = Callable[[str], tuple[str | None, list[Call]]]
TOOL_PARSERS: dict[str, ToolParser] = {}


class ParsedTurn(NamedTuple):
    """A model turn as an environment reads it: ``content`` (None: none) and ``tool_calls`` (OpenAI format)."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def register_tool_parser(name: str, parser: ToolParser) -> ToolParser:
    """Register ``parser`` (``text -> (content, [(name, arguments JSON), ...])``) under ``name``; a plugin calls
    this when it is imported. Returns the parser."""
    if not name or not isinstance(name, str):
        raise ValueError(f"a tool parser's name is a non-empty string, got {name!r}")
    TOOL_PARSERS[name] = parser
    return parser


def tool_parser(name: Any) -> ToolParser:
    """The parser registered under ``name``; ValueError naming an unknown one."""
    if not isinstance(name, str) or name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; registered: {sorted(TOOL_PARSERS)} (a plugin registers "
                         "its own with rollcorr.envs.register_tool_parser)")
    return TOOL_PARSERS[name]


def parse_tool_calls(text: str, parser: str | ToolParser = "hermes", first_id: int = 0) -> ParsedTurn:
    """``text`` through ``parser`` (a name or the function): its content and its calls in the OpenAI chat
    format, their ids ``call_<first_id>``, ``call_<first_id + 1>``, … (a caller numbering an episode's calls
    passes the count so far)."""
    fn = tool_parser(parser) if isinstance(parser, str) else parser
    content, calls = fn(text)
    if not (content is None or isinstance(content, str)) or not all(
            isinstance(c, tuple) and len(c) == 2 and all(isinstance(v, str) for v in c) for c in calls):
        raise ValueError(f"tool parser {getattr(fn, '__name__', fn)!r} returned {content!r}, {calls!r}; a parser "
                         "returns (content: str | None, [(name: str, arguments: JSON str), ...])")
    return ParsedTurn(content, [{"id": f"call_{first_id + k}", "type": "function",
                                 "function": {"name": name, "arguments": arguments}}
                                for k, (name, arguments) in enumerate(calls)])


HERMES_START = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def hermes(text: str) -> tuple[str | None, list[Call]]:
    """The Hermes format, as the module docstring reads it (vLLM's ``hermes`` parser on a whole response)."""
    if HERMES_START not in text:
        return text, []
    calls = []
    for closed, open_to_end in _HERMES_CALL.findall(text):
        try:
            call = json.loads(closed or open_to_end)
            name, arguments = call["name"], call["arguments"]
        except (ValueError, TypeError, KeyError):  # malformed JSON, not an object, no name or arguments
            return text, []
        if not isinstance(name, str):
            return text, []
        calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    content = text[: text.find(HERMES_START)]
    return content or None, calls


register_tool_parser("hermes", hermes)
