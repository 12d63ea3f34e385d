"""Verifiable rewards for a data set's items: ``reward(item, response_text) -> float`` in [0, 1].

``task.reward`` names one of ``REWARDS`` or an importable ``module:function``. The built-in verifiers, each
scoring 1.0 when the response's answer equals the item's ``answer`` and 0.0 otherwise:

    exact        the stripped response is the stripped answer, character for character
    last_number  the last number in the response equals the answer's last number, as exact decimals
                 ("27", "27.0" and "+27" are equal; "2,700" is 2700; "1/2" reads as the number 2 — use
                 ``math`` for fractions); the answer may be a number or text holding one
    boxed        the contents of the response's last ``\\boxed{...}`` (braces balanced) equal the answer: as
                 decimals when both are numbers, else as text with spaces and surrounding ``$`` removed
    gsm8k        the number after the response's last ``####`` (GSM8K's format) equals the answer's number
                 (an answer that itself holds ``####``, as GSM8K's answer field does, is read after it)
    math         mathematical equivalence through Hugging Face's ``math-verify`` (the verifier TRL and
                 open-r1 use: LaTeX and plain expressions, \\boxed{} first; sets, fractions, intervals):
                 ``verify(parse(answer), parse(response))``; an optional extra (``pip install -e ".[math]"``)

A custom reward is any function ``fn(item, response_text) -> float``; ``register_reward(name, fn)`` makes it a
name. Numbers are read with ``NUMBER``: an optional sign, digits with optional thousands commas, an optional
decimal part (".5" and "5." included).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

RewardFn = Callable[[dict[str, Any], str], float]

NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[-+]?\.\d+")


def parse_number(text: str) -> Decimal | None:
    """The last number in ``text`` as an exact decimal (thousands commas dropped), or None."""
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return Decimal(found[-1].replace(",", ""))
    except InvalidOperation:  # pragma: no cover - NUMBER only matches valid decimals
        return None


def _same_number(response: str, answer: Any) -> float:
    got, want = parse_number(response), parse_number(str(answer))
    return 1.0 if got is not None and want is not None and got == want else 0.0


def exact(item: dict[str, Any], response_text: str) -> float:
    """1.0 if the stripped response equals the stripped answer."""
    return 1.0 if response_text.strip() == str(item["answer"]).strip() else 0.0


def last_number(item: dict[str, Any], response_text: str) -> float:
    """1.0 if the response's last number equals the answer's (exact decimals)."""
    return _same_number(response_text, item["answer"])


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
        i += 1
    return None  # unbalanced: the response was cut before the box closed


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text.strip().strip("$"))


def boxed(item: dict[str, Any], response_text: str) -> float:
    """1.0 if the last \\boxed{} holds the answer (as a number when both are numbers, else as text)."""
    inside = last_boxed(response_text)
    if inside is None:
        return 0.0
    answer = str(item["answer"])
    inner = last_boxed(answer)
    answer = inner if inner is not None else answer
    got, want = _normalise(inside), _normalise(answer)
    if NUMBER.fullmatch(got) and NUMBER.fullmatch(want):
        return 1.0 if Decimal(got.replace(",", "")) == Decimal(want.replace(",", "")) else 0.0
    return 1.0 if got == want else 0.0


def gsm8k(item: dict[str, Any], response_text: str) -> float:
    """1.0 if the number after the response's last ``####`` equals the answer's (read after its own ####)."""
    if "####" not in response_text:
        return 0.0
    answer = str(item["answer"])
    answer = answer.rsplit("####", 1)[-1] if "####" in answer else answer
    after = response_text.rsplit("####", 1)[-1].strip()
    first = NUMBER.match(after)
    return _same_number(first.group(0), answer) if first else 0.0


def math_equivalent(item: dict[str, Any], response_text: str) -> float:
    """1.0 if math-verify finds the response's answer equivalent to the item's."""
    from math_verify import parse, verify

    answer = str(item["answer"])
    # no signal-based timeouts: rewards are computed in sampler processes, Ray actors and threads
    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$", parsing_timeout=None)
    guess = parse(response_text, parsing_timeout=None)
    return 1.0 if gold and guess and verify(gold, guess, timeout_seconds=None) else 0.0


def is_batched(fn: Callable) -> bool:
    """Whether ``fn`` takes TRL's batched signature, ``fn(completions, **columns) -> list``: a parameter named
    ``completions`` (``rollcorr.tasks.reward_list``)."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a function written in C): a per-response one
        return False


def check_signature(fn: RewardFn, label: Any) -> RewardFn:
    """``fn`` if it can be called as ``fn(item, response_text)`` or is batched in TRL's signature (``is_batched``);
    ValueError naming ``label`` and its signature otherwise (said when the task is built, not at the first
    response)."""
    if is_batched(fn):
        return fn
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a function written in C): its first call will tell
        return fn
    try:
        signature.bind({}, "")
    except TypeError:
        name = getattr(fn, "__name__", "fn")
        raise ValueError(f"reward {label!r}: {name}{signature} cannot be called as {name}(item, "
                         "response_text), nor as TRL's batched fn(completions, **columns)") from None
    return fn


REWARDS: dict[str, RewardFn] = {}
READS_ANSWER_AS_TEXT = ("exact", "last_number", "boxed", "gsm8k", "math")  # they compare str(item["answer"])
NEEDS: dict[str, tuple[str, str]] = {"math": ("math_verify", "math")}  # reward → (module, the extra holding it)


def register_reward(name: str, fn: RewardFn) -> None:
    """Make ``name`` a value of ``task.reward``: ``fn(item, response_text) -> float`` in [0, 1]."""
    if not isinstance(name, str) or not name.isidentifier() or ":" in name:
        raise ValueError(f"a reward name must be an identifier, got {name!r}")
    if not callable(fn):
        raise TypeError(f"reward {name!r} must be callable, got {type(fn).__name__}")
    REWARDS[name] = check_signature(fn, name)


for _name, _fn in (("exact", exact), ("last_number", last_number), ("boxed", boxed), ("gsm8k", gsm8k),
                   ("math", math_equivalent)):
    register_reward(_name, _fn)


def reward_module(reward: Any) -> str | None:
    """The module ``task.reward`` would import: ``"pkg.mod"`` of ``"pkg.mod:fn"`` (of a list: the first one this
    process has not imported, else the first); None for registered names."""
    if isinstance(reward, list | tuple):
        modules = [m for m in map(reward_module, reward) if m is not None]
        return next((m for m in modules if m not in sys.modules), modules[0] if modules else None)
    if not isinstance(reward, str) or reward in REWARDS:
        return None
    module, sep, _ = reward.partition(":")
    return module if sep and module else None


def check_named_reward(reward: Any, source: str, how: str) -> None:
    """A ``task.reward`` read from a file rollcorr did not get from the user (a run folder's config.yaml) imports
    nothing by itself: its module must be one this process imported already (the user named it: a plugin, a
    script of theirs); ValueError naming ``source`` and saying ``how`` to name it otherwise (docs/security.md)."""
    module = reward_module(reward)
    if module is not None and module not in sys.modules:
        raise ValueError(f"{source} names the reward module {module!r} (task.reward {reward!r}); a run folder's "
                         f"file never imports code by itself: {how}")


def resolve_reward(reward: str | RewardFn) -> RewardFn:
    """A name of ``REWARDS`` or ``"package.module:function"`` → the function; ValueError naming the problem
    (an unknown name, a module that does not import, a missing function, a missing optional package)."""
    if callable(reward):
        return check_signature(reward, getattr(reward, "__qualname__", reward))
    if not isinstance(reward, str):
        raise ValueError(f"reward must be a name or 'module:function', got {reward!r}")
    if reward in REWARDS:
        if reward in NEEDS and importlib.util.find_spec(NEEDS[reward][0]) is None:
            module, extra = NEEDS[reward]
            raise ValueError(f"reward {reward!r} needs the {module} package: pip install -e \".[{extra}]\"")
        return REWARDS[reward]
    module_name, sep, fn_name = reward.partition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(f"unknown reward {reward!r}; use one of {sorted(REWARDS)} or 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import reward module {module_name!r}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward module {module_name!r} has no function {fn_name!r}")
    return check_signature(fn, reward)
