"""Rewards as TRL users write them (#50): ``task.reward`` as a list with ``task.reward_weights``, functions in TRL's
batched signature ``fn(completions, **columns)``, each reward logged on its own — a task-level reward that the
one-turn environment calls through the one door for user code, as it calls a single reward."""

import json
import math

import pytest

from rollcorr.tasks import DataTask, make_task, register_reward
from rollcorr.tasks.base import rewards
from rollcorr.tasks.reward_list import CompositeReward, RewardTerm, trl_columns
from rollcorr.user_code import UserCodeError

ITEMS = [{"prompt": "12+7=", "answer": "19", "level": "easy"}, {"prompt": "30+4=", "answer": "34", "level": "hard"},
         {"prompt": "6+21=", "answer": "27", "level": "easy"}]
TEXTS = ["19", "33 is it", "27"]


def exact(item, text):
    return 1.0 if text.strip() == item["answer"] else 0.0


def short(completions, **kwargs):
    """TRL's signature: one value per completion, from the completions alone."""
    return [1.0 if len(c) <= 2 else 0.0 for c in completions]


def easy_only(completions, level, answer):
    """Scores the easy rows only (None elsewhere, as a TRL reward for one kind of row); names its columns."""
    return [float(c.startswith(a)) if lvl == "easy" else None for c, lvl, a in zip(completions, level, answer)]


def test_a_reward_list_is_the_weighted_sum_by_hand_and_keeps_each_function():
    reward = CompositeReward([RewardTerm("exact", exact, 1.0), RewardTerm("short", short, 0.5),
                              RewardTerm("easy_only", easy_only, 2.0)])
    got = [reward.parts(item, text) for item, text in zip(ITEMS, TEXTS)]
    assert [g[0] for g in got] == [1.0 + 0.5 + 2.0, 0.0, 1.0 + 0.5 + 2.0]  # row 1: easy_only's None left out
    assert got[0][1] == {"exact": 1.0, "short": 1.0, "easy_only": 1.0}
    assert got[1][1]["exact"] == 0.0 and math.isnan(got[1][1]["easy_only"])
    assert reward.reward_range == (0.0, 3.5)
    assert CompositeReward([RewardTerm("a", exact, 1.0), RewardTerm("b", exact, -0.5)]).reward_range == (-0.5, 1.0)


def test_trls_columns_reach_a_batched_function():
    columns = trl_columns(ITEMS, TEXTS, [[1, 2], [3], [4, 5]])
    assert columns["prompts"] == [i["prompt"] for i in ITEMS] and columns["completions"] == TEXTS
    assert columns["answer"] == ["19", "34", "27"] and columns["level"] == ["easy", "hard", "easy"]
    assert columns["completion_ids"] == [[1, 2], [3], [4, 5]] and "prompt" not in columns
    chat = trl_columns([{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}], ["hello"])
    assert chat["completions"] == [[{"role": "assistant", "content": "hello"}]]  # TRL's conversational form


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_data_task_takes_the_list_its_weights_and_checks_every_value(tmp_path):
    register_reward("test_short", short)
    data = write_rows(tmp_path / "d.jsonl", ITEMS * 4)
    task = make_task(str(data), ["exact", "test_short"], reward_weights=[1.0, 0.5])
    assert isinstance(task, DataTask) and task.reward_list.names == ("exact", "test_short")
    assert task.reward(ITEMS[0], "19") == 1.5 and task.reward_range == (0.0, 1.5)
    assert task.reward_parts(ITEMS[1], "33 is it") == (0.0, {"exact": 0.0, "test_short": 0.0})
    # the door for user code, with the list's range: 1.5 is a reward here, not "outside [0, 1]"
    assert rewards(task, ITEMS, TEXTS) == [1.5, 0.0, 1.5]
    single = make_task(str(data), "exact")
    assert single.reward_list is None and not hasattr(single, "reward_parts")

    def too_big(completions, **kwargs):
        return [2.0] * len(completions)

    def none_at_all(completions, **kwargs):
        return [None] * len(completions)

    def one_for_all(completions, **kwargs):
        return [1.0, 1.0]

    for fn, said in ((too_big, "reward 'too_big' returned 2, outside [0, 1]"),
                     (none_at_all, "no reward scored the response to '12+7='"),
                     (one_for_all, "a batched reward returns a list of one number (or None) per completion")):
        register_reward(fn.__name__, fn)
        bad = make_task(str(data), [fn.__name__] if fn is none_at_all else ["exact", fn.__name__])
        with pytest.raises(UserCodeError) as err:
            rewards(bad, ITEMS, TEXTS)
        assert said in str(err.value) and "reward list [" in str(err.value) and "\n" not in str(err.value)
    clipped = make_task(str(data), ["exact", "too_big"], reward_clip=True)  # task.reward_clip: each value clipped
    assert rewards(clipped, ITEMS, TEXTS) == [2.0, 1.0, 2.0]


def test_a_function_of_the_list_that_raises_is_one_line_naming_its_file(tmp_path, monkeypatch):
    """A function of the list that raises goes through the one door: one line naming the list, the row and the
    place in the user's file that raised; the functions before it are not a partial reward."""
    (tmp_path / "raising_rewards.py").write_text("def boom(completions, **kwargs):\n    raise KeyError('solution')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = write_rows(tmp_path / "d.jsonl", ITEMS * 4)
    task = make_task(str(data), ["exact", "raising_rewards:boom"])
    with pytest.raises(UserCodeError) as err:
        rewards(task, ITEMS, TEXTS)
    said = str(err.value)
    assert said.startswith("reward list ['exact', 'raising_rewards:boom'] on row 0 of ") and "\n" not in said
    assert "KeyError: 'solution' (raising_rewards.py:2)" in said, said


def test_the_config_reads_a_reward_list_and_refuses_what_does_not_fit(tmp_path):
    from rollcorr.train.build import build_task
    from rollcorr.train.config import ConfigError, load_config

    data = write_rows(tmp_path / "d.jsonl", ITEMS * 4)
    config = load_config(None, [f"task.name={data}", "task.reward=[exact, last_number]", "task.reward_weights=[1, 0.5]"])
    assert config.task.reward == ["exact", "last_number"] and config.task.reward_weights == [1.0, 0.5]
    assert config.task.build().reward_list.names == ("exact", "last_number")
    for overrides, said in ((["task.reward=[exact, last_number]", "task.reward_weights=[1]"],
                             "task.reward_weights: 1 weights for 2 rewards"),
                            (["task.reward=[exact, nope]"], "task.reward: unknown reward 'nope'"),
                            (["task.reward=[exact, exact]"], "task.reward: a reward list names each function once"),
                            (["task.reward_weights=[1, x]"], "task.reward_weights: expected a list of finite numbers")):
        with pytest.raises(ConfigError) as err:
            build_task(load_config(None, [f"task.name={data}", *overrides]))
        assert str(err.value).startswith(said), str(err.value)
    with pytest.raises(ConfigError, match="task.reward_weights applies to a data set"):
        build_task(load_config(None, ["task.reward_weights=[1]"]))


def test_a_run_logs_each_reward_of_the_list(tmp_path, addition_model_dir):
    """The run's one-turn environment scores through the list; each function's mean is a metric of every step
    and the step's reward is their weighted sum."""
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import run

    register_reward("test_short", short)
    items = make_task("addition:1").sample(40, seed=0, split="train")
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": i["prompt"], "answer": i["answer"]} for i in items])
    config = load_config(None, [f"task.name={data}", "task.reward=[exact, test_short]", "task.reward_weights=[1, 0.5]",
                                "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
                                "task.eval_prompts=0", "trainer.progress=false", "trainer.plot=false",
                                "trainer.tensorboard=false", "trainer.steps=2", f"model.path={addition_model_dir}",
                                f"trainer.out={tmp_path / 'run'}"])
    run(config)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        # exact: every value a multiple of 0.5 over 16 responses, so each mean is a dyadic fraction in float32 and 64
        assert r["reward/mean"] == r["reward/exact/mean"] + 0.5 * r["reward/test_short/mean"]
        assert 0.0 <= r["reward/test_short/std"] <= 0.5
