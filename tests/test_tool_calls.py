"""Tool-call parsers (rollcorr.envs.tool_calls, docs/multi-turn.md "Tool calls"): the Hermes format read as
vLLM's `hermes` parser reads a whole response — hand-written expected outputs, then the same texts through
vLLM's own parser where vLLM is installed — and the registry's one door."""

from __future__ import annotations

import json

import pytest

from rollcorr.envs import TOOL_PARSERS, ParsedTurn, parse_tool_calls, register_tool_parser, tool_parser
from rollcorr.envs.tool_calls import hermes


def call(k: int, name: str, arguments: str) -> dict:
    return {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": arguments}}


ADD = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
CASES = {  # text → (content, [(name, arguments JSON)]), written out by hand
    "no tag": ("The answer is 5.", ("The answer is 5.", [])),
    "one call, text before": (f"Let me add.\n<tool_call>\n{ADD}\n</tool_call>",
                              ("Let me add.\n", [("add", '{"a": 2, "b": 3}')])),
    "one call, nothing before": (f"<tool_call>{ADD}</tool_call>", (None, [("add", '{"a": 2, "b": 3}')])),
    "two calls, text between and after is not content": (
        f'x<tool_call>{ADD}</tool_call> and <tool_call>{{"name": "mul", "arguments": {{"a": 4}}}}</tool_call> done',
        ("x", [("add", '{"a": 2, "b": 3}'), ("mul", '{"a": 4}')])),
    "the last tag unclosed": (f'<tool_call>{ADD}</tool_call><tool_call>{{"name": "f", "arguments": {{}}}}',
                              (None, [("add", '{"a": 2, "b": 3}'), ("f", "{}")])),
    "arguments re-serialised, non-ASCII kept": ('<tool_call>{"arguments":{"city":"Zürich","n":[1,2]},"name":"w"}</tool_call>',
                                               (None, [("w", '{"city": "Zürich", "n": [1, 2]}')])),
    "malformed JSON: no call, the whole text": ("ok <tool_call>{name: add}</tool_call>",
                                                ("ok <tool_call>{name: add}</tool_call>", [])),
    "one good call and one bad: none": (f"<tool_call>{ADD}</tool_call><tool_call>{{\"name\": \"f\"</tool_call>",
                                        (f"<tool_call>{ADD}</tool_call><tool_call>{{\"name\": \"f\"</tool_call>", [])),
    "no arguments: none": ('<tool_call>{"name": "f"}</tool_call>', ('<tool_call>{"name": "f"}</tool_call>', [])),
    "a name that is not a string: none": ('<tool_call>{"name": 3, "arguments": {}}</tool_call>',
                                          ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', [])),
    "not an object: none": ("<tool_call>[1, 2]</tool_call>", ("<tool_call>[1, 2]</tool_call>", [])),
    "an empty tag: none": ("a<tool_call></tool_call>", ("a<tool_call></tool_call>", [])),
}


@pytest.mark.parametrize("text, expected", CASES.values(), ids=CASES.keys())
def test_hermes_reads_each_text_as_written_out(text, expected):
    assert hermes(text) == expected


def test_calls_come_out_in_the_openai_chat_format_numbered_from_first_id():
    text = f'I will.<tool_call>{ADD}</tool_call><tool_call>{{"name": "neg", "arguments": {{"x": -1}}}}</tool_call>'
    parsed = parse_tool_calls(text, "hermes", first_id=4)
    assert parsed == ParsedTurn("I will.", [call(4, "add", '{"a": 2, "b": 3}'), call(5, "neg", '{"x": -1}')])
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert parse_tool_calls("no call here") == ParsedTurn("no call here", [])


def test_an_unknown_parser_is_one_line_naming_it():
    with pytest.raises(ValueError, match=r"^unknown tool parser 'qwen9'; registered: \[.*'hermes'.*\] \(a plugin "
                                         r"registers its own with rollcorr\.envs\.register_tool_parser\)$"):
        tool_parser("qwen9")


def test_a_parser_registered_from_outside_is_used_by_name_and_checked():
    def bang(text):  # "!name args" lines are calls
        lines = text.splitlines()
        calls = [tuple(line[1:].split(" ", 1)) for line in lines if line.startswith("!")]
        return "\n".join(line for line in lines if not line.startswith("!")) or None, calls

    def broken(text):
        return text, [("f", {"a": 1})]  # arguments not a JSON string

    register_tool_parser("bang", bang)
    register_tool_parser("broken", broken)
    try:
        assert parse_tool_calls('hi\n!add {"a": 1}', "bang") == ParsedTurn("hi", [call(0, "add", '{"a": 1}')])
        with pytest.raises(ValueError, match=r"^tool parser 'broken' returned .*; a parser returns \(content"):
            parse_tool_calls("x", "broken")
    finally:
        TOOL_PARSERS.pop("bang")
        TOOL_PARSERS.pop("broken")


def test_hermes_reads_as_vllms_hermes_parser(caplog):
    """The same texts through vLLM's own `hermes` parser (Hermes2ProToolParser.extract_tool_calls, whole
    responses): the same content and the same calls, ids aside (vLLM's are random)."""
    pytest.importorskip("vllm", reason="needs vLLM (ROLLCORR_OPTIONAL=vllm bash scripts/setup.sh)")
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    from rollcorr.models.builtin import build_tokenizer

    vllm_parser = Hermes2ProToolParser(build_tokenizer())
    for text, _ in CASES.values():
        theirs = vllm_parser.extract_tool_calls(text, None)  # logs the exception of a malformed call
        ours = parse_tool_calls(text)
        assert ours.content == theirs.content, text
        assert [c["function"] for c in ours.tool_calls] == [
            {"name": c.function.name, "arguments": c.function.arguments} for c in theirs.tool_calls], text
        assert bool(ours.tool_calls) == theirs.tools_called, text
