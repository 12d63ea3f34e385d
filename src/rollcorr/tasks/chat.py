"""Prompts as the model sees them: the tokenizer's chat template, applied once, the same way everywhere.

An instruct model answers a bare string badly (SmolLM2-135M-Instruct replies with an empty string to a raw
"What is 13 + 14?"), so a prompt goes through its tokenizer's chat template: a text prompt becomes one user
message, a conversation (a list of {"role", "content"} messages) is used as it is, and the template's
generation prompt (the assistant turn's opening) is appended. The result is token ids, so the template's special
tokens are encoded exactly once, whatever engine samples (a text produced by the template and then encoded
again would get a second BOS on Llama-style tokenizers).

``chat``: True applies the template (an error when the tokenizer has none), False sends text prompts as they
are (each engine encodes them with its own special-token rule) and refuses conversations, None (the default)
applies it when the tokenizer has a template. The sampler, greedy evaluation and the audit all call
``model_input``; the learner scores the sampler's token ids, so all three see the same tokens.
"""

from __future__ import annotations

from typing import Any

Prompt = str | list[dict[str, str]]


def has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def uses_chat(tokenizer: Any, chat: bool | None) -> bool:
    """Whether prompts go through the chat template: ``chat``, or (None) whether the tokenizer has one."""
    if chat and not has_template(tokenizer):
        raise ValueError("task.chat is true but the model's tokenizer has no chat template "
                         "(tokenizer_config.json / chat_template.jinja)")
    return has_template(tokenizer) if chat is None else bool(chat)


def messages_of(prompt: Prompt) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def template_ids(tokenizer: Any, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The chat template applied to ``messages`` with the generation prompt, as token ids; ``tools`` (OpenAI
    chat format) go to the template as its ``tools``, where a template that can call tools describes them."""
    from jinja2 import TemplateError

    try:  # transformers renders templates in a sandbox: an escape attempt is a SecurityError, not code run
        described = {"tools": tools} if tools else {}  # without tools, the call as before
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **described)
    except TemplateError as err:
        first = str(err).splitlines()[0][:160] if str(err) else "no message"
        raise ValueError(f"the model's chat template failed ({type(err).__name__}: {first})") from None
    ids = out["input_ids"] if hasattr(out, "keys") else out  # transformers 5 returns a BatchEncoding
    if ids and isinstance(ids[0], list):  # a batch of one
        (ids,) = ids
    return [int(t) for t in ids]


def model_input(tokenizer: Any, prompt: Prompt, chat: bool, tools: list[dict[str, Any]] | None = None) -> str | list[int]:
    """What a sampler receives for one prompt: token ids through the template (``chat``; with ``tools``, the
    tool schemas it describes), else the text. ``chat`` is the resolved flag (``uses_chat``)."""
    if not chat:
        if not isinstance(prompt, str):
            raise ValueError("a conversation prompt (a list of messages) needs the chat template; task.chat is false")
        if tools:
            raise ValueError("tool schemas need the chat template to describe them; task.chat is false")
        return prompt
    return template_ids(tokenizer, messages_of(prompt), tools)


def prompt_text(prompt: Prompt) -> str:
    """A readable one-string form of a prompt (samples.jsonl, reports): the text, or the last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else prompt[-1]["content"]
