"""Messages to token ids, appended — never re-tokenised (token in, token out).

A trajectory's ids are the prompt's, then each model turn's as sampled, then each observation's as rendered
*on its own* and appended. Decoding the model's turns and re-encoding the whole conversation would give other
ids (BPE merges across a boundary, a template that is not append-only, special tokens): the learner would score
a sequence the sampler never produced. So an observation is rendered by the rule of the template alone:

    head = template([user "x", assistant "y"])                         (no generation prompt)
    full = template([user "x", assistant "y", *observation], generation prompt)
    observation ids = full[k + 1 :],   k = the position in full of the assistant's end-of-turn token (the
                                           tokenizer's EOS): full's n-th, n the count of them in head

— everything the template puts after the assistant's end-of-turn token: its separator (ChatML's "\\n" after
"<|im_end|>", which the model never samples and a naive concatenation drops at every turn), the observation's
own turn, the next assistant turn's opening. Everything up to the user's turn must render alike in head and full;
the assistant's turn may not (Qwen3's own template writes an empty ``<think>`` block into the last assistant turn
only, so "y" renders one way in head and another in full): a sampled turn's ids are kept as drawn whatever the
template would write for it again — ``rollcorr audit``'s token-in-token-out check measures that difference.
A model turn cut at its token cap, without the end-of-turn token, gets that token at the head of the observation
(the environment's, never trained). A model without a chat template takes text observations, encoded without
special tokens.

``conversation_ids`` is the other way, the one a pipeline that re-tokenises takes: the whole conversation
through the template. ``rollcorr audit`` compares it with the sampled ids (the token-in-token-out check).
"""

from __future__ import annotations

from typing import Any

from rollcorr.tasks.chat import Prompt, messages_of, model_input, template_ids

_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class Renderer:
    """How one run turns prompts and observations into token ids: the chat template (``chat``) or plain text."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.end_of_turn = tokenizer.eos_token_id

    def prompt(self, prompt: Prompt, tools: list[dict[str, Any]] | None = None) -> str | list[int]:
        """What the sampler receives for an episode's first messages (``tasks.chat.model_input``), with the
        episode's ``tools`` (OpenAI chat format) described by the template."""
        return model_input(self.tokenizer, prompt, self.chat, tools)

    def observation_ids(self, observation: Prompt, turn_ended: bool) -> list[int]:
        """The ids appended after a model turn for ``observation`` (messages, or text without a template);
        ``turn_ended``: the model's turn ended with its end-of-turn token (else the token is supplied)."""
        if self.chat:
            ids = self._template_delta(messages_of(observation) if isinstance(observation, list) else
                                       [{"role": "user", "content": observation}])
        elif isinstance(observation, str):
            ids = [int(t) for t in self.tokenizer(observation, add_special_tokens=False)["input_ids"]]
        else:
            raise ValueError("an observation of messages needs the chat template (task.chat); this model takes text")
        if self.chat and not turn_ended:
            ids = [self.end_of_turn, *ids]
        return ids

    def _template_delta(self, observation: list[dict[str, str]]) -> list[int]:
        head = _template(self.tokenizer, _PROBE, generation_prompt=False)
        full = template_ids(self.tokenizer, [*_PROBE, *observation])
        ends_head = [k for k, t in enumerate(head) if t == self.end_of_turn]
        ends_full = [k for k, t in enumerate(full) if t == self.end_of_turn]
        if not ends_head or len(ends_full) < len(ends_head):
            raise ValueError("the chat template does not end an assistant turn with the tokenizer's EOS token "
                             f"({self.tokenizer.eos_token!r}): observations cannot be "
                             "appended as tokens")
        user_end = ends_head[-2] + 1 if len(ends_head) > 1 else 0  # through the user's turn: rendered alike
        if full[:user_end] != head[:user_end]:
            raise ValueError("the chat template renders the conversation before an observation differently once the "
                             "observation follows: observations cannot be appended as tokens")
        return full[ends_full[len(ends_head) - 1] + 1 :]

    def conversation_ids(self, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The whole conversation through the template (with the ``tools`` its prompt described), as a pipeline
        that re-tokenises would score it."""
        if not self.chat:
            return [int(t) for t in self.tokenizer("".join(m["content"] for m in messages))["input_ids"]]
        return _template(self.tokenizer, messages, generation_prompt=False, tools=tools)


def _template(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool,
              tools: list[dict[str, Any]] | None = None) -> list[int]:
    described = {"tools": tools} if tools else {}
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True, **described)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    if ids and isinstance(ids[0], list):
        (ids,) = ids
    return [int(t) for t in ids]
