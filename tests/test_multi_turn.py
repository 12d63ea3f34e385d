"""Multi-turn trajectories (docs/multi-turn.md): one Rollout type for one turn or many, the environment's tokens
appended as sampled and never trained, the learner scoring what the sampler sampled in the same context."""

from __future__ import annotations

import math

import pytest
import torch

from rollcorr.engines import SamplingParams, make_learner, make_sampler
from rollcorr.envs import Episodes, Limits, Renderer, SingleTurn, Turn, make_env, play, register_env
from rollcorr.rollout import Rollout
from rollcorr.tasks import make_task

CHAIN = "builtin:chain"
TURNS = SamplingParams(max_new_tokens=35, temperature=0.7, seed=5)  # chain_turns.yaml's: 7 numbers a turn


@pytest.fixture(scope="module")
def chain_sampler():
    return make_sampler("hf:fp32", CHAIN)


@pytest.fixture(scope="module")
def trajectories(chain_sampler):
    """Two-turn trajectories of the checkpoints environment on the chain model (4 items × 2 responses)."""
    env = make_env(make_task("chain"), {"name": "checkpoints", "every": 7})
    items = [it for it in env.sample(4, seed=3) for _ in range(2)]
    return play(chain_sampler, env, items, Renderer(chain_sampler.tokenizer, chat=False), TURNS,
                group_ids=[i // 2 for i in range(8)])


# ---- the Rollout: observations appended, turns counted --------------------------------------------------------


def _one_row(ids: list[int]) -> Rollout:
    n = len(ids)
    return Rollout(prompt_ids=torch.tensor([[5, 6]]), prompt_mask=torch.ones(1, 2, dtype=torch.bool),
                   response_ids=torch.tensor([ids]), response_mask=torch.ones(1, n, dtype=torch.bool),
                   rollout_log_prob=-torch.rand(1, n), version=torch.zeros(1, n, dtype=torch.long),
                   group_ids=torch.zeros(1, dtype=torch.long), meta=[{"finished": True}])


def test_observations_are_appended_as_the_environments_tokens():
    rollout = _one_row([7, 8, 2]).with_observations({0: [9, 9]}, version=3)
    assert rollout.response_ids.tolist() == [[7, 8, 2, 9, 9]]
    assert rollout.response_mask.tolist() == [[True, True, True, False, False]]
    assert rollout.observation_mask.tolist() == [[False, False, False, True, True]]
    assert rollout.token_mask.all() and rollout.attention_mask.all()
    assert rollout.rollout_log_prob[0, 3:].tolist() == [0.0, 0.0] and rollout.version[0, 3:].tolist() == [3, 3]
    assert rollout.turn.tolist() == [[0, 0, 0, 0, 0]]  # the observation answers turn 0
    assert rollout.next_turn() == [1] and rollout.meta[0]["finished"] is False
    assert rollout.turns.tolist() == [1]  # one model turn so far
    with pytest.raises(ValueError, match="both as the model's"):
        rollout.replace(observation_mask=rollout.response_mask)


def test_concat_fills_a_single_turn_batch_with_no_observations():
    one = _one_row([7, 2])
    many = _one_row([7, 8, 2]).with_observations({0: [9]}, version=0)
    both = Rollout.concat([one, many])
    assert both.observation_mask.tolist() == [[False, False, False, False], [False, False, False, True]]
    assert both.turn.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0]]


# ---- the sampler continues after an observation -------------------------------------------------------------


def test_the_sampler_continues_after_the_observation_in_a_new_turn(chain_sampler):
    first = chain_sampler.generate(["7730,"], SamplingParams(max_new_tokens=10, temperature=0.0))
    assert first.meta[0]["finished"]  # two numbers: the turn's cap
    first = first.replace(observation_mask=torch.zeros_like(first.response_mask), turn=torch.zeros_like(first.response_ids))
    said = first.with_observations({0: chain_sampler.tokenizer("5830,")["input_ids"]}, version=0)
    chain_sampler.version = 4
    try:
        second = chain_sampler.generate(None, SamplingParams(max_new_tokens=10, temperature=0.0), resume=said)
    finally:
        chain_sampler.version = 0
    valid = second.token_mask[0]
    n_first = int(first.response_mask.sum())
    assert second.response_ids[0, : n_first + 5].tolist() == said.response_ids[0, : n_first + 5].tolist()
    new = slice(n_first + 5, int(valid.sum()))
    assert second.response_mask[0, new].all() and not second.observation_mask[0, new].any()
    assert second.turn[0, new].eq(1).all() and second.version[0, new].eq(4).all()  # the weights that wrote them
    assert new.stop - new.start == 10  # a full turn's budget after the observation
    # greedy: the continuation is the one a single sequence with that context gives
    context = said.prompt_ids[0].tolist() + said.response_ids[0, : n_first + 5].tolist()
    alone = chain_sampler.generate([context], SamplingParams(max_new_tokens=10, temperature=0.0))
    assert second.response_ids[0, new].tolist() == alone.response_ids[0, :10].tolist()


# ---- episodes ----------------------------------------------------------------------------------------------


def test_a_checkpoints_trajectory_has_two_turns_and_its_rewards_sum(trajectories, chain_sampler):
    rollout = trajectories
    assert rollout.turns.tolist() == [2] * 8
    assert all(m["turns"] == 2 and len(m["turn_rewards"]) == 2 and not m["cut"] for m in rollout.meta)
    assert torch.allclose(rollout.rewards, torch.tensor([sum(m["turn_rewards"]) for m in rollout.meta]))
    tok = chain_sampler.tokenizer
    for i, m in enumerate(rollout.meta):  # the observation: the right 7th number, as its own tokens
        observed = rollout.response_ids[i][rollout.observation_mask[i]].tolist()
        assert observed == tok(m["answer"].split(",")[6] + ",")["input_ids"]
        first = tok.decode(rollout.response_ids[i][rollout.response_mask[i] & (rollout.turn[i] == 0)].tolist(),
                           skip_special_tokens=True)
        right = sum(g == w for g, w in zip(first.rstrip(",").split(","), m["answer"].split(",")[:7]))
        assert m["turn_rewards"][0] == pytest.approx(right / 14)


def test_the_learner_scores_each_turn_as_the_sampler_sampled_it(trajectories):
    """Turn 2 was sampled with turn 1 and the observation as context; the learner, attending to the observation
    tokens, gives its tokens the sampler's probabilities to the fp32 pair's agreement (test_engines_hf's bounds)."""
    rollout, learner = trajectories, make_learner("hf:fp32", CHAIN)
    log_pi = learner.log_prob(rollout, temperature=0.7)
    mask = rollout.response_mask
    gap = ((log_pi.exp() - (rollout.rollout_log_prob + rollout.log_kept_mass).exp())[mask]).abs()
    assert (rollout.turn[mask] == 1).sum() > 100
    assert (gap < 1e-3).float().mean() >= 0.999 and gap.max() < 1e-2
    assert (log_pi[rollout.observation_mask] == 0).all()  # the environment's tokens are not scored
    # without the observation as context the second turn is another sequence: the scores move
    blind = rollout.replace(observation_mask=None, turn=None)
    moved = (learner.log_prob(blind, temperature=0.7) - log_pi)[mask & (rollout.turn == 1)].abs()
    assert moved.max() > 1e-2


def _train_step(rollout):
    from rollcorr.train.build import build_proximal, build_step_config
    from rollcorr.train.config import load_config
    from rollcorr.train.step import train_step

    config = load_config("chain_turns", ["trainer.mini_batches=1", "algorithm.correction.preset=decoupled_seq_is_rs"])
    torch.manual_seed(0)
    learner = make_learner("hf:fp32", CHAIN)
    optimizer = torch.optim.AdamW(learner.model.parameters(), lr=1e-3)
    proximal = build_proximal(config)
    proximal.on_publish(0, learner.model)
    result = train_step(rollout, learner, optimizer, proximal, build_step_config(config), version=0)
    return result.metrics, {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


@pytest.mark.parametrize("fill", [0.0, 1.0, math.nan])
def test_the_environments_log_probs_change_no_weight_loss_or_metric(trajectories, fill):
    """Flash-RL's open bug: the tool tokens' log-probs filled with 1 leaked e^-1 ratios into the loss. Here the
    environment's tokens are outside every mask: whatever their log-probs hold, the step is the same."""
    rollout = trajectories.replace(rewards=(torch.arange(8) % 2).float())
    reference_metrics, reference_weights = _train_step(rollout)
    filled = rollout.rollout_log_prob.masked_fill(rollout.observation_mask, fill)
    metrics, weights = _train_step(rollout.replace(rollout_log_prob=filled))
    timing = {k for k in metrics if k.startswith(("time/", "memory/", "proximal/seconds"))}
    assert {k: v for k, v in metrics.items() if k not in timing} == pytest.approx(
        {k: v for k, v in reference_metrics.items() if k not in timing}, nan_ok=True)
    for name, value in weights.items():
        assert torch.equal(value, reference_weights[name]), name


# ---- the one-turn case is the same path ----------------------------------------------------------------------


def test_a_task_is_a_one_turn_environment():
    task = make_task("addition")
    env = make_env(task, None)
    assert isinstance(env, SingleTurn) and env.max_turns == 1
    item = task.sample(1, seed=0)[0]
    assert env.reset(item).step(item["answer"]) == Turn(reward=1.0, done=True)
    sampler = make_sampler("hf:fp32")
    rollout = play(sampler, env, [item] * 2, Renderer(sampler.tokenizer, chat=False), SamplingParams(max_new_tokens=5))
    assert rollout.observation_mask is None and rollout.turn is None  # nothing downstream sees a trajectory
    assert rollout.rewards.tolist() == [task.reward(item, m["response_text"]) for m in rollout.meta]


def test_limits_cut_an_episode_and_say_so():
    class Echo:  # answers every turn, never done
        name, max_turns = "echo", 10

        def sample(self, n, seed, split="train"):
            return [{"prompt": "12+34="}] * n

        held_out = sample

        def reset(self, item):
            return type("E", (), {"prompt": item["prompt"], "step": lambda self, text: Turn("1+1=", 0.25)})()

    sampler = make_sampler("hf:fp32")
    renderer, params = Renderer(sampler.tokenizer, chat=False), SamplingParams(max_new_tokens=4)
    by_turns = play(sampler, Echo(), [{"prompt": "12+34="}], renderer, params, limits=Limits(max_turns=3))
    assert by_turns.meta[0]["turns"] == 3 and by_turns.meta[0]["cut"] and by_turns.rewards.tolist() == [0.75]
    by_tokens = play(sampler, Echo(), [{"prompt": "12+34="}], renderer, params, limits=Limits(max_tokens=14))
    assert by_tokens.token_mask.sum() <= 14 and by_tokens.meta[0]["cut"]


def test_the_registry_names_environments_and_refuses_unknown_ones():
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        make_env(make_task("chain"), {"name": "nope"})
    with pytest.raises(ValueError, match="environment 'checkpoints': .*unexpected keyword"):
        make_env(make_task("chain"), {"name": "checkpoints", "evry": 7})
    with pytest.raises(ValueError, match="checkpoints plays the chain task"):
        make_env(make_task("addition"), {"name": "checkpoints"})
    register_env("one_more", lambda task: SingleTurn(task))
    assert isinstance(make_env(make_task("addition"), {"name": "one_more"}), SingleTurn)


def test_episodes_of_one_batch_keep_their_own_state():
    env = make_env(make_task("chain"), {"name": "checkpoints", "every": 5})
    item = env.sample(1, seed=0)[0]
    episodes = Episodes(env, [item, item], Renderer(make_sampler("hf:fp32", CHAIN).tokenizer, chat=False))
    first, second = episodes.episodes
    first.step("")
    assert first.done_numbers == 5 and second.done_numbers == 0


# ---- per-turn advantages -------------------------------------------------------------------------------------


def test_turn_advantages_compare_each_turns_reward_to_go_within_its_group():
    from rollcorr.advantages import grpo_advantages, rewards_to_go, turn_advantages

    turn_rewards = torch.tensor([[0.2, 0.5], [0.1, 0.0], [0.3, 9.0], [0.4, 0.4]])  # row 2 has one turn: 9.0 unused
    turns, groups = torch.tensor([2, 2, 1, 2]), torch.tensor([0, 0, 0, 1])
    togo = rewards_to_go(turn_rewards, turns)
    assert torch.allclose(togo, torch.tensor([[0.7, 0.5], [0.1, 0.0], [0.3, 0.0], [0.8, 0.4]]))
    turn = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 1]])
    mask = torch.ones(4, 4, dtype=torch.bool)
    adv, used = turn_advantages("grpo", turn_rewards, turns, groups, turn, mask)
    first = grpo_advantages(torch.tensor([0.7, 0.1, 0.3]), torch.zeros(3, dtype=torch.long)).tolist()  # turn 0
    second = grpo_advantages(torch.tensor([0.5, 0.0]), torch.zeros(2, dtype=torch.long)).tolist()  # turn 1: rows 0, 1
    assert adv[0].tolist() == pytest.approx([first[0], first[0], second[0], second[0]])
    assert adv[1].tolist() == pytest.approx([first[1], second[1], second[1], second[1]])
    assert adv[2].tolist() == pytest.approx([first[2]] * 4)
    assert adv[3].tolist() == [0.0] * 4  # alone in its group: no baseline, advantage 0
    assert used.all()


# ---- a publish inside a trajectory: two versions, every π_old strategy ----------------------------------------

STRATEGIES = ["recompute", "bypass", "snapshot", "old_logit_model", "interrupt", "loglinear", "linear", "ewma"]
EXACT = ("snapshot", "old_logit_model", "interrupt")  # they keep or score the weights that sampled each token


def test_a_publish_mid_trajectory_gives_two_versions_and_every_pi_old_strategy_handles_it(float64_reference):
    """The sample source plays a batch a sampler call at a time; new weights loaded between two calls (what the
    async executor does with partial rollouts) draw the rest of the turn, the observation's continuation and
    the next turn. Every strategy then gives π_old on the model's tokens, 0 on the environment's, whatever the
    environment's log-probs hold; the exact ones give each token the old logits of the version that drew it."""
    from rollcorr.proximal import make_proximal
    from rollcorr.train.source import RolloutSource, sample_batch
    from test_proximal import assert_exact_old_logits

    learner = make_learner("hf:fp32", CHAIN)
    strategies = {n: make_proximal(n, max_staleness=2) for n in STRATEGIES}
    states = {0: {k: v.clone() for k, v in learner.model.state_dict().items()}}
    for s in strategies.values():
        s.on_publish(0, learner.model)
    env = make_env(make_task("chain"), {"name": "checkpoints", "every": 7})
    sampler = make_sampler("hf:fp32", CHAIN)
    source = RolloutSource(sampler, env, sampler.tokenizer, TURNS, prompts_per_step=2, group_size=2, seed=0)
    source.listeners.append(lambda chunk: strategies["old_logit_model"].submit(chunk, learner))

    def publish(partial: Rollout) -> bool:  # between the first two sampler calls only
        if states.keys() == {0}:
            strategies["interrupt"].before_publish(learner, [partial])
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in learner.model.parameters():
                    p.add_(0.02 * torch.randn(p.shape, generator=g))
            states[1] = {k: v.clone() for k, v in learner.model.state_dict().items()}
            for s in strategies.values():
                s.on_publish(1, learner.model)
            source.load_weights(learner.state_dict(), 1)
        return True

    rollout = sample_batch(source, 0, chunk_tokens=20, between_chunks=publish)
    mask, observed = rollout.response_mask, rollout.observation_mask
    assert rollout.turns.tolist() == [2] * 4 and observed.any(1).all()
    for row in range(4):  # turn 0 started with v0; everything after the publish is v1
        assert set(rollout.version[row][mask[row]].tolist()) == {0, 1}
        assert rollout.version[row][mask[row] & (rollout.turn[row] == 1)].eq(1).all()
    filled = rollout.replace(rollout_log_prob=rollout.rollout_log_prob.masked_fill(observed, math.nan))
    for name, strategy in strategies.items():
        got = strategy.old_log_prob(rollout, learner, 1).old_log_prob
        assert torch.isfinite(got[mask]).all() and (got[~mask] == 0).all(), name
        again = strategy.old_log_prob(filled, learner, 1).old_log_prob
        assert torch.equal(again[mask], got[mask]) and (again[~mask] == 0).all(), name
        if name in EXACT:
            assert_exact_old_logits(got, states, learner.model, rollout, float64_reference)
    strategies["old_logit_model"].close()


# ---- the trainer: every executor plays trajectories ---------------------------------------------------------

SMALL = ["trainer.steps=2", "trainer.eval_every=0", "rollout.prompts_per_step=4", "rollout.group_size=2",
         "trainer.progress=false", "trainer.tensorboard=false", "trainer.plot=false"]


def _turns(run_dir) -> list[float]:
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["env/turns_mean"] for r in map(json.loads, lines) if "env/turns_mean" in r]


@pytest.mark.parametrize("mode", [["trainer.mode=sync"], ["trainer.mode=simulated_async"],
                                  ["trainer.mode=async", "trainer.partial_rollouts=true",
                                   "trainer.partial_chunk_tokens=10"]], ids=["sync", "simulated_async", "async"])
def test_the_trainer_trains_on_trajectories_in_every_mode(tmp_path, mode):
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import run

    result = run(load_config("chain_turns", [*SMALL, *mode, f"trainer.out={tmp_path / 'run'}",
                                             "algorithm.advantage_level=turn"]))
    assert result.stopped is None and _turns(tmp_path / "run") == [2.0, 2.0]


def test_data_parallel_ranks_play_their_share_of_the_trajectories(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rollcorr", "train", "--config", "chain_turns", *SMALL,
                           "trainer.ranks=2", f"trainer.out={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _turns(tmp_path / "run") == [2.0, 2.0]


@pytest.mark.slow
@pytest.mark.ray
def test_ray_workers_play_trajectories_with_partial_rollouts(tmp_path):
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import run

    result = run(load_config("chain_turns", [*SMALL, "trainer.steps=3", "trainer.executor=ray", "trainer.ray_workers=1",
                                             "trainer.mode=async", "trainer.partial_rollouts=true",
                                             "trainer.partial_chunk_tokens=10", f"trainer.out={tmp_path / 'run'}"]))
    assert result.stopped is None and _turns(tmp_path / "run") == [2.0, 2.0, 2.0]


def test_workers_step_episodes_side_by_side_and_errors_name_their_row():
    """``task.env.workers``: four episodes that each wait at a barrier for the other three pass only when they
    are stepped at the same time; a failing one is named by its own row."""
    import threading

    from rollcorr.user_code import UserCodeError

    barrier = threading.Barrier(4, timeout=60)

    class Meet:
        name, max_turns = "meet", 2

        def sample(self, n, seed, split="train"):
            return [{"prompt": "12+34=", "row": i} for i in range(n)]

        held_out = sample

        def reset(self, item):
            return MeetEpisode(item["row"])

    class MeetEpisode:
        def __init__(self, row):
            self.prompt, self.row = "12+34=", row

        def step(self, text):
            barrier.wait()
            if self.row == 2 and self.fail:
                raise RuntimeError("tool down")
            return Turn(reward=0.5, done=True)

    sampler = make_sampler("hf:fp32")
    renderer, params = Renderer(sampler.tokenizer, chat=False), SamplingParams(max_new_tokens=3)
    MeetEpisode.fail = False
    rollout = play(sampler, Meet(), Meet().sample(4, 0), renderer, params, limits=Limits(workers=4))
    assert rollout.rewards.tolist() == [0.5] * 4
    MeetEpisode.fail = True
    with pytest.raises(UserCodeError, match=r"^environment 'meet' \(step\) on row 2 of the batch .*RuntimeError: tool down"):
        play(sampler, Meet(), Meet().sample(4, 0), renderer, params, limits=Limits(workers=4))


@pytest.mark.slow
def test_the_slow_environment_benchmark_runs_and_prints_its_ratios():
    """benchmarks/bench_multi_turn.py at its smallest: its table holds a ratio per workers setting (the slow
    environment is a plugin module every process of an async run imports)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "bench_multi_turn.py", "--runs", "1", "--steps", "3", "--wait", "0.01"],
                          cwd=root / "benchmarks", capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| one") or line.startswith("| 8")]
    assert len(rows) == 2 and all(float(row.split("|")[-2]) > 0 for row in rows)
