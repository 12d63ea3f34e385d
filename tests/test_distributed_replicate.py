"""The replicated data-parallel learner (``trainer.data_parallel=replicate``, distributed/replicate.py) and the
ranks that each sample their share of a batch (``ShareExecutor``): the pieces, on one and two gloo processes.
That two ranks train to one process's weights is tests/test_distributed_learner.py's (both layouts); the trainer
end to end at N = 2 is tests/test_distributed_train.py's."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollcorr.distributed.replicate import REPLICATE_SHARE, fits_replicated, training_state_bytes

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, *args) -> None:
    mp.spawn(_worker, args=(_free_port(), fn, *args), nprocs=WORLD, join=True)


def _worker(rank: int, port: int, fn, *args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from rollcorr.distributed import close, init_from_env

    try:
        fn(init_from_env("cpu"), *args)
    finally:
        close()


def _gradients(ranks, out: str) -> None:
    from rollcorr.distributed.replicate import GradientAverager

    a, b, c = (torch.zeros(3, requires_grad=True) for _ in range(3))
    d = torch.zeros(2, dtype=torch.float64, requires_grad=True)  # a second dtype: its own buffer
    if ranks.rank == 0:
        a.grad, d.grad = torch.full((3,), 1.0), torch.full((2,), 4.0, dtype=torch.float64)
    else:
        a.grad, b.grad = torch.full((3,), 3.0), torch.full((3,), 2.0)
    GradientAverager()([a, b, c, d], ranks)
    torch.save({name: None if p.grad is None else p.grad.clone() for name, p in zip("abcd", (a, b, c, d))},
               f"{out}.{ranks.rank}")


def test_gradients_are_averaged_and_a_missing_one_stays_missing():
    """The mean over ranks, a rank without a gradient counting zero; a parameter no rank reached keeps
    ``grad = None`` (AdamW then leaves it alone, as in one process); each dtype in its own buffer."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "grads")
        _spawn(_gradients, out)
        for rank in range(WORLD):
            grads = torch.load(f"{out}.{rank}")
            assert torch.equal(grads["a"], torch.full((3,), 2.0))
            assert torch.equal(grads["b"], torch.full((3,), 1.0))
            assert grads["c"] is None
            assert torch.equal(grads["d"], torch.full((2,), 2.0, dtype=torch.float64))


def _build(ranks, out: str) -> None:
    from rollcorr.engines import make_learner

    learner = ranks.shard(make_learner("hf:fp32", skeleton=not ranks.is_main), "replicate")
    model = learner.model
    assert ranks.holds_whole_model and type(learner).__name__ == "ReplicatedLearner"
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # tied, as loaded
    assert learner.state_dict().keys() == model.state_dict().keys()  # whole weights on every rank
    torch.save({**{k: v.clone() for k, v in model.state_dict().items()},
                **{f"buffer:{k}": v.clone() for k, v in model.named_buffers()}}, f"{out}.{ranks.rank}")


def test_a_skeleton_rank_receives_rank0s_weights_and_buffers_exactly():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "weights")
        _spawn(_build, out)
        zero, one = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert zero.keys() == one.keys() and any(k.startswith("buffer:") for k in zero)
    for name in zero:
        assert torch.equal(zero[name], one[name]), name


def test_auto_replicates_what_fits_a_quarter_of_a_rank():
    from rollcorr.engines import make_learner

    model = make_learner("hf:fp32", skeleton=True).model
    params = {id(p): p for p in model.parameters()}.values()
    state = training_state_bytes(model)
    assert state == 4 * 4 * sum(p.numel() for p in params)  # fp32 weights, gradients, two AdamW moments
    assert fits_replicated(state, int(state / REPLICATE_SHARE))
    assert not fits_replicated(state, int(state / REPLICATE_SHARE) - 1)


def _auto(ranks, fsdp: dict, out: str) -> None:
    from rollcorr.engines import make_learner

    learner = ranks.shard(make_learner("hf:fp32", skeleton=not ranks.is_main), "auto", **fsdp)
    if ranks.is_main:
        torch.save((ranks.layout, type(learner).__name__), out)


@pytest.mark.parametrize(("fsdp", "expected"), [({}, ("replicate", "ReplicatedLearner")),
                                                ({"reshard_after_forward": False}, ("shard", "ShardedLearner"))])
def test_auto_is_acted_on(fsdp, expected):
    """The built-in model fits any machine: auto replicates it, unless an FSDP option asks for sharding."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "layout")
        _spawn(_auto, fsdp, out)
        assert torch.load(out) == expected


def test_shares_of_a_batch_are_the_batch_one_source_samples():
    """Rank r of N samples the r-th slice of the prompts one source draws for batch i, with the same group
    ids, each rank with a sampling stream of its own."""
    from rollcorr.train.config import load_config
    from rollcorr.train.source import SourceSpec

    config = load_config(None, ["rollout.prompts_per_step=8", "trainer.ranks=2"])
    spec = SourceSpec.from_config(config)
    import dataclasses

    whole = spec.build()
    parts = [dataclasses.replace(spec, share=(r, WORLD)).build() for r in range(WORLD)]
    for index in (0, 3):
        rows, params, groups = whole._request(index)
        shares = [part._request(index) for part in parts]
        assert sum((s[0] for s in shares), []) == rows
        assert sum((s[2] for s in shares), []) == groups
        assert len({s[1].seed for s in shares}) == WORLD  # one stream per rank


def test_config_refuses_an_unknown_layout_and_fsdp_options_with_replicate():
    from rollcorr.train.build import check_components
    from rollcorr.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"trainer\.data_parallel: expected one of \['auto', 'replicate', 'shard'\]"):
        load_config(None, ["trainer.ranks=2", "trainer.data_parallel=ddp"])
    with pytest.raises(ConfigError, match=r"trainer\.fsdp\.reshard_after_forward: applies to a sharded learner, "
                                          r"and trainer\.data_parallel=replicate"):
        check_components(load_config(None, ["trainer.ranks=2", "trainer.data_parallel=replicate",
                                            "trainer.fsdp.reshard_after_forward=false"]))


def _samples(ranks, out: str) -> None:
    from rollcorr.train.build import build_learner, rank_executor, samples_on_every_rank
    from rollcorr.train.config import load_config

    config = load_config(None, ["rollout.prompts_per_step=4", "rollout.group_size=2", "trainer.mini_batches=1",
                                "trainer.ranks=2", "task.eval_prompts=0"])
    learner, _ = build_learner(config, ranks)
    assert samples_on_every_rank(config, ranks)
    executor = rank_executor(config, ranks)
    executor.start(learner.state_dict(), 0)
    rollout, _ = executor.next_rollout(0, 0)
    torch.save((rollout.group_ids.clone(), [m["prompt"] for m in rollout.meta], rollout.response_ids.clone()),
               f"{out}.{ranks.rank}")


def test_every_rank_samples_its_share_and_holds_the_whole_batch():
    from rollcorr.train.config import load_config
    from rollcorr.train.source import SourceSpec

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "batch")
        _spawn(_samples, out)
        zero, one = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert torch.equal(zero[0], one[0]) and zero[1] == one[1] and torch.equal(zero[2], one[2])
    config = load_config(None, ["rollout.prompts_per_step=4", "rollout.group_size=2"])
    rows, _, groups = SourceSpec.from_config(config).build()._request(0)
    assert zero[0].tolist() == groups  # one process's rows (each prompt G times) and groups, in order
    assert zero[1] == [row["prompt"] for row in rows]


def test_one_process_never_splits_its_sampling():
    from rollcorr.distributed.ranks import ONE_PROCESS
    from rollcorr.train.build import samples_on_every_rank
    from rollcorr.train.config import load_config

    assert not samples_on_every_rank(load_config(None, []), ONE_PROCESS)
    assert dist.is_available()
