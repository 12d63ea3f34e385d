"""What a run holds, and what its checkpoints hold (#51 item 3): the optimizer guard without a copy of every
weight and moment, the sync executor without a copy of the weights, greedy evaluation on the learner's own
tensors, checkpoints with each tensor once (a full learner's weights in model/ alone, a LoRA learner's adapters
and their AdamW state only), each resumed exactly."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from rollcorr.checkpoint import EXPORTED, STATE_FILE, latest_checkpoint, load_checkpoint, read_exported
from rollcorr.engines import make_sampler
from rollcorr.engines.base import copy_weights
from rollcorr.train.config import load_config
from rollcorr.train.executors import LEARNER_WEIGHTS, LaggedExecutor
from rollcorr.train.loop import Trainer, run
from rollcorr.train.memory import held_bytes
from rollcorr.train.step import GuardedStep

pytestmark = pytest.mark.usefixtures("alternating_rewards")  # a gradient in every step, whatever is sampled

TINY = ["task.name=addition:1", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "task.eval_prompts=8", "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
        "optim.lr=1e-3", "trainer.mini_batches=1"]


def tiny(tmp_path, *overrides, name="run"):
    return load_config(None, [*TINY, f"trainer.out={tmp_path / name}", *overrides])


def storages(obj) -> dict[int, int]:
    """{storage address: bytes} of every tensor in a nested state (each storage once)."""
    out: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            out[item.untyped_storage().data_ptr()] = item.untyped_storage().nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return out


# ---------------------------------------------------------------- the optimizer guard


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
                                  lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)])
def test_guarded_step_writes_what_a_plain_step_writes(make):
    """The dry run puts every weight and moment back bit for bit, so the guarded step equals a plain one (a
    parameter without a gradient in a step is skipped by both)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    start = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) if (i + k) % 3 else None for k, s in enumerate(shapes)] for i in range(4)]
    runs = []
    for guarded in (False, True):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = make(params)
        step = GuardedStep(opt, params)
        for step_grads in grads:
            for p, grad in zip(params, step_grads):
                p.grad = None if grad is None else grad.clone()
            assert step() if guarded else opt.step() is None
        runs.append(([p.detach().clone() for p in params], opt.state_dict()["state"]))
    (plain_w, plain_s), (guarded_w, guarded_s) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain_w, guarded_w))
    assert plain_s.keys() == guarded_s.keys()
    for i in plain_s:
        assert all(torch.equal(torch.as_tensor(plain_s[i][k]), torch.as_tensor(guarded_s[i][k])) for k in plain_s[i])


def test_guarded_step_gives_every_gradient_back_when_it_refuses():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p, q], lr=float("inf"))
    gp, gq = torch.ones(3), torch.ones(2)
    p.grad, q.grad = gp, gq
    assert not GuardedStep(opt, [p, q])()
    assert p.grad is gp and q.grad is gq and torch.equal(p.detach(), torch.ones(3)) and not opt.state


# ---------------------------------------------------------------- copies of published weights


def test_copies_keep_a_tied_tensor_once_and_a_bf16_sampler_keeps_bf16_that_loads_the_same_state():
    sampler = make_sampler("hf:bf16")
    learner_weights = make_sampler("hf:fp32").float_model.state_dict()
    tied = [k for k, v in learner_weights.items() if v.data_ptr() == learner_weights["model.embed_tokens.weight"].data_ptr()]
    assert len(tied) == 2  # the built-in model ties its lm-head to its embedding
    plain = copy_weights(learner_weights)
    assert plain[tied[0]] is plain[tied[1]] and plain[tied[0]].dtype == torch.float32
    kept = sampler.kept_weights(learner_weights)
    assert {v.dtype for v in kept.values()} == {torch.bfloat16} and kept[tied[0]] is kept[tied[1]]
    assert sum(storages(kept).values()) * 2 == sum(storages(plain).values())  # half the bytes, each tensor once
    sampler.load_weights(learner_weights, 1)
    direct = {k: v.clone() for k, v in sampler.model.state_dict().items()}
    sampler.load_weights(kept, 2)
    assert all(torch.equal(direct[k], v) for k, v in sampler.model.state_dict().items())


def test_lag_0_holds_no_weights_and_lag_k_holds_its_sampler_dtype(tmp_path):
    sync = Trainer(tiny(tmp_path, "trainer.steps=2", name="sync"))
    sync.run()
    executor = sync.executor.inner
    assert isinstance(executor, LaggedExecutor) and not executor.copies
    assert list(executor.history.values()) == [LEARNER_WEIGHTS]
    lagged = Trainer(tiny(tmp_path, "trainer.steps=3", "trainer.mode=simulated_async", "trainer.lag=2", name="lag"))
    lagged.run()
    executor = lagged.executor.inner
    assert executor.copies and len(executor.history) == 3  # versions 1, 2, 3: the sampler holds 1
    weights = [w for w in executor.history.values() if isinstance(w, dict)]
    assert weights and all(v.dtype == torch.bfloat16 for w in weights for v in w.values())  # hf:bf16, the default


def test_a_resumed_sync_run_samples_with_the_weights_an_uninterrupted_one_would(tmp_path):
    """The sync executor's checkpoint refers to the learner's weights instead of holding them: resumed from step 2,
    the run samples, trains and ends bit for bit as the one that went on."""
    full = run(tiny(tmp_path, "trainer.steps=4", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=3",
                    "optim.skip_zero_grad=false", name="full"))
    killed = tmp_path / "killed"
    shutil.copytree(full.run_dir, killed)
    shutil.rmtree(killed / "checkpoints" / "step_000004")
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    (killed / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")  # steps 0-2
    state = load_checkpoint(killed / "checkpoints" / "step_000002")
    assert state["executor"]["history"] == {2: LEARNER_WEIGHTS}
    resumed = run(load_config(killed / "config.yaml"), resume=killed)
    a, b = (load_checkpoint(latest_checkpoint(d))["model"] for d in (full.run_dir, killed))
    assert resumed.steps == 4 and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [[line for line in (d / "metrics.jsonl").read_text().splitlines() if '"reward/mean"' in line]
            for d in (full.run_dir, killed)]
    import json

    for x, y in zip(*rows):
        x, y = json.loads(x), json.loads(y)
        assert x["reward/mean"] == y["reward/mean"] and x["loss/policy"] == y["loss/policy"]


# ---------------------------------------------------------------- greedy evaluation


def test_greedy_evaluation_decodes_with_the_learners_own_tensors_as_a_fp32_copy_would(tmp_path):
    from rollcorr.train.eval import GreedyEvaluator

    trainer = Trainer(tiny(tmp_path, "trainer.steps=1"))
    trainer.run()
    evaluator, learner = trainer.evaluator, trainer.learner
    assert evaluator.sampler.float_model is learner.model  # shared, no copy
    separate = make_sampler("hf:fp32")
    other = GreedyEvaluator(separate, trainer.env, learner.tokenizer, 8, trainer.config.rollout.max_new_tokens,
                            trainer.config.task.eval_seed)
    ours = evaluator(learner.state_dict(), 1)
    theirs = other(learner.state_dict(), 1)
    assert ours["eval/accuracy"] == theirs["eval/accuracy"] and evaluator.last == other.last


# ---------------------------------------------------------------- checkpoints: each tensor once


def test_a_checkpoint_holds_the_weights_once_and_the_adamw_state(tmp_path):
    """state.pt: AdamW's two moments and small things; model/: every weight once (the tied lm-head with the
    embedding); no executor copy. Together ≤ 1.3 × (weights + AdamW's state) even for a ~1 M-parameter model."""
    trainer = Trainer(tiny(tmp_path, "trainer.steps=1"))
    trainer.run()
    path = latest_checkpoint(trainer.run_dir)
    raw = torch.load(path / STATE_FILE, weights_only=False)
    assert raw["model"] == EXPORTED
    model = trainer.learner.model
    weights = sum(storages(model.state_dict()).values())
    moments = sum(storages(trainer.optimizer.state_dict()["state"]).values())
    assert moments >= 2 * weights  # exp_avg and exp_avg_sq of every weight (and the step counters)
    assert sum(storages(raw["executor"]).values()) == 0
    assert sum(storages({k: v for k, v in raw.items() if k != "optimizer"}).values()) < 0.01 * weights
    exported = read_exported(path / "model")
    assert sum(v.numel() * v.element_size() for v in exported.values()) == weights  # each storage once
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size <= 1.3 * (weights + moments)


def test_a_lora_checkpoint_holds_its_adapters_and_their_adamw_state_only(tmp_path):
    """With LoRA, state.pt and model/ hold the adapters (PEFT's files in model/) and their moments: a few
    percent of the model here, nothing of the base; and ``rollcorr audit --from-run`` merges them into the base."""
    pytest.importorskip("peft")
    from rollcorr.cli import main

    trainer = Trainer(tiny(tmp_path, "trainer.steps=1", "model.lora.r=4", "model.lora.alpha=8.0",
                           "model.lora.target_modules=[q_proj, v_proj]", "model.sampler=hf:fp32"))
    trainer.run()
    path = latest_checkpoint(trainer.run_dir)
    model = trainer.learner.model
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapters.values())
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - adapter_bytes
    state = load_checkpoint(path)
    assert set(state["model"]) == {n for n in model.state_dict() if ".lora_" in n}
    assert sorted(p.name for p in (path / "model").iterdir() if "token" not in p.name) == [
        "adapter_config.json", "adapter_model.safetensors"]
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and "token" not in f.name)
    assert size <= 5 * adapter_bytes + 50_000 < base_bytes  # adapters twice, two moments, small state
    assert main(["audit", "--from-run", str(trainer.run_dir), "-n", "2", "--max-new-tokens", "2",
                 "--out", str(tmp_path / "audit")]) == 0


# ---------------------------------------------------------------- the accounting


def test_held_bytes_counts_a_shared_storage_once_for_the_first_part_that_holds_it():
    a = torch.zeros(1000)
    module = torch.nn.Linear(10, 10)
    parts = {"first": {"x": a, "again": a[:10], "m": module}, "second": [a, torch.zeros(5)], "empty": object()}
    held = held_bytes(parts)
    assert held == {"first": 4000 + 4 * 110, "second": 20, "empty": 0}


# ---------------------------------------------------------------- the committed measurement and the docs

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results/bench_train_memory.txt"
EARLIER = RESULTS.with_name("bench_train_memory_earlier.txt")  # the same command, run once before
DOCS = Path(__file__).resolve().parents[1] / "docs/training.md"


def measured(path: Path = RESULTS) -> dict[str, dict[str, float]]:
    """Per variant of benchmarks/results/bench_train_memory.txt (or ``path``): peak RSS (GB), checkpoint (MB) and its
    ratio, the learner's CPU seconds a step."""
    out: dict[str, dict[str, float]] = {}
    for block in path.read_text().split("\n## ")[1:]:
        name = block.split(":", 1)[0]
        peak = re.search(r"^peak RSS ([\d.]+) GB", block, re.M)
        ckpt = re.search(r"^checkpoint ([\d.]+) MB \(.*\) = ([\d.]+)x", block, re.M)
        cpu = re.search(r"^learner CPU s/step \(median\) ([\d.]+);", block, re.M)
        out[name] = {"peak_gb": float(peak[1]), "checkpoint_mb": float(ckpt[1]), "ratio": float(ckpt[2]),
                     "cpu_s": float(cpu[1])}
    return out


def test_the_committed_smollm2_run_meets_the_memory_targets_and_the_docs_quote_it():
    """The committed output is SmolLM2-135M at --config instruct (its header says so); the full learner's run peaks
    at ≤ 4 GB with a checkpoint ≤ 1.3 × (weights + AdamW), the LoRA one's checkpoint ≤ 50 MB; without gradient
    checkpointing (which the preset turns on) the same run peaks above 4 GB; docs/training.md shows the file as it
    is and quotes its numbers, docs/tasks.md and the preset's comment the two peaks."""
    text = RESULTS.read_text()
    header = text.splitlines()
    assert "--memory --config instruct" in header[0] and "smollm2-135m" in header[0]
    assert header[1].startswith("# machine: ") and header[2].startswith("# load average before: ")
    assert header[-1].startswith("# load average after: ")
    variants = measured()
    assert list(variants) == ["learner as configured", "without gradient checkpointing", "LoRA r=8 (q, k, v, o)"]
    full, plain, lora = variants.values()
    assert full["peak_gb"] <= 4.0 < plain["peak_gb"] and full["ratio"] <= 1.3 and lora["checkpoint_mb"] <= 50
    assert plain["checkpoint_mb"] == full["checkpoint_mb"]  # the same weights and moments
    docs = DOCS.read_text()
    assert text.strip() in docs  # the block is the file
    prose = " ".join(docs.split())
    assert f"peaks at {full['peak_gb']:.2f} GB" in prose
    assert (f"Without it (`model.gradient_checkpointing=false`) the same run peaks at {plain['peak_gb']:.2f} GB, "
            f"{plain['peak_gb'] - full['peak_gb']:.2f} GB more") in prose
    assert (f"the learner's {plain['cpu_s']:.2f} CPU seconds a step become {full['cpu_s']:.2f} with it "
            f"({full['cpu_s'] / plain['cpu_s']:.2f}×") in prose
    # the run before: the same command and variants; how far a peak moved, against checkpointing's saving
    earlier = EARLIER.read_text().splitlines()
    assert earlier[0] == header[0] and earlier[1] == header[1]  # the same command on the same machine
    assert earlier[2].startswith("# load average before: ") and earlier[-1].startswith("# load average after: ")
    assert earlier[3].startswith("# an earlier run of the same command")
    loads = (earlier[2].split(": ")[1].split()[0], earlier[-1].split(": ")[1].split()[0])
    assert f"(`benchmarks/results/bench_train_memory_earlier.txt`, load average {loads[0]} before, {loads[1]} after)" \
        in prose
    before = measured(EARLIER)
    assert list(before) == list(variants)
    moved = max(abs(before[k]["peak_gb"] - variants[k]["peak_gb"]) for k in variants)
    saving = [v["without gradient checkpointing"]["peak_gb"] - v["learner as configured"]["peak_gb"]
              for v in (variants, before)]
    assert moved < min(saving)
    a, b, c = (f"{v['peak_gb']:.2f}" for v in before.values())
    assert (f"gave peaks of {a}, {b} and {c} GB: a variant's peak moved by up to {moved:.2f} GB from one run to the "
            f"next, less than checkpointing's saving in either run ({saving[0]:.2f} and {saving[1]:.2f} GB)") in prose
    assert f"The full learner's checkpoint is {full['checkpoint_mb'] / 1000:.2f} GB, {full['ratio']:.2f}×" in prose
    assert f"With LoRA r = 8 the checkpoint is {lora['checkpoint_mb']:.1f} MB" in prose
    table_row = next(line for line in docs.splitlines() if line.startswith("| `trainer.eval_every`"))
    assert f"{full['checkpoint_mb'] / 1000:.2f} GB for SmolLM2-135M" in table_row
    peaks = f"{full['peak_gb']:.2f} GB, {plain['peak_gb']:.2f} GB without it"
    tasks = " ".join((RESULTS.parents[2] / "docs/tasks.md").read_text().split())
    assert f"a 2-step run of SmolLM2-135M peaks at {peaks}" in tasks
    preset = (RESULTS.parents[2] / "src/rollcorr/train/configs/instruct.yaml").read_text()
    assert f"(SmolLM2-135M's: {full['checkpoint_mb'] / 1000:.2f} GB with AdamW's state)" in preset
    comment = " ".join(line.split("#", 1)[1].strip() for line in preset.splitlines()
                       if line.lstrip().startswith(("gradient_checkpointing", "#")) and "#" in line)
    assert f"SmolLM2-135M peaks at {peaks}" in comment


def test_adapters_are_read_as_data_and_a_linked_file_is_refused(tmp_path):
    from rollcorr.engines.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapters

    with pytest.raises(ValueError, match="not LoRA adapters as PEFT saves them"):
        read_adapters(tmp_path)  # nothing there
    (tmp_path / ADAPTER_CONFIG).write_text('{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')
    outside = tmp_path.parent / "elsewhere.safetensors"
    outside.write_bytes(b"")
    (tmp_path / ADAPTER_WEIGHTS).symlink_to(outside)
    with pytest.raises(ValueError, match="symbolic link; refused"):
        read_adapters(tmp_path)
