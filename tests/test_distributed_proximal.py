"""π_old strategies that hold weights (snapshot, EWMA) or score through the live model (interrupt, loglinear,
linear) on two gloo ranks: the weights after three optimizer steps equal one process's on the same global
batches, each rank holds 1/N of the strategy's weight copies, and those copies survive a sharded checkpoint
read back at N=2 and at N=1 (and a one-process strategy state sharded onto two ranks)."""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import assert_as_accurate, assert_same_forward
from rollcorr.distributed.ranks import ONE_PROCESS, Ranks
from test_distributed_learner import (  # the two-rank harness's helpers
    NOISE_ONLY,
    SANITY_OF_UPDATE,
    WORLD,
    _free_port,
    learner_and_optimizer,
)

STEPS = 3
SMALL = ["rollout.prompts_per_step=4", "rollout.group_size=2", "task.eval_prompts=0", "optim.lr=0.003",
         "trainer.mini_batches=1", "trainer.max_staleness=2", "algorithm.name=grpo",
         "algorithm.correction.preset=decoupled_token_is"]
STRATEGIES = {  # name → overrides
    "snapshot": ["algorithm.proximal.name=snapshot"],
    "ewma": ["algorithm.proximal.name=ewma", "algorithm.proximal.beta=0.5"],
    "interrupt": ["algorithm.proximal.name=interrupt"],
    "loglinear": ["algorithm.proximal.name=loglinear"],
    "linear": ["algorithm.proximal.name=linear"],
}
HOLDS_WEIGHTS = ("snapshot", "ewma")


def _config(name: str):
    from rollcorr.train.config import load_config

    return load_config(None, SMALL + STRATEGIES[name])


def _rollouts(config) -> list:
    """Batch k: generated at version k but the last prompt's responses, at k − 1 (stale tokens, so π_old under
    each strategy differs from the live weights; rank 1 holds two versions, rank 0 one)."""
    from rollcorr.train.source import SourceSpec, sample_batch

    source = SourceSpec.from_config(config).build()
    out = []
    for k in range(STEPS + 1):
        rollout = sample_batch(source, k)
        version = torch.full_like(rollout.response_ids, k, dtype=torch.long)
        version[3 * rollout.batch_size // 4 :] = max(k - 1, 0)  # rank 1's second group: ranks differ in versions
        out.append(rollout.replace(version=version))
    return out


def _train(name: str, rollouts: list, ranks: Ranks = ONE_PROCESS, dtype=torch.float32):
    """(learner, optimizer, strategy) after ``STEPS`` train_steps, publishing after each step
    as the trainer does; interrupt scores the next batch's in-flight tokens before each step. ``dtype``: as
    ``learner_and_optimizer`` (float64: the one-process reference)."""
    from rollcorr.train.build import build_proximal, build_step_config
    from rollcorr.train.step import train_step

    config = _config(name)
    step_config, proximal = build_step_config(config), build_proximal(config)
    learner, optimizer = learner_and_optimizer(config, ranks, dtype)
    proximal.on_publish(0, learner.model)
    for step in range(STEPS):
        if proximal.pauses_sampler:
            proximal.before_publish(learner, [rollouts[step + 1]])
        train_step(rollouts[step], learner, optimizer, proximal, step_config, step,
                   generator=torch.Generator().manual_seed(0), ranks=ranks)
        proximal.on_publish(step + 1, learner.model)
    return learner, optimizer, proximal


def _full(learner) -> dict[str, torch.Tensor]:
    """The full weights (a sharded learner: gathered on rank 0, a collective)."""
    return {k: v.detach().clone() for k, v in learner.state_dict().items()}


def _held_full(proximal) -> dict[str, dict[str, torch.Tensor]]:
    """The strategy's weight copies as whole tensors (a collective for DTensor shards)."""
    return {
        key: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in copy.items()}
        for key, copy in proximal.held_weights().items()
    }


def _worker(rank: int, port: int, names: list[str], data: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from rollcorr.distributed import close, init_from_env

    try:
        _work(init_from_env("cpu"), names, data, out)
    finally:
        close()  # after the work's references to the group (models, the device mesh) are gone


def _work(ranks, names: list[str], data: str, out: str) -> None:
    from rollcorr.distributed.checkpoint import shard_held
    from rollcorr.train.build import build_proximal

    inputs = torch.load(data, weights_only=False)
    results = {}
    for name in names:
        learner, optimizer, proximal = _train(name, inputs["rollouts"][name], ranks)
        result = {"weights": _full(learner), "extra_bytes": proximal.extra_bytes,
                  "held": _held_full(proximal)}
        if name in HOLDS_WEIGHTS:
            # a sharded checkpoint of the held state, read back on two ranks: each rank's shards exactly
            run_dir = Path(inputs["tmp"]) / name
            state = {"step": STEPS, "proximal": proximal.state_dict()}
            checkpointer = ranks.checkpointer(learner, optimizer)  # the trainer's: ShardedCheckpointer
            path = checkpointer.save(run_dir, STEPS, state)
            saved = torch.load(path / "state.pt", weights_only=False)
            restored = build_proximal(_config(name))
            checkpointer.load(path, saved, restored)
            result["resumed_equal"] = all(
                torch.equal(a.to_local(), restored.held_weights()[key][k].to_local())
                for key, copy in proximal.held_weights().items() for k, a in copy.items() if hasattr(a, "to_local")
            )
            result["checkpoint"] = str(path)
            # a one-process strategy state, sharded onto the two ranks (trainer: shard_held after load)
            single = build_proximal(_config(name))
            single.load_state_dict(inputs["single_state"][name])
            shard_held(single.held_weights(), learner.model)
            result["from_one_process"] = _held_full(single)
            result["from_one_process_bytes"] = single.extra_bytes
        results[name] = result
    if ranks.is_main:
        torch.save(results, out)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _close(got: dict[str, torch.Tensor], established: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
           start: dict[str, torch.Tensor], what: str) -> None:
    """Two-rank weights ``got`` as close to the float64 run's ``reference`` as one process's ``established``
    are (test_distributed_learner's rule), whole and per tensor; the one-process run within
    ``SANITY_OF_UPDATE`` of the update from ``start`` (whole model)."""
    assert got.keys() == established.keys() == reference.keys(), what

    keys = list(reference)
    moved = float(torch.cat([(reference[k].double() - start[k].double()).flatten() for k in keys]).norm())
    assert_as_accurate([got[k] for k in keys], [established[k] for k in keys], [reference[k] for k in keys],
                       sanity=SANITY_OF_UPDATE * moved, what=f"{what} (whole model)")
    for k in keys:
        if not k.endswith(NOISE_ONLY):
            assert_as_accurate(got[k], established[k], reference[k], what=f"{what}: {k}")


def _check(names: list[str], float64_reference) -> None:
    """Each strategy trained in this process and on two ranks (float32), and in this process in float64 (the
    reference: see test_distributed_learner._check_equal)."""
    from rollcorr.engines import make_learner
    from rollcorr.train.build import build_proximal

    torch.set_num_threads(1)
    rollouts = {name: _rollouts(_config(name)) for name in names}
    reference = {}
    for name in names:
        learner, _, proximal = _train(name, rollouts[name])
        reference[name] = (_full(learner), proximal.extra_bytes, _held_full(proximal), proximal.state_dict())
    exact = {}
    with float64_reference():
        for name in names:
            learner, _, proximal = _train(name, rollouts[name], dtype=torch.float64)
            exact[name] = (_full(learner), _held_full(proximal))
    with tempfile.TemporaryDirectory() as tmp:
        data, out = os.path.join(tmp, "inputs.pt"), os.path.join(tmp, "ranks.pt")
        single_state = {name: reference[name][3] for name in names}
        torch.save({"rollouts": rollouts, "tmp": tmp, "single_state": single_state}, data)
        for name in names:
            (Path(tmp) / name).mkdir()  # the run folders the checkpoints go to
        mp.spawn(_worker, args=(_free_port(), names, data, out), nprocs=WORLD, join=True)
        sharded = torch.load(out, weights_only=False)
        w0 = make_learner("hf:fp32").model.state_dict()
        for name in names:
            weights, extra_bytes, held, _ = reference[name]
            weights64, held64 = exact[name]
            got = sharded[name]
            assert max(_relative(weights[k], w0[k]) for k in weights) > 1e-3, f"{name}: the weights did not move"
            _close(got["weights"], weights, weights64, w0, f"{name}: weights at N=2 vs one process")
            assert got["held"].keys() == held.keys() == held64.keys()
            for key in held:
                _close(got["held"][key], held[key], held64[key], w0, f"{name}: held {key} at N=2 vs one process")
            if name not in HOLDS_WEIGHTS:
                continue
            assert held, f"{name}: holds no weights"
            # each rank holds its shards: about 1/N of one process's copies (dim 0 of every weight is split)
            assert 0.45 * extra_bytes <= got["extra_bytes"] <= 0.55 * extra_bytes, (got["extra_bytes"], extra_bytes)
            assert got["resumed_equal"], f"{name}: the held shards changed through the checkpoint"
            # N=2 → N=1: one process (no group) reads the sharded checkpoint's held state whole
            path = Path(got["checkpoint"])
            learner = make_learner("hf:fp32")
            optimizer = torch.optim.AdamW(learner.model.parameters(), lr=1e-3)
            saved = torch.load(path / "state.pt", weights_only=False)
            one = build_proximal(_config(name))
            ONE_PROCESS.checkpointer(learner, optimizer).load(path, saved, one)
            assert one.held_weights().keys() == held.keys()
            assert one.extra_bytes == extra_bytes, "tied weights came back as separate copies"
            for key in held:
                for k, value in one.held_weights()[key].items():
                    torch.testing.assert_close(value, got["held"][key][k], rtol=0, atol=0)
            # N=1 → N=2: a one-process state sharded onto the ranks keeps its values, at 1/N per rank
            for key in held:
                for k, value in got["from_one_process"][key].items():
                    torch.testing.assert_close(value, held[key][k], rtol=0, atol=0)
            assert got["from_one_process_bytes"] == got["extra_bytes"]


@pytest.mark.slow  # two processes: 40 CPU-s, 45–120 s of wall time on 2 loaded cores
@pytest.mark.timeout(300)
def test_held_weight_strategies_two_ranks_equal_one_process(float64_reference):
    """snapshot and EWMA: weights, held copies (1/N per rank), sharded checkpoint N=2 → N=2 / N=1, 1 → 2."""
    _check(list(HOLDS_WEIGHTS), float64_reference)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_live_model_strategies_two_ranks_equal_one_process(float64_reference):
    """interrupt (in-flight tokens scored split over the ranks and gathered), loglinear, linear."""
    _check(["interrupt", "loglinear", "linear"], float64_reference)


def test_held_weights_swapped_into_a_sharded_learner_score_like_one_process():
    """The mechanism every weight-holding strategy uses, on a sharded learner (a one-rank gloo group, in this
    process): scoring with held weights gives what one process gets with them, the live weights score as
    before on both sides of it, and a rank with no rows still runs a forward and gets (0, T). With
    ``reshard_after_forward=False`` FSDP2 keeps every unit's gathered weights after a forward: without
    ``ShardedLearner``'s reshard after each no-grad call the live forward after the swap would read the held
    weights' leftovers."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rollcorr.distributed.checkpoint import shard_held
    from rollcorr.distributed.group import ProcessGroup
    from rollcorr.engines import make_learner
    from rollcorr.proximal.scoring import copy_state, score

    rollout = _rollouts(_config("snapshot"))[0]
    live, other = make_learner("hf:fp32"), make_learner("hf:fp32")
    for learner in (live, other):
        learner.share_prompts = False
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    expected_live, expected_other = score(live, rollout), score(other, rollout)
    assert (expected_live - expected_other).abs().max() > 1e-3
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ranks = ProcessGroup(0, 1, 0, torch.device("cpu"), init_device_mesh("cpu", (1,)), "gloo")
        sharded = ranks.shard(live, reshard_after_forward=False)
        held = {"other": copy_state(other.model)}
        shard_held(held, sharded.model)  # this rank's shards of the other weights
        assert all(hasattr(v, "to_local") for v in held["other"].values() if v.is_floating_point())
        before = score(sharded, rollout)
        swapped = score(sharded, rollout, weights=held["other"])
        after = score(sharded, rollout)
        empty = score(sharded, rollout.select([]), weights=held["other"])
    finally:
        dist.destroy_process_group()
    config = live.model.config
    assert_same_forward(before, expected_live, config, "sharded, live weights")
    assert_same_forward(swapped, expected_other, config, "sharded, the held weights swapped in")
    assert_same_forward(after, expected_live, config, "sharded, live weights back")
    assert tuple(empty.shape) == (0, rollout.response_ids.shape[1])


def _split_worker(rank: int, port: int, data: str, out: str) -> None:
    """The trainer's build at N = 2 — rank 1 a skeleton on the meta device, its shards from rank 0 — then
    ``score_split`` of every rollout in ``data``, counting the rows this rank's forward saw; each rank saves
    its scores, whether it was built without weights, and its buffers."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from rollcorr.distributed import close, init_from_env

    try:
        _split_work(init_from_env("cpu"), data, out)
    finally:
        close()  # after the work's references to the group (models, the device mesh) are gone


def _split_work(ranks, data: str, out: str) -> None:
    from rollcorr.engines import make_learner
    from rollcorr.proximal.scoring import score_split

    learner = make_learner("hf:fp32", skeleton=not ranks.is_main)
    built_without_weights = all(p.is_meta for p in learner.model.parameters())
    sharded = ranks.shard(learner)
    seen: list[int] = []
    forward = sharded.log_prob

    def counting(rollout, **kwargs):
        seen.append(rollout.batch_size)
        return forward(rollout, **kwargs)

    sharded.log_prob = counting
    scores = [score_split(sharded, rollout) for rollout in torch.load(data, weights_only=False)]
    buffers = {name: b.clone() for name, b in sharded.model.named_buffers()}
    # routing replay through the sharded root: the MoE model (rank 1 a skeleton), rollouts carrying the
    # sampler's experts, and a rank with no rows (its stand-in carries a routing too)
    moe = ranks.shard(make_learner("hf:fp32", "builtin:moe", routing_replay="r3", skeleton=not ranks.is_main))
    replayed = [score_split(moe, rollout) for rollout in torch.load(f"{data}.moe", weights_only=False)]
    torch.save({"scores": scores, "rows_seen": seen, "skeleton": built_without_weights, "buffers": buffers,
                "weights": sharded.state_dict(), "replayed": replayed}, f"{out}.{ranks.rank}")


@pytest.mark.timeout(300)
def test_rank_1_builds_no_weights_and_in_flight_scoring_is_split_over_two_ranks(float64_reference):
    """Two things of a two-rank learner. The build: rank 1 makes the model on the meta device (no weights) and
    after sharding holds rank 0's weights (gathered: equal to one process's) and rank 0's buffers (rotary
    frequencies, which no state dict carries). ``interrupt``'s stall (``scoring.score_split``): each rank's
    forward sees ⌈B / 2⌉ rows or fewer — 8 rows → 4 and 4, 7 → 4 and 3, 1 → 1 and none (a one-token
    stand-in) — and both ranks get every row's log-prob, equal to one process scoring all of them (rank 1's
    rows through its received weights and buffers). The same with routing replay on the MoE model: every
    rank's scores are one process's replayed ones (the rollout's routing reaches the sharded forward; a rank
    with no rows joins with a stand-in that carries a routing)."""
    from rollcorr.engines import make_learner
    from rollcorr.proximal.scoring import score

    torch.set_num_threads(1)
    batch = _rollouts(_config("interrupt"))[1]
    rollouts = [batch, batch.select(list(range(7))), batch.select([5])]
    one = make_learner("hf:fp32")
    one.share_prompts = False
    expected = [score(one, rollout) for rollout in rollouts]
    from rollcorr.engines import SamplingParams, make_sampler
    from rollcorr.tasks import AdditionTask

    prompts = [item["prompt"] for item in AdditionTask(3).sample(4, seed=0, split="test")]
    sampled = make_sampler("hf:fp32", "builtin:moe").generate(prompts, SamplingParams(max_new_tokens=6, seed=0), n=2)
    replaying = make_learner("hf:fp32", "builtin:moe", routing_replay="r3")
    experts = replaying.model.config.num_experts  # another valid routing: every chosen expert shifted by one
    routed = sampled.replace(routed_experts=(sampled.routed_experts.long() + 1) % experts,
                             prompt_routed_experts=(sampled.prompt_routed_experts.long() + 1) % experts)
    moe_rollouts = [routed, routed.select([3])]
    replaying.share_prompts = False
    own_routing = make_learner("hf:fp32", "builtin:moe")
    own_routing.share_prompts = False
    replayed = [score(replaying, rollout) for rollout in moe_rollouts]
    assert (replayed[0] - score(own_routing, routed)).abs().max() > 1e-6  # the replay changes the scores
    with tempfile.TemporaryDirectory() as tmp:
        data, out = os.path.join(tmp, "rollouts.pt"), os.path.join(tmp, "scores")
        torch.save(rollouts, data)
        torch.save(moe_rollouts, f"{data}.moe")
        mp.spawn(_split_worker, args=(_free_port(), data, out), nprocs=WORLD, join=True)
        per_rank = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(WORLD)]
    assert [got["skeleton"] for got in per_rank] == [False, True]
    whole = one.model.state_dict()
    assert per_rank[0]["weights"].keys() == whole.keys()
    for key, value in whole.items():
        torch.testing.assert_close(per_rank[0]["weights"][key], value, rtol=0, atol=0)
    own_buffers = dict(one.model.named_buffers())
    assert own_buffers and all(got["buffers"].keys() == own_buffers.keys() for got in per_rank)
    for got in per_rank:
        for name, value in own_buffers.items():
            torch.testing.assert_close(got["buffers"][name], value, rtol=0, atol=0)
    assert per_rank[0]["rows_seen"] == [4, 4, 1] and per_rank[1]["rows_seen"] == [4, 3, 0]
    # every rank's gathered scores as close to float64 as one process's: the ranks' forwards see other batch
    # shapes (4 + 4 rows, 4 + 3, 1 + 0), whose float32 rounding depends on the CPU's kernels
    one64, replaying64 = copy.deepcopy(one), copy.deepcopy(replaying)
    one64.model.double()
    replaying64.model.double()
    replaying64.model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    with float64_reference():  # (the replayed gate weights stay float32 values: rollcorr.moe, as routers do)
        exact = [one64.log_prob(rollout) for rollout in rollouts]
        exact_replayed = [replaying64.log_prob(rollout) for rollout in moe_rollouts]
    for got in per_rank:
        for what, all_scores, all_want, all_exact, all_rollouts in (
            ("replayed", got["replayed"], replayed, exact_replayed, moe_rollouts),
            ("scores", got["scores"], expected, exact, rollouts),
        ):
            for scores, want, x, rollout in zip(all_scores, all_want, all_exact, all_rollouts):
                m = rollout.response_mask
                assert not scores[~m].any(), what
                assert_as_accurate(scores[m], want[m], x[m], what=what)


@pytest.mark.parametrize("path", ["builtin", "builtin:moe"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_skeleton_has_the_loaded_models_layout_and_no_weights(path, dtype):
    """``skeleton=True`` (a data-parallel rank > 0): every parameter and buffer of the loaded model, same names,
    shapes, dtypes and tied embeddings, all on the meta device (no memory, nothing read)."""
    from rollcorr.distributed.shard import _layout
    from rollcorr.models.builtin import load_model

    loaded, _ = load_model(path, dtype=dtype)
    skeleton, _ = load_model(path, dtype=dtype, skeleton=True)
    assert _layout(skeleton) == _layout(loaded)
    assert all(t.is_meta for t in skeleton.state_dict().values())
    tied = loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    assert (skeleton.get_output_embeddings().weight is skeleton.get_input_embeddings().weight) == tied


def test_rank_0_must_load_the_weights():
    """Rank 0 is where the other ranks' shards come from: a skeleton there is refused before any sharding."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rollcorr.distributed.group import ProcessGroup
    from rollcorr.engines import make_learner

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ranks = ProcessGroup(0, 1, 0, torch.device("cpu"), init_device_mesh("cpu", (1,)), "gloo")
        with pytest.raises(ValueError, match="rank 0 must load the model's weights"):
            ranks.shard(make_learner("hf:fp32", skeleton=True))
    finally:
        dist.destroy_process_group()


def test_ranks_that_built_different_models_get_one_line_before_any_weight_moves():
    """``load_from_rank0`` compares every rank's layout with rank 0's first: a rank that built another model
    (here rank 0's is stood in by the MoE model's layout) gets a one-line DistributedError on every rank,
    before ``to_empty`` or a broadcast of weights (the skeleton is still on the meta device)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rollcorr.distributed.group import ProcessGroup
    from rollcorr.distributed.ranks import DistributedError
    from rollcorr.distributed.shard import _layout, load_from_rank0
    from rollcorr.models.builtin import load_model

    skeleton, _ = load_model("builtin", skeleton=True)
    other = _layout(load_model("builtin:moe", skeleton=True)[0])

    class OtherRank0(ProcessGroup):
        def broadcast(self, obj, src=0):  # what rank 0 would send: its own, different layout
            return other

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ranks = OtherRank0(0, 1, 0, torch.device("cpu"), init_device_mesh("cpu", (1,)), "gloo")
        with pytest.raises(DistributedError, match="the ranks built different models") as err:
            load_from_rank0(skeleton, {}, ranks)
    finally:
        dist.destroy_process_group()
    assert "\n" not in str(err.value)
    assert all(p.is_meta for p in skeleton.parameters())


def test_sharded_learner_refuses_a_foreign_model():
    """A strategy handing a sharded learner a module of its own (``with_model``) would score with the live
    weights through the FSDP root: refused, not silently wrong."""
    from rollcorr.distributed.shard import ShardedLearner
    from rollcorr.proximal.scoring import with_model

    learner = ShardedLearner.__new__(ShardedLearner)
    learner.inner = type("Inner", (), {"model": torch.nn.Linear(1, 1)})()
    learner.model = learner.inner.model
    view = with_model(learner, torch.nn.Linear(1, 1))
    with pytest.raises(TypeError, match="copy_state"):
        view.log_prob((torch.ones(1, 1), torch.ones(1, 1), torch.ones(1, 1), torch.ones(1, 1)))



def test_docs_table_of_strategies_at_n_ranks_matches_the_code():
    """docs/distributed.md's "π_old strategies at N > 1" table: every strategy, and "works" exactly for those
    whose ``data_parallel`` is True (the one that is not is refused by check_components)."""
    import re

    from rollcorr.proximal import STRATEGIES, make_proximal

    page = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    section = page.split("### π_old strategies at N > 1", 1)[1].split("\n#", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `")]
    listed = {name: verdict.strip() for names, verdict in rows for name in re.findall(r"`(\w+)`", names)}
    assert set(listed) == set(STRATEGIES), sorted(set(listed) ^ set(STRATEGIES))
    for name, verdict in listed.items():
        works = make_proximal(name).data_parallel
        assert verdict.startswith("works" if works else "refused"), (name, verdict)
