"""A user's data set as a task: the built-in verifiers on hand-written replies, the formats (JSONL, Parquet, a
datasets folder), column names, held-out files, evaluation without replacement, and the chat template."""

import json
from pathlib import Path

import pytest

from rollcorr.tasks import DataError, DataTask, make_task
from rollcorr.tasks.chat import messages_of, model_input, template_ids, uses_chat
from rollcorr.tasks.verifiers import REWARDS, boxed, exact, gsm8k, last_boxed, last_number, parse_number

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the verifiers, each on hand-written replies

REPLIES = [  # (reward, answer, reply, expected)
    ("exact", "27", " 27\n", 1.0),
    ("exact", "27", "27.", 0.0),
    ("last_number", "27", "13 + 14 = 27.", 1.0),
    ("last_number", "27", "13 + 14 = 25", 0.0),  # the instruct model's natural (wrong) reply
    ("last_number", "27", "The answer is 27.0", 1.0),
    ("last_number", "2700", "It costs 2,700 dollars.", 1.0),
    ("last_number", "-3", "x = -3", 1.0),
    ("last_number", "27", "no number here", 0.0),
    ("last_number", "The sum is 27", "27", 1.0),  # an answer that is text holding the number
    ("boxed", "27", "so the total is \\boxed{27}.", 1.0),
    ("boxed", "27", "\\boxed{27} and later \\boxed{28}", 0.0),  # the last box counts
    ("boxed", "\\frac{1}{2}", "$\\boxed{ \\frac{1}{2} }$", 1.0),
    ("boxed", "0.5", "\\boxed{0.50}", 1.0),
    ("boxed", "27", "27", 0.0),  # no box
    ("boxed", "{1,2}", "\\boxed{{1,2}}", 1.0),  # nested braces
    ("gsm8k", "Natalia sold 48/2 = 24 clips in May.\n#### 72", "She sold 48+24 = 72 clips.\n#### 72", 1.0),
    ("gsm8k", "72", "#### 72 clips", 1.0),
    ("gsm8k", "72", "The answer is 72", 0.0),  # no ####
    ("gsm8k", "1,000", "#### 1000", 1.0),
]


@pytest.mark.parametrize(("reward", "answer", "reply", "expected"), REPLIES)
def test_builtin_verifiers_on_hand_written_replies(reward, answer, reply, expected):
    assert REWARDS[reward]({"answer": answer}, reply) == expected


def test_math_equivalence_through_math_verify():
    pytest.importorskip("math_verify", reason="the math reward needs the math extra (math-verify)")
    item = {"answer": "\\frac{1}{2}"}
    assert REWARDS["math"](item, "The probability is $\\frac{2}{4}$.") == 1.0
    assert REWARDS["math"](item, "so \\boxed{0.5}") == 1.0
    assert REWARDS["math"](item, "so \\boxed{0.25}") == 0.0
    assert REWARDS["math"]({"answer": "27"}, "13 + 14 = 27") == 1.0
    assert REWARDS["math"]({"answer": "27"}, "I don't know") == 0.0


def test_number_and_box_helpers():
    assert parse_number("a 1,234.5 b -7") == parse_number("-7")
    assert str(parse_number("1,234.5")) == "1234.5"
    assert parse_number(".5") == parse_number("0.5") and parse_number("none") is None
    assert last_boxed("\\boxed{a{b}c}") == "a{b}c" and last_boxed("\\boxed{cut") is None
    assert exact({"answer": 27}, "27") == last_number({"answer": 27}, "=27") == boxed({"answer": 27}, "\\boxed{27}")
    assert gsm8k({"answer": 3}, "####") == 0.0


# ---------------------------------------------------------------- formats and columns


def _rows(n: int, split_every: int | None = None) -> list[dict]:
    rows = [{"question": f"What is {i} + {i}?", "solution": str(2 * i), "id": i} for i in range(n)]
    if split_every:
        for r in rows:
            r["split"] = "test" if r["id"] % split_every == 0 else "train"
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_parquet_and_datasets_folder_give_the_same_items(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    datasets = pytest.importorskip("datasets")
    rows = _rows(30)
    paths = {"jsonl": _write_jsonl(tmp_path / "d.jsonl", rows), "parquet": tmp_path / "d.parquet",
             "datasets": tmp_path / "saved"}
    pq.write_table(pa.Table.from_pylist(rows), paths["parquet"])
    datasets.Dataset.from_list(rows).save_to_disk(str(paths["datasets"]))
    tasks = {kind: make_task(str(p), "last_number", prompt_key="question", answer_key="solution")
             for kind, p in paths.items()}
    reference = tasks["jsonl"]
    for kind, task in tasks.items():
        assert [i["prompt"] for i in task.items] == [i["prompt"] for i in reference.items], kind
        assert task.held_out(100, 0) == reference.held_out(100, 0), kind
        assert task.reward(task.items[0], f"it is {task.items[0]['answer']}") == 1.0
    assert reference.items[0]["id"] == 0  # other fields stay on the item
    # a parquet file named .jsonl is still read as parquet (by its PAR1 magic)
    (tmp_path / "misnamed.jsonl").write_bytes(paths["parquet"].read_bytes())
    assert len(make_task(str(tmp_path / "misnamed.jsonl"), prompt_key="question", answer_key="solution").items) == 30


def test_a_datasets_dict_folder_uses_its_train_and_test_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows(8)),
                          "test": datasets.Dataset.from_list(_rows(3))}).save_to_disk(str(saved))
    task = DataTask(saved, prompt_key="question", answer_key="solution")
    assert len(task.by_split["train"]) == 8 and len(task.held_out(200, 0)) == 3


def test_evaluation_takes_every_held_out_item_once_in_file_order(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(200))  # every 10th row is held out: 20 of them
    task = DataTask(path, prompt_key="question", answer_key="solution")
    held = task.held_out(200, seed=7)
    assert [i["id"] for i in held] == list(range(9, 200, 10))  # each once, in file order; 200 only caps
    assert [i["id"] for i in task.held_out(5, seed=1)] == [9, 19, 29, 39, 49]
    # an eval file: all its rows are held out, every row of the main file trains
    eval_path = _write_jsonl(tmp_path / "e.jsonl", _rows(7))
    task = DataTask(path, prompt_key="question", answer_key="solution", eval_file=eval_path)
    assert len(task.by_split["train"]) == 200 and len(task.held_out(50, 0)) == 7
    # a split field decides when present
    task = DataTask(_write_jsonl(tmp_path / "s.jsonl", _rows(12, split_every=4)), prompt_key="question",
                    answer_key="solution")
    assert [i["id"] for i in task.held_out(50, 0)] == [0, 4, 8]


@pytest.mark.parametrize(
    ("content", "kwargs", "message"),
    [
        (b"\xec\x00\x01binary", {}, "line 1: not UTF-8 text; expected JSONL"),
        (b'{"prompt": "a", "answer": "1"}\n[1]\n', {}, "line 2: expected a JSON object"),
        (b'{"q": "a", "answer": "1"}\n', {}, "line 1: no field 'prompt' \\(task.prompt_key\\)"),
        (b'{"prompt": "a", "answer": null}\n', {}, "line 1: field 'answer' is null"),
        (b'{"prompt": [{"role": "user"}], "answer": "1"}\n', {}, "a conversation prompt must be"),
        (b'{"prompt": "a", "answer": "1"}\n', {"reward": "fuzzy"}, "unknown reward 'fuzzy'"),
    ],
)
def test_a_wrong_format_is_one_line_naming_what_was_expected(tmp_path, content, kwargs, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as info:
        DataTask(path, **kwargs)
    assert "\n" not in str(info.value)


def test_a_plain_folder_is_refused_and_a_builtin_task_refuses_data_options(tmp_path):
    with pytest.raises(DataError, match="save_to_disk did not write"):
        DataTask(tmp_path)
    with pytest.raises(DataError, match="task.reward applies to a data set") as info:
        make_task("addition", "last_number")
    assert info.value.field == "reward"


def test_train_config_names_the_task_key_at_fault(tmp_path):
    from rollcorr.train.build import check_components
    from rollcorr.train.config import ConfigError, load_config

    data = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "answer": "1"}] * 10)
    cases = [([f"task.name={data}", "task.reward=fuzzy"], "task.reward: unknown reward 'fuzzy'"),
             ([f"task.name={data}", f"task.eval_file={tmp_path / 'none.jsonl'}"], "task.eval_file: "),
             ([f"task.name={data}", "task.answer_key=solution"], "task.answer_key: "),
             (["task.chat=true"], None)]
    for overrides, message in cases:
        config = load_config(None, overrides)
        if message is None:
            check_components(config)  # task.chat is checked against the tokenizer when the model loads
            continue
        with pytest.raises(ConfigError, match=message):
            check_components(config)


# ---------------------------------------------------------------- the chat template


@pytest.fixture(scope="module")
def chat_tokenizer():
    """The built-in character tokenizer with a small ChatML-style template (the built-in has none)."""
    from rollcorr.models.builtin import load_model

    _, tokenizer = load_model("builtin")
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    return tokenizer


def test_chat_inputs_are_the_templates_ids_with_special_tokens_once(chat_tokenizer):
    ids = model_input(chat_tokenizer, "1+2=", chat=True)
    want = chat_tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
    assert ids == list(want) == template_ids(chat_tokenizer, [{"role": "user", "content": "1+2="}])
    conversation = [{"role": "system", "content": "9"}, {"role": "user", "content": "1+2="}]
    assert model_input(chat_tokenizer, conversation, chat=True)[:3] == chat_tokenizer("<s>9")["input_ids"][:3]
    assert model_input(chat_tokenizer, "1+2=", chat=False) == "1+2="
    with pytest.raises(ValueError, match="needs the chat template"):
        model_input(chat_tokenizer, conversation, chat=False)
    assert uses_chat(chat_tokenizer, None) and not uses_chat(chat_tokenizer, False)


def test_chat_true_needs_a_template():
    from rollcorr.models.builtin import load_model

    _, tokenizer = load_model("builtin")
    assert not uses_chat(tokenizer, None)
    with pytest.raises(ValueError, match="no chat template"):
        uses_chat(tokenizer, True)


def test_the_sampler_and_the_evaluator_send_the_same_templated_ids(chat_tokenizer, tmp_path):
    """Training prompts and evaluation prompts go through one function: the rollout's prompt ids are the
    template's ids, for text and for conversation prompts."""
    from rollcorr.engines import SamplingParams, make_sampler
    from rollcorr.train.eval import GreedyEvaluator
    from rollcorr.train.source import RolloutSource

    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": [{"role": "user", "content": "4+4="}], "answer": "8"}] * 5
    task = DataTask(_write_jsonl(tmp_path / "d.jsonl", rows))
    sampler = make_sampler("hf:fp32")
    sampler.tokenizer = chat_tokenizer
    params = SamplingParams(max_new_tokens=3, temperature=1.0)
    source = RolloutSource(sampler, task, chat_tokenizer, params, prompts_per_step=4, group_size=2, seed=0, chat=True)
    rollout = source.sample(0)
    for row in range(rollout.batch_size):
        prompt = rollout.meta[row]["prompt"]
        got = rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist()
        assert got == template_ids(chat_tokenizer, messages_of(prompt))
    evaluator = GreedyEvaluator(sampler, task, chat_tokenizer, 10, 3, seed=0, chat=True)
    assert evaluator.renderer.prompt(evaluator.items[0]["prompt"]) == template_ids(chat_tokenizer,
                                                                                  messages_of(evaluator.items[0]["prompt"]))
    assert len(evaluator.items) == 1  # every 10th row of 10 is held out: one, once


def test_the_example_data_is_what_its_script_writes(tmp_path):
    import runpy
    import shutil

    shutil.copy(ROOT / "examples/arithmetic/make_data.py", tmp_path)
    runpy.run_path(str(tmp_path / "make_data.py"), run_name="__main__")
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_text() == (ROOT / "examples/arithmetic" / name).read_text()
    train = {json.loads(line)["prompt"] for line in (ROOT / "examples/arithmetic/train.jsonl").read_text().splitlines()}
    held = {json.loads(line)["prompt"] for line in (ROOT / "examples/arithmetic/eval.jsonl").read_text().splitlines()}
    assert len(train) == 200 and len(held) == 40 and not train & held
