"""Measure every proximal strategy on one partial-rollout run: time per call, extra memory, error vs exact.

    python benchmarks/bench_proximal.py [--model builtin] [--steps 12] [--json out.json]

The run (CPU, the hf engines): the sampler always holds the learner's latest version; each iteration it
starts a new batch and advances every unfinished batch by ``--chunk`` tokens, so one response spans
versions (partial rollouts) and finished batches wait for the learner. The learner trains on the oldest
finished batch with a plain REINFORCE step (GRPO-centred advantages, Adam), then publishes. All strategies
see the same run and the same hooks; each keeps a snapshot reference (``measure_error=True``) so its error
against the exact old logits π_train(v_gen) is measured. The sampler runs in ``--sampler-dtype`` (bf16 by
default) so μ ≠ π_train even at v_gen: the discrepancy factor is not zero.

EWMA's auto-reset is driven by a train/infer mask computed here: the share of tokens with
π_old/μ ∈ [1/2, 2] (``--keep-band``), handed to every strategy as ``kept_mask`` (``after_correction``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from rollcorr.proximal import STRATEGIES, discrepancy_drift, make_proximal
from rollcorr.rollout import Rollout


def advantages(rollout: Rollout, rewards: torch.Tensor) -> torch.Tensor:
    """(B,) reward minus its group mean (GRPO without std)."""
    groups = rollout.group_ids
    out = torch.zeros_like(rewards)
    for g in groups.unique():
        idx = groups == g
        out[idx] = rewards[idx] - rewards[idx].mean()
    return out


def run(
    model: str = "builtin",
    steps: int = 12,
    prompts: int = 16,
    n: int = 4,
    chunk: int = 2,
    max_new_tokens: int = 8,
    max_staleness: int = 4,
    lr: float = 1e-4,
    sampler_dtype: str = "bf16",
    keep_band: float = 2.0,
    seed: int = 0,
    names: list[str] | None = None,
) -> dict:
    """Run the benchmark (see module docstring). Returns the report: config, parameter count and bytes, the
    mean token version lag, the mean discrepancy/staleness factors, the interrupt stall per version, and per
    strategy the means over train steps of its error and metrics (``seconds``: median; ``extra_bytes``: max).
    """
    from rollcorr.engines.base import SamplingParams
    from rollcorr.engines.hf import HFLearner, HFSampler
    from rollcorr.tasks import make_task, rewards

    torch.manual_seed(seed)
    learner = HFLearner(model, device="cpu")
    sampler = HFSampler(model, dtype=sampler_dtype, device="cpu")
    task = make_task("addition")
    names = names or list(STRATEGIES)
    strategies = {
        name: make_proximal(name, max_staleness=max_staleness, measure_error=True) for name in names
    }
    optimizer = torch.optim.Adam(learner.model.parameters(), lr=lr)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    log_band = math.log(keep_band)

    version = 0
    for s in strategies.values():
        s.on_publish(version, learner.model)
    sampler.load_weights(learner.state_dict(), version)

    records: dict[str, list[dict]] = {name: [] for name in names}
    factors, stalls, lags = [], [], []
    in_flight: list[Rollout] = []
    ready: list[Rollout] = []
    it = 0
    while version < steps:
        # sampler: one new batch, every unfinished batch advanced by `chunk` tokens at the current version
        items = task.sample(prompts, seed=seed * 100_000 + it)
        produced = [sampler.generate([x["prompt"] for x in items], params, n=n, meta=items, max_steps=chunk)]
        produced += [sampler.generate([], params, resume=r, max_steps=chunk) for r in in_flight]
        it += 1
        in_flight = []
        for r in produced:
            if "old_logit_model" in strategies:  # the dedicated model sees every chunk as it is produced
                strategies["old_logit_model"].submit(r, learner)
            (ready if all(m["finished"] for m in r.meta) else in_flight).append(r)
        if not ready:
            continue  # warm-up: nothing to train on yet
        batch = ready.pop(0)
        mask = batch.response_mask
        lags.append(float((version - batch.version)[mask].float().mean()))

        results = {name: s.old_log_prob(batch, learner, version) for name, s in strategies.items()}
        for name, res in results.items():
            records[name].append(
                {"seconds": res.seconds, "extra_bytes": res.extra_bytes, **(res.error or {}), **res.metrics}
            )
        with torch.no_grad():
            current = learner.log_prob(batch, temperature=1.0)
        exact = strategies[names[0]]._reference_log_prob(batch, learner, current)
        factors.append(discrepancy_drift(batch.rollout_log_prob, exact, current, mask))

        if "interrupt" in strategies:  # the learner still holds `version`: the sampler pauses here
            stalls.append(strategies["interrupt"].before_publish(learner, in_flight + ready, version))

        reward = torch.tensor(rewards(task, batch.meta, [m["response_text"] for m in batch.meta]))
        adv = advantages(batch, reward)[:, None]
        log_prob = learner.log_prob(batch, temperature=1.0, grad=True)
        loss = -(adv * log_prob * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        for name, s in strategies.items():
            d = results[name].old_log_prob - batch.rollout_log_prob  # the train/infer mask: π_old/μ in the band
            s.after_correction(batch.replace(kept_mask=mask & (d.abs() <= log_band)), version)
            s.after_optimizer_step(learner.model)
        version += 1
        for s in strategies.values():
            s.on_publish(version, learner.model)
        sampler.load_weights(learner.state_dict(), version)

    if "old_logit_model" in strategies:
        strategies["old_logit_model"].close()
    n_params = sum(p.numel() for p in learner.model.parameters())
    summary = {}
    for name, rows in records.items():
        mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0] if k != "extra_bytes"}
        mean["seconds"] = statistics.median(r["seconds"] for r in rows)  # robust to a shared, loaded CPU
        mean["extra_bytes"] = max(r["extra_bytes"] for r in rows)
        last = rows[-1]
        for k in ("ewma_resets", "background_seconds", "publish_seconds", "stall_seconds"):
            if k in last:
                mean[k] = last[k]
        summary[name] = mean
    return {
        "config": dict(
            model=model,
            steps=steps,
            prompts=prompts,
            n=n,
            chunk=chunk,
            max_new_tokens=max_new_tokens,
            max_staleness=max_staleness,
            lr=lr,
            sampler_dtype=sampler_dtype,
            keep_band=keep_band,
            seed=seed,
        ),
        "parameters": n_params,
        "model_bytes": sum(p.numel() * p.element_size() for p in learner.model.parameters()),
        "mean_version_lag": statistics.fmean(lags),
        "factors": {k: statistics.fmean(f[k] for f in factors) for k in factors[0]},
        "interrupt_stall_seconds_per_version": statistics.fmean(stalls) if stalls else None,
        "strategies": summary,
    }


def table(report: dict) -> str:
    lines = [
        "| strategy | ms / call (median) | extra memory (KiB) | mean abs Δlog p vs exact | max abs Δlog p | mean abs Δp | exact tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in report["strategies"].items():
        exact = m.get("exact_token_fraction")
        lines.append(
            f"| {name} | {1000 * m['seconds']:.1f} | {m['extra_bytes'] / 1024:.0f} | {m['logp_abs_err_mean']:.2e} | "
            f"{m['logp_abs_err_max']:.2e} | {m['p_abs_err_mean']:.2e} | {'' if exact is None else f'{exact:.3f}'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin", help='"builtin" or a local HF model directory')
    p.add_argument("--steps", type=int, default=12, help="optimizer steps (= published versions)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--chunk", type=int, default=2, help="tokens generated per batch per version")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--sampler-dtype", default="bf16")
    p.add_argument("--keep-band", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--json", default=None, help="also write the full report here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    report = run(
        model=args.model,
        steps=args.steps,
        prompts=args.prompts,
        n=args.n,
        chunk=args.chunk,
        max_new_tokens=args.max_new_tokens,
        max_staleness=args.max_staleness,
        lr=args.lr,
        sampler_dtype=args.sampler_dtype,
        keep_band=args.keep_band,
        seed=args.seed,
        names=[s for s in args.strategies.split(",") if s],
    )
    report["wall_seconds"] = time.perf_counter() - start
    print(table(report))
    print(json.dumps({k: v for k, v in report.items() if k != "strategies"}, indent=1))
    for name in ("ewma", "old_logit_model", "interrupt"):
        if name in report["strategies"]:
            extra = {
                k: v
                for k, v in report["strategies"][name].items()
                if k.startswith(("ewma", "back", "pub", "stall"))
            }
            print(name, json.dumps(extra))
    if args.json:
        import os
        import tempfile

        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(args.json)) or ".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
