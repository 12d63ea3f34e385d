"""Where a step's time goes: time/optimize_s split into the loss forward, the backward pass and AdamW's update."""

import json


def test_a_steps_optimize_time_is_split_into_its_parts(tmp_path):
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import run

    config = load_config(None, ["trainer.steps=2", "trainer.eval_every=0", "trainer.progress=false",
                                "trainer.plot=false", "trainer.tensorboard=false", "rollout.prompts_per_step=4",
                                "optim.skip_zero_grad=false", f"trainer.out={tmp_path / 'run'}"])
    run(config, run_dir=tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in (r for r in records if "time/optimize_s" in r):
        parts = [r["time/loss_forward_s"], r["time/backward_s"], r["time/optimizer_s"]]
        assert all(p > 0 for p in parts) and sum(parts) <= r["time/optimize_s"]  # measured inside it
        assert r["time/optimize_s"] <= r["time/step_s"]
