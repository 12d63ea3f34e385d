"""A user's data set as a task: prompts with answers from a JSONL file, a Parquet file or a ``datasets`` folder.

Formats (docs/tasks.md), detected from the content, not the name:
- JSONL: one JSON object per line (blank lines skipped);
- Parquet: a file starting with the ``PAR1`` magic (read with pyarrow, the ``parquet`` extra);
- a folder written by Hugging Face ``datasets``' ``save_to_disk`` — one ``Dataset`` or a ``DatasetDict`` whose
  ``train`` and ``test`` (else ``validation``) splits are the task's splits (needs the ``datasets`` package).

Each row needs a prompt (``prompt_key``, default "prompt"): a non-empty string, or a conversation — a list of
``{"role": ..., "content": ...}`` messages (the chat template makes the model's input) — and an answer
(``answer_key``, default "answer") that the reward reads: for a built-in verifier text or a finite number (a
list, a mapping, a boolean or NaN is refused: ``check_answer``), for your own reward any value. Other fields are
kept on the item (a custom reward can read them). A bad row is one line naming the file, the row and the field.

Splits: ``eval_file`` given → its rows are the held-out set and every row of the main file trains; else a
``split`` field ("train" / "test"; any other value is refused) on the rows; else every 10th row (index % 10 ==
9) is held out. Held-out rows that repeat a training prompt are counted (``notes``, said when a run starts). Training
draws with replacement (deterministic per seed and batch); evaluation takes every held-out row once, in file
order (``held_out(n)``: the first n).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from rollcorr.tasks.base import SPLITS, check_count, check_split
from rollcorr.tasks.reward_list import CompositeReward, RewardTerm
from rollcorr.tasks.verifiers import READS_ANSWER_AS_TEXT, RewardFn, is_batched, resolve_reward

MAX_BAD_SAMPLE = 120  # characters of a bad value quoted in an error


class DataError(ValueError):
    """A task setting or data file that cannot be used: the message names the file, the row and what was
    expected; ``field`` is the ``task.*`` setting at fault (name, reward, eval_file, prompt_key, ...)."""

    def __init__(self, message: str, field: str = "name") -> None:
        super().__init__(message)
        self.field = field


def _excerpt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_BAD_SAMPLE else text[:MAX_BAD_SAMPLE] + "…"


def is_datasets_folder(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in ("dataset_info.json", "dataset_dict.json"))


Rows = list[tuple[str, dict[str, Any]]]  # (where: "line 3" of a JSONL file, "row 3" of a table; the row)


def read_rows(path: str | Path) -> dict[str, Rows]:
    """{split name: rows} of a data set; a file has one pseudo-split "" (its rows may carry ``split``)."""
    path = Path(path)
    if path.is_dir():
        if not is_datasets_folder(path):
            raise DataError(f"{path}: a folder that datasets' save_to_disk did not write (no dataset_info.json or "
                            "dataset_dict.json); expected a JSONL or Parquet file, or such a folder")
        return _read_datasets_folder(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic == b"PAR1":
        return {"": _read_parquet(path)}
    return {"": _read_jsonl(path)}


def _numbered(rows: list[dict[str, Any]]) -> Rows:
    return [(f"row {i + 1}", row) for i, row in enumerate(rows)]


def _read_jsonl(path: Path) -> Rows:
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path}, line {lineno}: not UTF-8 text; expected JSONL (one JSON object per line), "
                                "a Parquet file or a datasets folder") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {lineno}: invalid JSON ({e.msg}); expected one JSON object per line") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}, line {lineno}: expected a JSON object, got {type(row).__name__}")
            rows.append((f"line {lineno}", row))
    return rows


def _read_parquet(path: Path) -> Rows:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: a Parquet file; reading it needs pyarrow (pip install -e \".[parquet]\")") from None
    try:
        return _numbered(pq.read_table(path).to_pylist())
    except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError): a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {str(e)[:200]})") from None


def _read_datasets_folder(path: Path) -> dict[str, Rows]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: a datasets folder; reading it needs the datasets package (pip install datasets)") from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises FileNotFoundError / ValueError / pyarrow errors on a damaged folder
        raise DataError(f"{path}: datasets could not load this folder ({type(e).__name__}: {str(e)[:200]})") from None
    if isinstance(loaded, datasets.DatasetDict):
        return {name: _numbered(loaded[name].to_list()) for name in loaded}
    return {"": _numbered(loaded.to_list())}


def check_messages(value: Any, where: str) -> None:
    """A conversation: a non-empty list of {"role": str, "content": str} messages."""
    if not value or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                            for m in value):
        raise DataError(f"{where}: a conversation prompt must be a non-empty list of "
                        f'{{"role": ..., "content": ...}} messages, got {_excerpt(value)}')


def to_item(row: dict[str, Any], prompt_key: str, answer_key: str, where: str, text_reward: str | None = None
            ) -> dict[str, Any]:
    """A row → an item with "prompt" and "answer" (the other fields kept); DataError naming the problem.
    ``text_reward``: the name of a built-in verifier, which reads the answer as text (``check_answer``)."""
    for key, role in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        if key not in row:
            raise DataError(f"{where}: no field {key!r} (task.{role}); the row has {sorted(row)[:12]}", role)
    prompt = row[prompt_key]
    if isinstance(prompt, list):
        check_messages(prompt, where)
    elif not isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: field {prompt_key!r} must be a non-empty string or a list of messages, "
                        f"got {_excerpt(prompt)}")
    if row[answer_key] is None:
        raise DataError(f"{where}: field {answer_key!r} is null")
    if text_reward is not None:
        check_answer(row[answer_key], f"{where}: field {answer_key!r}", text_reward)
    return {**row, "prompt": prompt, "answer": row[answer_key]}


def check_answer(answer: Any, what: str, reward: str) -> None:
    """The rule of the built-in verifiers (``READS_ANSWER_AS_TEXT``): they compare ``str(answer)``, so an answer
    is text or a finite number. A list, a mapping or a boolean would be compared as its Python text ("[1, 2]",
    "True": with ``last_number`` nothing could ever score) and NaN / ±inf equal no response: DataError naming it.
    A reward of your own (``module:function``) gets the value as it is, unchecked."""
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        kind = "a boolean" if isinstance(answer, bool) else f"a {type(answer).__name__}"
        raise DataError(f"{what} is {kind} ({_excerpt(answer)}); reward {reward!r} reads the answer as text, "
                        f"{str(answer)!r}: give it as text or a number, or score it with your own reward "
                        "(task.reward=module:function gets it as it is)", "answer_key")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise DataError(f"{what} is {answer} (not a finite number): no response can equal it", "answer_key")


Labelled = list[tuple[str, dict[str, Any]]]  # (where: "data.jsonl, line 3", the item)


def load_items(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
               text_reward: str | None = None) -> dict[str, Labelled]:
    """{split: [(where, item)]} of a data set (see the module docstring); DataError for anything unusable."""
    out = {}
    for split, rows in read_rows(path).items():
        where = f"{path}" + (f" (split {split!r})" if split else "")
        if not rows:
            raise DataError(f"{where}: no rows")
        out[split] = [(f"{where}, {label}", to_item(row, prompt_key, answer_key, f"{where}, {label}", text_reward))
                      for label, row in rows]
    return out


def split_rows(path: Path, rows: Labelled) -> tuple[list[dict], list[dict], str]:
    """A file's rows → (train, held out, the rule that chose them): by their ``split`` field when any row has one
    ("train" / "test"; another value is refused naming its row: it would be neither), else every 10th row."""
    if any("split" in item for _, item in rows):
        for where, item in rows:
            if item.get("split", "train") not in SPLITS:
                raise DataError(f"{where}: split {item['split']!r} is none of {', '.join(map(repr, SPLITS))} (rows "
                                "of split 'test' are held out, the others train)", "name")
        test = [item for _, item in rows if item.get("split") == "test"]
        return [item for _, item in rows if item.get("split", "train") == "train"], test, "no row has split 'test'"
    train = [item for i, (_, item) in enumerate(rows) if i % 10 != 9]
    held = [item for i, (_, item) in enumerate(rows) if i % 10 == 9]
    return train, held, f"every 10th row is held out, and it has {len(rows)} rows"


def _key(prompt: Any) -> str:
    return prompt.strip() if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def duplicates_note(path: Path, train: list[dict], test: list[dict]) -> str | None:
    """A line saying how many held-out rows repeat a training prompt (their accuracy measures recall), or None."""
    seen = {_key(item["prompt"]) for item in train}
    repeated = sum(_key(item["prompt"]) in seen for item in test)
    if not repeated:
        return None
    return (f"{path}: {repeated} of {len(test)} held-out rows repeat a training prompt (greedy accuracy on them "
            "measures what the model saw in training)")


def reward_terms(rewards: list, weights: list | None) -> list[RewardTerm]:
    """``task.reward`` as a list (names, "module:function"s or functions) with ``task.reward_weights`` → the
    terms of a reward list; DataError naming the setting at fault."""
    if not rewards:
        raise DataError("an empty list: name at least one reward", "reward")
    if weights is not None and len(weights) != len(rewards):
        raise DataError(f"{len(weights)} weights for {len(rewards)} rewards: give one weight per reward "
                        "(task.reward_weights), or none (1 each)", "reward_weights")
    if weights is not None and not all(isinstance(w, int | float) and math.isfinite(w) for w in weights):
        raise DataError(f"the weights must be finite numbers, got {_excerpt(weights)}", "reward_weights")
    terms = []
    for reward, weight in zip(rewards, weights or [1.0] * len(rewards)):
        try:
            fn = resolve_reward(reward)
        except ValueError as err:
            raise DataError(str(err), "reward") from None
        name = reward if isinstance(reward, str) else getattr(reward, "__qualname__", "fn")
        terms.append(RewardTerm(name, fn, float(weight)))
    if len({term.name for term in terms}) != len(terms):
        raise DataError(f"a reward list names each function once, got {[term.name for term in terms]}", "reward")
    return terms


class DataTask:
    """Prompts from a data set, scored by ``reward`` (a name of ``rollcorr.tasks.verifiers.REWARDS`` or
    "module:function", or a list of them with ``reward_weights``: ``rollcorr.tasks.reward_list``, each value clipped
    into [0, 1] when ``reward_clip``); splits and evaluation order as the module docstring says."""

    def __init__(self, path: str | Path, reward: str | RewardFn | list = "exact", *, prompt_key: str = "prompt",
                 answer_key: str = "answer", eval_file: str | Path | None = None, reward_weights: list | None = None,
                 reward_clip: bool = False) -> None:
        self.path = Path(path)
        listed = list(reward) if isinstance(reward, list | tuple) else [reward]
        terms = reward_terms(listed, reward_weights)
        self.reward_fn = terms[0].fn
        # a list, weights or TRL's batched signature: the reward is the list's, with its parts (reward_parts)
        several = len(terms) > 1 or reward_weights is not None or is_batched(self.reward_fn)
        self.reward_list = CompositeReward(terms, reward_clip) if several else None
        self.reward_name = (f"reward {terms[0].name!r}" if self.reward_list is None
                            else f"reward list {list(self.reward_list.names)}")
        if self.reward_list is not None:  # the environment checks the sum against its range
            self.reward_range = self.reward_list.reward_range
            self.reward_parts = self.reward_list.parts
        self.name = f"data:{self.path.name}"
        text = next((r for r in listed if isinstance(r, str) and r in READS_ANSWER_AS_TEXT), None)
        splits = load_items(self.path, prompt_key, answer_key, text)
        items = lambda labelled: [item for _, item in labelled]  # noqa: E731
        if eval_file is not None:
            train = [item for rows in splits.values() for item in items(rows)]
            try:
                held = load_items(eval_file, prompt_key, answer_key, text)
            except (DataError, FileNotFoundError) as err:
                raise DataError(str(err), "eval_file") from None
            test, rule = [item for rows in held.values() for item in items(rows)], ""
        elif set(splits) != {""}:  # a DatasetDict: its own splits
            if "train" not in splits:
                raise DataError(f"{self.path}: the DatasetDict has no 'train' split (it has {sorted(splits)})")
            train, test = items(splits["train"]), items(splits.get("test", splits.get("validation", [])))
            rule = "the DatasetDict has no 'test' or 'validation' split"
        else:
            train, test, rule = split_rows(self.path, splits[""])
        if not train:
            raise DataError(f"{self.path}: no training rows (every row is held out)")
        self.by_split = {"train": train, "test": test}
        self.items = train + test  # every prompt the run can see (checked against the model before training)
        self.held_out_rule = rule  # why there are no held-out rows, when there are none
        self.notes = [note for note in [duplicates_note(self.path, train, test)] if note]  # said when a run starts

    def sample(self, n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
        """``n`` items drawn with replacement from ``split`` (the train rows when ``split`` has none)."""
        check_count(n)
        check_split(split)
        pool = self.by_split[split] or self.by_split["train"]
        rng = random.Random(f"{self.name}/{split}/{seed}")
        return [dict(rng.choice(pool)) for _ in range(n)]

    def held_out(self, n: int, seed: int) -> list[dict[str, Any]]:
        """The first ``n`` held-out items in file order, each once (``seed`` unused: the order is the file's)."""
        check_count(n)
        return [dict(item) for item in self.by_split["test"][:n]]

    def reward(self, item: dict[str, Any], response_text: str) -> Any:
        """The reward function's value as it returned it (``tasks.base.rewards`` checks it); with a reward list,
        its weighted sum (each value checked: ``reward_parts`` gives them too)."""
        if self.reward_list is not None:
            return self.reward_list.parts(item, response_text)[0]
        return self.reward_fn(item, response_text)
