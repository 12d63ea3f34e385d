"""Pretrain a built-in model from scratch (supervised) to a PARTLY competent checkpoint of its task.

Trains a ~1 M-parameter Qwen2 with the character tokenizer on its task's prompt → answer + <eos> (loss on the
response tokens only), evaluates the greedy score (mean task reward, 0 for a response that never ends) on
held-out problems every few steps, and stops as soon as the score is inside [--min-acc, --max-acc], so RL has
room to improve. ``--model`` picks the checkpoint of ``rollcorr.models.builtin.BUILTIN_MODELS`` (its task,
architecture and directory); the defaults of the other options are the ones it shipped with (PRETRAIN below).
Deterministic given --seed and --threads.

    .venv/bin/python scripts/pretrain_builtin.py                                # "builtin": 3-digit addition
    .venv/bin/python scripts/pretrain_builtin.py --model builtin:chain      # chains of running sums
    .venv/bin/python scripts/pretrain_builtin.py --model builtin:moe        # Qwen3-MoE on 3-digit addition

A mixture-of-experts model adds the architecture's own load-balancing loss (transformers'
``load_balancing_loss_func``, weighted by the config's ``router_aux_loss_coef``) to the cross-entropy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rollcorr.models.builtin import BUILTIN, BUILTIN_MODELS, build_tokenizer, builtin_config, builtin_path
from rollcorr.tasks import make_task

# Per model: the training mix (task name → weight; evaluation is on the model's own task) and the option
# defaults it shipped with. 3-digit addition learns from a mix with shorter problems; the chain trains on its
# own task only. ``eval_tokens``: greedy tokens per evaluation answer (the chain: its 70-token answer, as the
# trainer's ``rollout.max_new_tokens`` in configs/chain.yaml).
PRETRAIN = {
    BUILTIN: dict(init=None, mix={"addition:1": 1, "addition:2": 2, "addition:3": 7}, batch_size=128, lr=3e-3,
                  min_acc=0.15, max_acc=0.40, eval_every=50, eval_every_close=10, close_at=0.05, eval_tokens=6),
    f"{BUILTIN}:chain": dict(init=None, mix={"chain": 1}, batch_size=64, lr=3e-3, min_acc=0.25, max_acc=0.40,
                                 eval_every=5, eval_every_close=5, close_at=0.0, eval_tokens=70),
    f"{BUILTIN}:moe": dict(init=None, mix={"addition:1": 1, "addition:2": 2, "addition:3": 7}, batch_size=128,
                           lr=3e-3, min_acc=0.15, max_acc=0.40, eval_every=50, eval_every_close=10, close_at=0.01,
                           eval_tokens=6),
}


def make_batch(tokenizer, items: list[dict], device: str) -> tuple[torch.Tensor, ...]:
    """Right-padded (input_ids, attention_mask, labels) with labels = -100 outside response + <eos>."""
    rows, labels = [], []
    for item in items:
        prompt = tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(item["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, la) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(la)] = torch.tensor(la)
        mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device), lab.to(device)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, task, items: list[dict], max_new_tokens: int) -> float:
    """Mean task reward of greedy decoding, as the trainer's ``eval/reward`` (for addition: exact-match
    accuracy; a response cut off without <eos> is scored on its text). Prompts of one task have equal
    length: no padding needed."""
    model.eval()
    ids = torch.tensor([tokenizer(it["prompt"], add_special_tokens=False)["input_ids"] for it in items])
    from transformers import DynamicCache

    out, cache = [], DynamicCache(config=model.config)
    for _ in range(max_new_tokens):  # with the KV cache: one new position per forward
        ids = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        out.append(ids)
    gen = torch.cat(out, dim=1).tolist()
    correct = 0
    for item, row in zip(items, gen):
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id)]
        correct += task.reward(item, tokenizer.decode(row, skip_special_tokens=True))
    model.train()
    return correct / len(items)


def save_atomic(model, tokenizer, out: Path, info: dict) -> None:
    """save_pretrained into a temp dir beside ``out``, then swap it in (never a half-written checkpoint)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".assets-", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    os.chmod(tmp, 0o755)
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    old = out.with_name(out.name + ".old")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(BUILTIN_MODELS), default=BUILTIN, help="which built-in model")
    p.add_argument("--out", type=Path, default=None, help="default: the model's directory in BUILTIN_MODELS")
    p.add_argument(
        "--init",
        default=None,
        help="built-in checkpoint to start from, or 'scratch' (default: the model's recipe)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (results depend on it)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--max-steps", type=int, default=6000)
    p.add_argument(
        "--eval-every", type=int, default=None, help="steps between evaluations while acc < --close-at"
    )
    p.add_argument(
        "--eval-every-close", type=int, default=None, help="steps between evaluations once acc ≥ --close-at"
    )
    p.add_argument(
        "--close-at",
        type=float,
        default=None,
        help="accuracy from which to evaluate every --eval-every-close steps",
    )
    p.add_argument("--eval-size", type=int, default=500)
    p.add_argument("--eval-tokens", type=int, default=None, help="greedy tokens per evaluation answer")
    p.add_argument("--final-eval-size", type=int, default=2000)
    p.add_argument("--min-acc", type=float, default=None)
    p.add_argument("--max-acc", type=float, default=None)
    p.add_argument("--max-minutes", type=float, default=40.0)
    args = p.parse_args()
    spec, recipe = BUILTIN_MODELS[args.model], PRETRAIN[args.model]
    for key, value in recipe.items():  # the model's shipped recipe fills every option not given
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.out = args.out or spec.directory
    args.init = None if args.init == "scratch" else args.init

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    start = time.time()

    tokenizer = build_tokenizer()
    from transformers import AutoModelForCausalLM, GenerationConfig

    if args.init is None:  # from scratch
        model = AutoModelForCausalLM.from_config(
            builtin_config(len(tokenizer), **spec.architecture), attn_implementation="eager"
        )
    else:  # fine-tune another built-in checkpoint (same tokenizer); its architecture must fit the task
        model = AutoModelForCausalLM.from_pretrained(
            builtin_path(args.init), local_files_only=True, dtype=torch.float32, attn_implementation="eager"
        )
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params:,}")
    model.train()

    # a mixture of experts returns its router logits for the load-balancing loss
    moe_kwargs = {"output_router_logits": True} if hasattr(model.config, "router_aux_loss_coef") else {}
    mix = {name: make_task(name) for name in args.mix}
    task = make_task(spec.task)
    eval_items = task.sample(args.eval_size, seed=12345, split="test")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        return args.lr * min(1.0, (step + 1) / args.warmup)

    history, acc, prev_state, prev_acc = [], 0.0, None, 0.0
    step = 0
    for step in range(1, args.max_steps + 1):
        items = []
        for _ in range(args.batch_size):
            name = rng.choices(list(args.mix), weights=list(args.mix.values()))[0]
            items.extend(mix[name].sample(1, seed=rng.getrandbits(62), split="train"))
        ids, mask, labels = make_batch(tokenizer, items, "cpu")
        out = model(input_ids=ids, attention_mask=mask, **moe_kwargs)
        loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        if moe_kwargs:  # load balancing across experts, as the architecture trains with labels
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        every = args.eval_every if acc < args.close_at else args.eval_every_close
        if step % every == 0:
            acc = greedy_accuracy(model, tokenizer, task, eval_items, max_new_tokens=args.eval_tokens)
            elapsed = time.time() - start
            history.append(
                {"step": step, "loss": round(loss.item(), 4), "acc": acc, "seconds": round(elapsed, 1)}
            )
            print(
                f"step {step:5d}  loss {loss.item():.4f}  greedy acc {acc:.3f}  {elapsed:6.0f}s", flush=True
            )
            if args.min_acc <= acc <= args.max_acc:
                break
            if acc > args.max_acc:  # overshot between two evaluations: keep the closer of the two states
                if prev_state is not None and abs(prev_acc - args.min_acc) < acc - args.max_acc:
                    model.load_state_dict(prev_state)
                    print(f"overshot ({acc:.3f}); reverting to the previous evaluation ({prev_acc:.3f})")
                break
            if elapsed > args.max_minutes * 60:
                print("time budget exhausted before reaching the accuracy window")
                break
            prev_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            prev_acc = acc

    model.eval()
    final_items = task.sample(args.final_eval_size, seed=999, split="test")
    final_acc = greedy_accuracy(model, tokenizer, task, final_items, max_new_tokens=args.eval_tokens)
    wall = time.time() - start
    info = {
        "seed": args.seed,
        "threads": args.threads,
        "steps": step,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "parameters": n_params,
        "model": args.model,
        "init": args.init,
        "task": spec.task,
        "mix": args.mix,
        "final_greedy_score_test": final_acc,
        "final_eval_size": args.final_eval_size,
        "wall_seconds": round(wall, 1),
        "history": history,
    }
    save_atomic(model, tokenizer, args.out, info)
    print(f"final greedy score on {args.final_eval_size} held-out {spec.task} problems: {final_acc:.3f}")
    print(f"wall time {wall:.0f}s, {step} steps; saved to {args.out}")
    return 0 if args.min_acc - 0.05 <= final_acc <= args.max_acc + 0.05 else 1


if __name__ == "__main__":
    raise SystemExit(main())
