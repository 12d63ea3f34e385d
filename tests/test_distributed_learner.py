"""Two gloo processes on the CPU train the built-in model — sharded with FSDP2, and replicated with one gradient
all-reduce per optimizer step — to the same weights and metrics as one process on the same global batch: the
trainer's own ``train_step`` (π_old by recompute, the correction, the advantages, the loss), three batches,
several losses and corrections."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from conftest import assert_as_accurate, assert_metrics_as_accurate
from rollcorr.distributed.ranks import ONE_PROCESS, Ranks
from rollcorr.distributed.split import SplitError, rank_rows

WORLD = 2
SMALL = ["rollout.prompts_per_step=4", "rollout.group_size=4", "task.eval_prompts=0", "optim.lr=0.003",
         "trainer.mini_batches=1"]
CASES = {  # name → overrides: ppo_clip token-mean / seq-mean-token-mean, gspo, oapl, sequence IS + RS + batch norm
    "ppo_token_tis": [
        "algorithm.name=grpo",
        "algorithm.correction.preset=decoupled_token_is",
        "trainer.mini_batches=2",
    ],
    "ppo_seq_mean": ["algorithm.name=grpo", "algorithm.aggregation=seq-mean-token-mean"],
    "gspo": ["algorithm.name=gspo"],
    "oapl": ["algorithm.name=oapl"],
    "seq_is_rs_norm": [
        "algorithm.name=grpo",
        "algorithm.correction.preset=decoupled_seq_is_rs",
        "algorithm.correction.batch_normalize=true",
    ],
}
STEPS = 3
# the sharded learner scores through transformers' decoder forward (distributed/shard.py); the reference does
# too, so the two differ by the data-parallel split alone (the shared-prompt path differs by float rounding)
SHARE_PROMPTS = False
# ∂L/∂(key bias) is 0 in exact arithmetic (softmax ignores a shift shared by every key of a query): its gradient
# is rounding noise, which Adam's m/√v turns into ±lr steps. Checked in the whole-model norm only.
NOISE_ONLY = ("self_attn.k_proj.bias",)
# Sanity bound on the one-process float32 run itself: its whole-model weights are within 1 % of the update
# (the distance the float64 run moved them) of the float64 run's. Float32 rounding, amplified by Adam's m/√v
# on small gradients, stays near 0.02 % for the whole model (single tensors of near-zero gradient reach ~1 %:
# the ratio check covers those); a lost or doubled gradient share moves an update by far more.
SANITY_OF_UPDATE = 1e-2
# per-rank or timing values: not a property of the batch
NOT_COMPARED = ("time/", "proximal/")


def _config(name: str):
    from rollcorr.train.config import load_config

    return load_config(None, SMALL + CASES[name])


def _rollouts(config) -> list:
    from rollcorr.train.source import SourceSpec, sample_batch

    source = SourceSpec.from_config(config).build()
    return [sample_batch(source, i) for i in range(STEPS)]


def learner_and_optimizer(config, ranks: Ranks = ONE_PROCESS, dtype=torch.float32, layout: str = "shard"):
    """The built-in fp32 learner (seeded; laid out over ``ranks``: sharded over a process group) and its AdamW,
    as both sides of an N-ranks-vs-one-process comparison build them. ``dtype=torch.float64``: the same weights
    cast to float64 (one process only), the reference both float32 runs are measured against."""
    from rollcorr.engines import make_learner
    from rollcorr.train.loop import seed_everything

    seed_everything(0)
    learner = make_learner("hf:fp32")
    if dtype != torch.float32:
        assert ranks is ONE_PROCESS, "the float64 reference runs in one process"
        learner.model.to(dtype)
    learner.model.train(False)
    learner.share_prompts = SHARE_PROMPTS
    learner = ranks.shard(learner, layout)
    params = [p for p in learner.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.optim.lr, betas=(0.9, 0.99), eps=1e-8)
    return learner, optimizer


def _train(name: str, rollouts: list, ranks: Ranks = ONE_PROCESS, dtype=torch.float32,
           layout: str = "shard") -> tuple[dict, list[dict]]:
    """(full weights (rank 0; {} elsewhere), metrics per step) after ``STEPS`` train_steps."""
    from rollcorr.train.build import build_proximal, build_step_config
    from rollcorr.train.step import train_step

    config = _config(name)
    step_config, proximal = build_step_config(config), build_proximal(config)
    learner, optimizer = learner_and_optimizer(config, ranks, dtype, layout)
    proximal.on_publish(0, learner.model)
    history = []
    for step in range(STEPS):
        result = train_step(rollouts[step], learner, optimizer, proximal, step_config, step,
                            generator=torch.Generator().manual_seed(0), ranks=ranks)
        history.append(result.metrics)
    weights = learner.state_dict()  # the full weights (a sharded learner: gathered on rank 0)
    return {k: v.detach().clone() for k, v in weights.items()}, history


def _worker(rank: int, port: int, names: list[str], data: str, out: str, layout: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from rollcorr.distributed import close, init_from_env

    try:
        _work(init_from_env("cpu"), names, data, out, layout)
    finally:
        close()  # after the work's references to the group (models, the device mesh) are gone


def _work(ranks: Ranks, names: list[str], data: str, out: str, layout: str) -> None:
    rollouts = torch.load(data, weights_only=False)
    results = {name: _train(name, rollouts[name], ranks, layout=layout) for name in names}
    assert ranks.layout == layout
    if ranks.is_main:
        torch.save(results, out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _check_equal(names: list[str], float64_reference, layout: str = "shard") -> None:
    """Train ``names`` in this process and on two ranks (float32), and in this process in float64; assert that
    the two-rank weights and metrics are as close to the float64 run's as the one-process ones are.

    The float64 run is the same trainer on the same rollouts with the model and AdamW in float64 (inside
    ``float64_reference``: no float32 norm / softmax in the forward). Still float32 in it: π_old, which the
    proximal scorer stores as float32 (rollcorr.proximal.scoring.score), the rollouts' log μ and the
    advantages — inputs, rounded once, that both float32 runs share; the comparison is of the paths' own error.
    """
    from rollcorr.engines import make_learner
    from rollcorr.train.build import build_step_config

    torch.set_num_threads(1)
    rollouts = {name: _rollouts(_config(name)) for name in names}
    reference = {name: _train(name, rollouts[name]) for name in names}
    with float64_reference():
        exact = {name: _train(name, rollouts[name], dtype=torch.float64) for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        data, out = os.path.join(tmp, "rollouts.pt"), os.path.join(tmp, "ranks.pt")
        torch.save(rollouts, data)
        mp.spawn(_worker, args=(_free_port(), names, data, out, layout), nprocs=WORLD, join=True)
        sharded = torch.load(out, weights_only=False)
    learner = make_learner("hf:fp32")
    w0, model_config = learner.model.state_dict(), learner.model.config
    # metrics are functions of per-token log-probs, which a float32 forward rounds by up to n ε₃₂ relative, n
    # its longest dot product (Higham's γ_n): the floor of each metric's comparison (conftest.metric_floor)
    longest = max(model_config.hidden_size, model_config.intermediate_size)
    for name in names:
        (w1, m1), (w2, m2), (w64, m64) = reference[name], sharded[name], exact[name]
        assert w1.keys() == w2.keys() == w64.keys()
        assert max(_relative(w1[k], w0[k]) for k in w1) > 1e-3, f"{name}: the weights did not move"
        whole = [[w[k] for k in w1] for w in (w2, w1, w64)]
        moved = float(torch.cat([(w64[k] - w0[k]).flatten() for k in w1]).norm())
        assert_as_accurate(*whole, sanity=SANITY_OF_UPDATE * moved, what=f"{name}: weights (whole model)")
        for k in w1:
            if not k.endswith(NOISE_ONLY):
                assert_as_accurate(w2[k], w1[k], w64[k], what=f"{name}: {k}")
        # a loss's own actor/* means are weighted by each part's share of the loss count: exact when that
        # count is the tokens they average over (token-level losses); entropy and loss/policy always are
        skip = NOT_COMPARED if build_step_config(_config(name)).loss.token_level else (*NOT_COMPARED, "actor/oapl",
                                                                                     "actor/ppo_kl", "actor/pg_")
        assert any("loss/policy" in a for a in m1), f"{name}: no optimizer step was taken"
        for step, (a, b, r) in enumerate(zip(m1, m2, m64)):
            keys = [k for k in a if not k.startswith(skip)]
            assert set(keys) <= set(b), f"{name}: metrics missing at N=2: {sorted(set(keys) - set(b))}"
            assert set(keys) <= set(r), f"{name}: metrics missing in float64: {sorted(set(keys) - set(r))}"
            assert any(k.startswith("rollout_corr/") for k in keys)
            # sanity: the one-process run within 1 % of the float64 one (float32 rounding: ≲ 0.1 %)
            assert_metrics_as_accurate(b, a, r, n=longest, keys=keys, sanity_rel=1e-2, what=f"{name} step {step}: ")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["shard", "replicate"])
def test_two_ranks_equal_one_process(float64_reference, layout):
    """ppo_clip token-mean with decoupled token TIS, two mini-batches."""
    _check_equal(["ppo_token_tis"], float64_reference, layout)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["shard", "replicate"])
def test_two_ranks_equal_one_process_more_losses(float64_reference, layout):
    """Sequence IS + rejection + batch normalisation; ppo_clip seq-mean-token-mean, gspo, oapl."""
    _check_equal(["seq_is_rs_norm", "ppo_seq_mean", "gspo", "oapl"], float64_reference, layout)


def test_split_keeps_groups_whole():
    groups = torch.arange(8).repeat_interleave(2)  # 8 prompts × 2 responses
    minis = [list(range(0, 8)), list(range(8, 16))]
    shares = [rank_rows(minis, groups, r, 2) for r in range(2)]
    assert shares[0] == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert shares[1] == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert rank_rows(minis, groups, 0, 1) == minis  # one process takes every row
    with pytest.raises(SplitError, match="prompts_per_step"):
        rank_rows([list(range(6))], torch.arange(3).repeat_interleave(2), 0, 2)  # 3 groups over 2 ranks
    with pytest.raises(SplitError, match="differ in size"):
        rank_rows([list(range(6))], torch.tensor([0, 0, 0, 0, 1, 1]), 0, 2)  # 2 groups, but the cut is inside one


@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                 "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("denominator", ["kept", "original", "batch"])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_loss_count_makes_aggregation_additive_over_parts(agg, denominator, per_sequence):
    """aggregate(batch) = Σ_parts aggregate(part) · count(part) / count(batch): the global-batch normalisation
    the ranks (and micro-batches) rely on, for every mode and denominator policy."""
    from rollcorr.losses.aggregation import aggregate, loss_count

    g = torch.Generator().manual_seed(3)
    valid = torch.arange(6)[None] < torch.tensor([6, 4, 1, 5, 3, 6, 2, 6])[:, None]
    kept = valid & (torch.rand(8, 6, generator=g) > 0.3)
    kept[2] = False  # a row with every token rejected
    loss = torch.randn(8, 6, generator=g, dtype=torch.float64)
    if per_sequence:
        loss = loss.sum(-1)

    def count(rows):
        c = loss_count(
            kept[rows], agg, denominator=denominator, denominator_mask=valid[rows], per_sequence=per_sequence
        )
        return None if c is None else float(c)

    whole = aggregate(loss, kept, agg, norm_constant=6.0, denominator=denominator, denominator_mask=valid)
    parts = [[0, 1, 2], [3, 4], [5, 6, 7]]
    total = count(list(range(8)))
    summed = sum(
        aggregate(
            loss[rows],
            kept[rows],
            agg,
            norm_constant=6.0,
            denominator=denominator,
            denominator_mask=valid[rows],
        )
        * (1.0 if total is None else count(rows) / total)
        for rows in parts
    )
    assert float(summed) == pytest.approx(float(whole), rel=1e-12, abs=1e-12)


def test_ranks_config_is_checked_before_any_process_starts():
    from rollcorr.train.build import check_components
    from rollcorr.train.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=r"trainer\.ranks: .*multiple of trainer\.mini_batches × trainer\.ranks"
    ):
        load_config(None, ["rollout.prompts_per_step=4", "trainer.mini_batches=2", "trainer.ranks=4"])
    for name in ("snapshot", "ewma", "interrupt", "loglinear", "linear", "recompute", "bypass"):  # hold shards
        check_components(load_config(None, ["trainer.ranks=2", f"algorithm.proximal.name={name}"]))
    config = load_config(None, ["trainer.ranks=2", "trainer.mode=async", "algorithm.proximal.name=old_logit_model"])
    with pytest.raises(ConfigError, match=r"algorithm\.proximal\.name: 'old_logit_model' cannot run with "
                                          r"trainer\.ranks > 1: it follows the sampler.*snapshot gives the same "
                                          r"exact old log-probs"):
        check_components(config)


def test_fsdp_options_are_checked_before_any_process_starts():
    """trainer.fsdp: a dtype name is checked with the config; any option in a one-process run, and mixed
    precision on a machine without CUDA, are refused by check_components (before a model loads)."""
    from rollcorr.train.build import check_components
    from rollcorr.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"trainer\.fsdp\.param_dtype: expected one of \['fp32', 'bf16', 'fp16'\]"):
        load_config(None, ["trainer.fsdp.param_dtype=float8"])
    with pytest.raises(ConfigError, match=r"trainer\.fsdp\.reshard_after_forward: applies to a data-parallel"):
        check_components(load_config(None, ["trainer.fsdp.reshard_after_forward=false"]))
    check_components(load_config(None, ["trainer.ranks=2", "trainer.fsdp.reshard_after_forward=false"]))
    if not torch.cuda.is_available():
        for key in ("param_dtype", "reduce_dtype"):
            with pytest.raises(ConfigError, match=rf"trainer\.fsdp\.{key}: FSDP2 mixed precision is for CUDA"):
                check_components(load_config(None, ["trainer.ranks=2", f"trainer.fsdp.{key}=bf16"]))


@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_is_acted_on(reshard):
    """trainer.fsdp.reshard_after_forward reaches fully_shard: after a forward with gradients, a decoder
    layer's weights are gathered (plain tensors) only when it is false; a no-grad scoring call always leaves
    every unit sharded (``DTensor`` weights), so a π_old strategy can exchange the shards afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rollcorr.distributed.group import ProcessGroup
    from rollcorr.distributed.shard import decoder_layers
    from rollcorr.engines import make_learner

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ranks = ProcessGroup(0, 1, 0, torch.device("cpu"), init_device_mesh("cpu", (1,)), "gloo")
        learner = ranks.shard(make_learner("hf:fp32"), reshard_after_forward=reshard)
        batch = (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                 torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
        layer = decoder_layers(learner.model)[0]
        learner.log_prob(batch, grad=True)
        assert hasattr(layer.mlp.up_proj.weight, "to_local") is reshard
        learner.log_prob(batch, grad=False)
        assert all(hasattr(p, "to_local") for p in learner.model.parameters())
    finally:
        dist.destroy_process_group()
