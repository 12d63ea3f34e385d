import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollcorr.tasks import AdditionTask, ChainTask, DataTask, Task, make_task, rewards
from rollcorr.tasks.addition import is_test_pair, reversed_sum


def test_addition_items_and_reward():
    task = AdditionTask(digits=3)
    items = task.sample(50, seed=0)
    for item in items:
        a, b = item["a"], item["b"]
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert item["prompt"] == f"{a}+{b}="
        assert int(item["answer"][::-1]) == a + b
        assert task.reward(item, item["answer"]) == 1.0
        assert task.reward(item, item["answer"] + " \n") == 1.0
        assert task.reward(item, str(a + b)) == (1.0 if str(a + b) == item["answer"] else 0.0)
        assert task.reward(item, "") == 0.0
    assert isinstance(task, Task)


def test_reversed_sum_is_least_significant_first():
    assert reversed_sum(123, 456) == "975"
    assert reversed_sum(999, 1) == "0001"


def test_format_reward_only_for_wrong_digit_strings():
    task = AdditionTask(digits=2, format_reward=0.1)
    item = task.item(12, 34)
    assert task.reward(item, "64") == 1.0
    assert task.reward(item, "65") == pytest.approx(0.1)
    assert task.reward(item, "6a") == 0.0


def test_sampling_is_deterministic_and_splits_are_disjoint():
    task = AdditionTask(digits=3)
    assert task.sample(20, seed=3) == task.sample(20, seed=3)
    assert task.sample(20, seed=3) != task.sample(20, seed=4)
    train = task.sample(300, seed=1, split="train")
    test = task.sample(300, seed=1, split="test")
    assert all(not is_test_pair(i["a"], i["b"]) for i in train)
    assert all(is_test_pair(i["a"], i["b"]) for i in test)
    assert not {i["prompt"] for i in train} & {i["prompt"] for i in test}
    # the split must not depend on the answer: both splits see every last digit and carries
    for items in (train, test):
        assert {i["answer"][0] for i in items} == set("0123456789")
        assert {len(i["answer"]) for i in items} == {3, 4}
    share = sum(is_test_pair(a, b) for a in range(100, 160) for b in range(100, 160)) / 60**2
    assert 0.07 < share < 0.13


@settings(deadline=None, max_examples=25)
@given(digits=st.integers(1, 6), seed=st.integers(0, 10_000))
def test_answers_are_reversed_sums(digits, seed):
    task = AdditionTask(digits=digits)
    for item in task.sample(5, seed=seed, split="test"):
        a, b = item["a"], item["b"]
        assert len(str(a)) == digits and len(str(b)) == digits
        assert item["answer"] == str(a + b)[::-1]


def test_bad_arguments():
    with pytest.raises(ValueError, match="digits"):
        AdditionTask(digits=0)
    with pytest.raises(ValueError, match="split"):
        AdditionTask().sample(1, seed=0, split="val")
    with pytest.raises(ValueError, match="non-negative"):
        AdditionTask().sample(-1, seed=0)
    with pytest.raises(ValueError, match="2 items but 1 responses"):
        rewards(AdditionTask(), AdditionTask().sample(2, 0), ["1"])


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_task_exact_reward_and_split(tmp_path):
    path = write(
        tmp_path / "d.jsonl", [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(20)] + [""]
    )
    task = DataTask(path)
    assert len(task.items) == 20
    train, test = task.sample(40, seed=0), task.sample(40, seed=0, split="test")
    assert {i["prompt"] for i in test} <= {"q9", "q19"}
    assert not {i["prompt"] for i in train} & {"q9", "q19"}
    assert task.sample(5, seed=2) == task.sample(5, seed=2)
    item = train[0]
    assert task.reward(item, f" {item['answer']} ") == 1.0
    assert task.reward(item, item["answer"] + "0") == 0.0


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "line 2: invalid JSON"),
        ('["a", "b"]', "line 2: expected a JSON object"),
        ('{"prompt": "x"}', "line 2: no field 'answer'"),
        ('{"prompt": "", "answer": "1"}', "line 2: field 'prompt' must be a non-empty string"),
    ],
)
def test_jsonl_invalid_lines_name_the_line(tmp_path, bad, message):
    path = write(tmp_path / "d.jsonl", ['{"prompt": "a", "answer": "1"}', bad])
    with pytest.raises(ValueError, match=message):
        DataTask(path)


def test_jsonl_custom_reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(
        "def contains(item, text):\n    return 0.5 if item['answer'] in text else 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path / "d.jsonl", ['{"prompt": "a", "answer": "42"}'])
    task = DataTask(path, reward="my_reward:contains")
    assert task.reward(task.items[0], "it is 42!") == 0.5
    assert task.reward(task.items[0], "no") == 0.0
    with pytest.raises(ValueError, match="no function 'missing'"):
        DataTask(path, reward="my_reward:missing")
    with pytest.raises(ValueError, match="cannot import"):
        DataTask(path, reward="no_such_module_xyz:f")
    with pytest.raises(ValueError, match="unknown reward 'fuzzy'"):
        DataTask(path, reward="fuzzy")
    sys.modules.pop("my_reward", None)


def test_make_task(tmp_path):
    assert make_task("addition").digits == 3
    assert make_task("addition:4").digits == 4
    path = write(tmp_path / "d.jsonl", ['{"prompt": "a", "answer": "1"}'])
    assert isinstance(make_task(str(path)), DataTask)
    with pytest.raises(ValueError, match="unknown task"):
        make_task("multiplication")
    with pytest.raises(ValueError, match="integer"):
        make_task("addition:x")
    with pytest.raises(FileNotFoundError):
        make_task(str(tmp_path / "missing.jsonl"))


# ---------------------------------------------------------------- the long-response task


def test_chain_items_are_running_sums_written_reversed():
    task = ChainTask(terms=35, digits=1, order=3)  # each digit the sum of the three before it, mod 10
    item = task.item(5, 5, 7)
    assert item["prompt"] == "5,5,7,"
    assert item["answer"].startswith("7,9,3,9,")  # 5+5+7 = 17 → 7; 5+7+7 = 19 → 9; 7+7+9 = 23 → 3; ...
    assert len(item["answer"]) == task.max_answer_tokens == 70
    wide = ChainTask(terms=14, digits=4, order=2)  # 4-digit Fibonacci, least significant digit first
    assert wide.item(7218, 1433)["prompt"] == "8127,3341,"
    assert wide.item(7218, 1433)["answer"].startswith("1568,4800,")  # 8651; (1433 + 8651) mod 10^4 = 0084
    # 99 + 1 = 100 → 00; 1 + 0 = 1 → "01" reversed; 0 + 1 = 1
    assert ChainTask(terms=3, digits=2, order=2).item(99, 1)["answer"] == "00,10,10,"
    for item in task.sample(20, seed=1):
        xs = [int(x[::-1]) for x in (item["prompt"] + item["answer"]).rstrip(",").split(",")]
        assert len(xs) == 38 and all(d == (a + b + c) % 10 for a, b, c, d in zip(xs, xs[1:], xs[2:], xs[3:]))
    with pytest.raises(ValueError, match="needs 3 starting numbers"):
        task.item(1, 2)
    shipped = ChainTask()  # order 1: x + (x mod 10) + 1, 4 digits
    assert shipped.item(377)["prompt"] == "7730,"
    assert shipped.item(377)["answer"].startswith("5830,1930,3930,")  # 385, 391, 393
    assert shipped.item(9999)["answer"].startswith("9000,")  # 9999 + 9 + 1 = 10009 → 0009
    assert shipped.max_answer_tokens == 70 and len(shipped.sample(1, seed=0)[0]["answer"]) == 70


def test_chain_reward_gives_partial_credit_per_number():
    task = ChainTask(terms=3, digits=2, order=2)
    item = {"answer": "12,34,56,"}
    assert task.reward(item, "12,34,56,") == 1.0
    assert task.reward(item, " 12,34,56\n") == 1.0  # surrounding whitespace and the last comma optional
    assert task.reward(item, "12,34,50,") == 2 / 3  # one digit wrong: that number scores 0
    assert task.reward(item, "02,34,56,") == 2 / 3  # numbers are compared position by position
    assert task.reward(item, "12,34,") == 2 / 3  # a number missing
    assert task.reward(item, "12,3,56,") == 2 / 3  # a digit missing inside a number
    assert task.reward(item, "12,340,56,") == 2 / 3  # a digit too many inside a number
    assert task.reward(item, "12,34,56,78,") == 3 / 4  # an extra number adds to the denominator
    assert task.reward(item, "1x,34,56,") == 2 / 3  # a non-digit
    assert task.reward(item, "21,43,65,") == 0.0  # written most significant first
    assert task.reward(item, "") == 0.0
    shipped = ChainTask()  # one early slip derails the chain: every later number is wrong too
    answer = shipped.item(377)["answer"]
    assert answer.startswith("5830,1930,3930,")
    slipped = "5830,1940," + shipped.item(491)["answer"][:60]  # rule-following from the slip
    assert shipped.reward({"answer": answer}, slipped) == 1 / 14
    assert shipped.reward({"answer": answer}, answer[:-5]) == 13 / 14  # cut before the last number


def test_chain_splits_are_disjoint_and_deterministic():
    task = ChainTask(terms=35, digits=1, order=3)
    train = {i["prompt"] for i in task.sample(300, seed=0)}
    test = {i["prompt"] for i in task.sample(100, seed=0, split="test")}
    assert not train & test
    assert task.sample(5, seed=3) == task.sample(5, seed=3) != task.sample(5, seed=4)


def test_make_task_chain():
    assert make_task("chain").terms == 14 and make_task("chain").name == "chain"
    assert make_task("chain:20").terms == 20 and make_task("chain:20").name == "chain:20"
    assert isinstance(make_task("chain"), Task)
    with pytest.raises(ValueError, match="chain: the number after ':' must be an integer"):
        make_task("chain:x")
    with pytest.raises(ValueError, match="terms must be an int"):
        ChainTask(terms=0)
    with pytest.raises(ValueError, match="order must be an int"):
        ChainTask(order=0)
