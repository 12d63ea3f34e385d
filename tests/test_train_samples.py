"""What the model wrote: samples.jsonl and the TensorBoard text panel of a run (train.logging.SampleLog)."""

import json

import torch

from rollcorr.train.config import load_config
from rollcorr.train.loop import run

TINY = ["task.name=addition:1", "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=4",
        "task.eval_prompts=6", "trainer.progress=false", "trainer.plot=false", "trainer.mini_batches=1",
        "trainer.eval_every=2", "trainer.steps=4", "trainer.checkpoint_every=2"]


def samples(run_dir):
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_samples_at_step_one_and_every_evaluation_with_per_token_mismatch(tmp_path):
    out = tmp_path / "run"
    run(load_config(None, [*TINY, f"trainer.out={out}", "trainer.tensorboard=true"]))
    rows = samples(out)
    assert sorted({(r["step"], r["kind"]) for r in rows}) == [(0, "eval"), (1, "train"), (2, "eval"), (2, "train"),
                                                              (4, "eval"), (4, "train")]
    train = [r for r in rows if r["kind"] == "train"]
    assert all(len(r["tokens"]) == len(r["abs_prob_diff"]) >= 1 for r in train)
    assert all(0 <= d <= 1 for r in train for d in r["abs_prob_diff"])
    # the default sampler is bf16 against an fp32 learner: some token differs, and every |Δp| is a rounding
    # of probabilities, far below a different model's
    assert any(d > 0 for r in train for d in r["abs_prob_diff"]) and max(d for r in train for d in r["abs_prob_diff"]) < 0.5
    assert {len({r["prompt"] for r in train if r["step"] == s}) for s in (1, 2, 4)} == {4}  # one per prompt
    evals = [r for r in rows if r["kind"] == "eval"]
    assert all("+" in r["prompt"] and r["reward"] in (0.0, 1.0) and r["answer"] for r in evals)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert "samples/text_summary" in events.Tags()["tensors"]


def test_a_resumed_run_keeps_no_sample_from_after_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    config = load_config(None, [*TINY, f"trainer.out={out}", "trainer.tensorboard=false"])
    run(config)
    before = samples(out)
    # keep the checkpoint of step 2 only, as if the run had died after step 3's samples
    (out / "checkpoints" / "step_000004").rename(tmp_path / "moved")
    with (out / "samples.jsonl").open("a") as f:
        f.write(json.dumps({"step": 3, "kind": "train", "prompt": "x"}) + "\n")
    run(load_config(None, [*TINY, f"trainer.out={out}", "trainer.tensorboard=false"]), resume=out)
    after = samples(out)
    assert [r["step"] for r in after] == [r["step"] for r in before]  # no step-3 leftover, step 4 once
    assert torch.tensor([r["step"] for r in after]).diff().ge(0).all()
