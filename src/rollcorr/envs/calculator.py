"""``calculator``: a task's arithmetic questions answered with a calculator tool, over several model turns.

    task.env: {name: calculator}      # over a data set of questions and numeric answers (examples/calculator)

An episode's prompt is a system message saying how to call the tool, a worked example (a conversation: a
question, a call, its result, the answer) and the row's question. Each model turn is a call or the answer:

    <calc>(27+14)*3</calc>    a call: the expression's value comes back as the next message (this turn's reward 0)
    anything else             the final answer, scored by the task's reward (task.reward, e.g. last_number); done

so a trajectory's reward is its answer's. ``max_calls`` calls at most (the next turn is cut: reward 0). An
expression holds integers and decimals, + − * / and parentheses, evaluated exactly (``Fraction``), never by
``eval``: anything else — a name, a call, ``**``, more than ``MAX_EXPRESSION`` characters — gets ``error: …``
back as the tool's answer, as does a division by zero.

The call syntax is the environment's own, because SmolLM2-135M-Instruct's chat template (the model of the
recipe in docs/multi-turn.md) has no tool-calling branch: it reads neither ``tools`` nor a message's
``tool_calls``, and writes every message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` whatever its role.
A result is sent as a ``tool_role`` message, ``tool`` by default: the template writes that role as it writes any
other, and the role keeps the tool's words apart from the user's in the trajectory (``user`` is the other
choice). The messages are
rendered by the chat template and appended as tokens (``envs.render``), so this environment needs a model with
one (``task.chat`` not false).
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction
from typing import Any

from rollcorr.envs.base import Turn, answer_turn, register_env
from rollcorr.tasks.base import Task, task_reward_range

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
MAX_EXPRESSION = 120  # characters of an expression the tool evaluates (longer: an error, before parsing)
SYSTEM = ("You can use a calculator: write <calc>expression</calc> and you will get the result. "
          "Then write Answer: and the number.")
EXAMPLE = (("What is 12 * 34 + 5?", "12*34+5"),)  # the worked example: a question and the call that solves it


class CalculatorEnv:
    """The task's rows (``sample`` / ``held_out``) played with the calculator; the answer scored by ``task.reward``."""

    needs_chat = True  # its prompt and the tool's results are messages

    def __init__(self, task: Task, max_calls: int = 3, tool_role: str = "tool", example: bool = True) -> None:
        if not isinstance(max_calls, int) or isinstance(max_calls, bool) or max_calls < 1:
            raise ValueError(f"calculator: max_calls must be a positive integer, got {max_calls!r}")
        if tool_role not in ("tool", "user"):
            raise ValueError(f"calculator: tool_role must be 'tool' or 'user', got {tool_role!r}")
        self.task, self.tool_role, self.example = task, tool_role, bool(example)
        self.name, self.max_turns = f"{task.name}/calculator", max_calls + 1
        self.reward_range = task_reward_range(task)  # the answer's reward: the task's, a reward list's sum too

    def sample(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        return self.task.sample(n, seed, split)

    def held_out(self, n: int, seed: int) -> list[dict[str, Any]]:
        return self.task.held_out(n, seed)

    def reset(self, item: dict[str, Any]) -> Calculation:
        return Calculation(self, item)

    def messages(self, question: str) -> list[dict[str, str]]:
        """The prompt: the system message, the worked example (when ``example``), the question."""
        out = [{"role": "system", "content": SYSTEM}]
        for asked, expression in EXAMPLE if self.example else ():
            out += [{"role": "user", "content": asked}, {"role": "assistant", "content": f"<calc>{expression}</calc>"},
                    {"role": self.tool_role, "content": evaluate(expression)},
                    {"role": "assistant", "content": f"Answer: {evaluate(expression)}"}]
        return [*out, {"role": "user", "content": question}]


class Calculation:
    """One question's episode: calls answered by the tool until the model answers."""

    def __init__(self, env: CalculatorEnv, item: dict[str, Any]) -> None:
        if not isinstance(item["prompt"], str):
            raise ValueError("calculator: a row's prompt is the question, as text")
        self.env, self.item = env, item
        self.prompt = env.messages(item["prompt"])

    def step(self, response_text: str) -> Turn:
        call = CALL.search(response_text)
        if call is None:  # the answer
            return answer_turn(self.env.task, self.item, response_text)
        return Turn(observation=[{"role": self.env.tool_role, "content": evaluate(call.group(1))}])


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text — an integer, or a decimal to 6 places — or ``error: …``."""
    text = expression.strip()
    if len(text) > MAX_EXPRESSION:
        return f"error: longer than {MAX_EXPRESSION} characters"
    try:
        value = _value(ast.parse(text, mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, RecursionError):
        return "error: not an arithmetic expression"
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0")


_OPERATORS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.Div: lambda a, b: a / b}


def _value(node: ast.AST) -> Fraction:
    """A parsed expression's exact value; ValueError for any node but numbers, + − * / and unary ±."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return Fraction(str(node.value))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _value(node.operand)
        return -inner if isinstance(node.op, ast.USub) else inner
    raise ValueError(f"not allowed: {type(node).__name__}")


register_env("calculator", CalculatorEnv)
