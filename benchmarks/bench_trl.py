"""rollcorr's trainer against TRL on a real model, one shape, one run: seconds per GRPO step as ratios, and where
a rollcorr step's time goes.

    python benchmarks/bench_trl.py --model models/smollm2-135m        # → benchmarks/results/bench_trl.txt
    python benchmarks/bench_trl.py --model DIR --steps 3 --out -       # printed only

Three trainers on the same shape — ``--prompts`` prompts × ``--group`` completions of at most ``--tokens``
tokens per step, learning rate 1e-5, temperature 0.7, the chat template on examples/arithmetic's prompts, one
torch thread, an fp32 learner — each for ``--steps`` steps after one warm-up step, in a fresh process:

- ``rollcorr train``: the hf:bf16 sampler, the trainer's own loop (``time/step_s`` of each step);
- TRL's ``GRPOTrainer``: TRL's own generation with the policy model (``model.generate``), fp32 (no autocast);
- ``RollcorrGRPOTrainer`` with ``SamplerRollout("hf:bf16")``: TRL's loop, rollcorr's sampler and correction.

For the two TRL trainers a step is the time between two ``on_step_end`` callbacks. The ratio printed is each
trainer's median seconds per step over ``rollcorr train``'s. Then ``rollcorr train``'s step split into
generation (``time/generate_s``), π_old, the correction, the loss forward, the backward pass, AdamW, publishing
the weights and the rest. The machine (CPU, cores, load average before and after) heads the output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import load, machine  # benchmarks/machine.py (a benchmark runs as a script from its folder)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples/arithmetic/train.jsonl"
TRL_CHILD = r'''
import json, sys, time
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
torch.set_num_threads(1)
model_dir, kind, prompts, group, tokens, steps, out = sys.argv[1:8]
prompts, group, tokens, steps = int(prompts), int(group), int(tokens), int(steps)
rows = [json.loads(line) for line in open(sys.argv[8])]
data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows])
from rollcorr.tasks.verifiers import last_number
def reward(completions, answer, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [last_number({"answer": a}, t) for t, a in zip(texts, answer)]
args = GRPOConfig(output_dir=out, max_steps=steps + 1, per_device_train_batch_size=prompts * group,
                  num_generations=group, max_completion_length=tokens, temperature=0.7, learning_rate=1e-5,
                  report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, bf16=False, fp16=False, seed=0)
marks = []
class Clock(TrainerCallback):
    def on_step_begin(self, a, state, control, **kw):
        if not marks: marks.append(time.perf_counter())
    def on_step_end(self, a, state, control, **kw):
        marks.append(time.perf_counter())
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
if kind == "trl":
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer,
                          callbacks=[Clock()])
else:
    from rollcorr.compat.trl import RollcorrGRPOTrainer, SamplerRollout
    trainer = RollcorrGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                                  processing_class=tokenizer, callbacks=[Clock()],
                                  rollout_func=SamplerRollout("hf:bf16", model_dir), correction="decoupled_token_is")
trainer.train()
print("STEPS", json.dumps([b - a for a, b in zip(marks, marks[1:])]))
'''
PARTS = (("generation", "time/generate_s"), ("π_old", "time/old_log_prob_s"), ("correction", "time/correction_s"),
         ("loss forward", "time/loss_forward_s"),
         ("backward", "time/backward_s"), ("AdamW", "time/optimizer_s"), ("publish", "time/publish_s"))






def rollcorr_steps(args, tmp: Path) -> list[dict]:
    run = tmp / "rollcorr"
    cmd = [sys.executable, "-m", "rollcorr", "train", "--config", "instruct", f"model.path={args.model}",
           f"task.name={DATA}", f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
           f"rollout.max_new_tokens={args.tokens}", f"trainer.steps={args.steps + 1}", "task.eval_prompts=0",
           "trainer.checkpoint_every=0", "trainer.keep_checkpoints=1", "trainer.progress=false", "trainer.plot=false",
           "trainer.tensorboard=false", "model.learner=hf:fp32", "model.sampler=hf:bf16", f"trainer.out={run}"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "time/step_s" in r][1:]  # the warm-up step left out


def trl_steps(args, tmp: Path, kind: str) -> list[float]:
    child = tmp / "trl_child.py"
    child.write_text(TRL_CHILD)
    done = subprocess.run([sys.executable, str(child), str(args.model), kind, str(args.prompts), str(args.group),
                           str(args.tokens), str(args.steps), str(tmp / kind), str(DATA)],
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{done.stderr[-3000:]}")
    steps = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("STEPS "))[6:])
    return steps[1:]  # the warm-up step left out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="a Hugging Face folder (SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per trainer (after one warm-up step)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/bench_trl.txt"), help="- for stdout only")
    args = parser.parse_args(argv)
    args.model = args.model.resolve()
    lines = [f"# bench_trl: {machine()}; load before {load()}",
             f"# shape: {args.prompts} prompts x {args.group} completions, <= {args.tokens} tokens, lr 1e-5, "
             f"fp32 learner, 1 thread; {args.steps} timed steps after 1 warm-up; model {args.model.name}"]
    with tempfile.TemporaryDirectory() as tmp:
        ours = rollcorr_steps(args, Path(tmp))
        base = statistics.median(r["time/step_s"] for r in ours)
        results = {"rollcorr train (hf:bf16 sampler)": base,
                   "TRL GRPOTrainer (its own generate)": statistics.median(trl_steps(args, Path(tmp), "trl")),
                   "RollcorrGRPOTrainer + SamplerRollout(hf:bf16)": statistics.median(trl_steps(args, Path(tmp), "rollcorr_trl"))}
    lines.append("trainer | s/step (median) | ratio to rollcorr train")
    lines += [f"{name} | {value:.2f} | {value / base:.2f}" for name, value in results.items()]
    lines.append("where a rollcorr train step goes | s (mean) | share of time/step_s")
    step = statistics.fmean(r["time/step_s"] for r in ours)
    known = 0.0
    for label, key in PARTS:
        value = statistics.fmean(r[key] for r in ours)
        known += value if key != "time/generate_s" else 0.0
        lines.append(f"{label} | {value:.2f} | {value / step:.2f}")
    wait = statistics.fmean(r["time/wait_s"] for r in ours)  # sync: the learner waits through generation
    lines.append(f"the rest (orchestration, metrics, logging) | {step - wait - known:.2f} | {(step - wait - known) / step:.2f}")
    lines.append(f"# load after {load()}")
    text = "\n".join(lines)
    print(text)
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
