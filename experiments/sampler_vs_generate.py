"""The audit's hf:bf16 sampler against transformers' ``generate`` in bf16: where their |Δp| against the fp32
learner differs, and why (an observation, not a study: no claim, no verdict).

Measured question: over draws of the same prompts, the hf:bf16 sampler and a plain ``model.generate`` loop in
bf16 were seen to give a different mean |Δp| against the fp32 learner and different token counts, while their
first-token log-probs agree. Which parts of the two paths make the difference? Arms, each on the same prompts
and sampling settings (temperature 1, no top-k / top-p), ``--draws`` seeds each, every response scored by the
same fp32 learner:

    sampler           rollcorr's hf:bf16 sampler (static KV cache decode, prompts batched with left padding)
    sampler_hfcache   the same sampler decoding through transformers' DynamicCache (fast_decode=False)
    sampler_alone     the sampler, one prompt per batch (no padding, no batch neighbours)
    generate          ``model.generate`` on the same bf16 model, the same batches (left padding); log μ from its
                      raw logits (``output_logits``), log_softmax in float32
    generate_alone    ``generate`` one prompt at a time

Per arm: responses' tokens, mean |Δp| = mean |μ − π_fp32| over tokens, the share of tokens with |Δp| ≥ 0.01,
and the mean over draws with its spread. ``--model`` runs a Hugging Face folder instead of the built-in model
(its chat template is not applied: raw prompts). Results: experiments/results/sampler_vs_generate/results.json.

    PYTHONPATH=. .venv/bin/python -m experiments.sampler_vs_generate            # built-in model, 128 responses x 7
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

from experiments.common import RESULTS, Clock, code_commit, log, machine, write_json

OUT = RESULTS / "sampler_vs_generate"
ARMS = ("sampler", "sampler_hfcache", "sampler_alone", "generate", "generate_alone")


def generate_rows(model, tokenizer, prompts: list[list[int]], params, seed: int, batch_size: int):
    """(tokens, log μ) per row from ``model.generate`` in batches of ``batch_size`` (left padding); log μ is
    log_softmax of the raw logits at each step in float32 (temperature 1: the distribution drawn from)."""
    from rollcorr.engines.decoding import left_pad

    tokens, log_mus = [], []
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for i, start in enumerate(range(0, len(prompts), batch_size)):
        ids, mask = left_pad(prompts[start : start + batch_size], pad, torch.device("cpu"))
        torch.manual_seed(seed + i)
        out = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=params.max_new_tokens, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=pad, eos_token_id=eos)
        new = out.sequences[:, ids.shape[1] :]
        logp = torch.stack([lg.float().log_softmax(-1) for lg in out.logits], 1)  # (b, steps, V)
        chosen = logp.gather(-1, new[..., None]).squeeze(-1)
        for row, lp in zip(new.tolist(), chosen.tolist()):
            end = row.index(eos) + 1 if eos in row else len(row)
            tokens.append(row[:end])
            log_mus.append(lp[:end])
    return tokens, log_mus


def sampler_rows(sampler, prompts: list[list[int]], params, batch_size: int):
    from dataclasses import replace

    tokens, log_mus = [], []
    for i, start in enumerate(range(0, len(prompts), batch_size)):
        r = sampler.generate(prompts[start : start + batch_size], replace(params, seed=params.seed + i))
        mask = r.response_mask.bool()
        tokens += [r.response_ids[j][mask[j]].tolist() for j in range(len(mask))]
        log_mus += [r.rollout_log_prob[j][mask[j]].tolist() for j in range(len(mask))]
    return tokens, log_mus


def score(learner, prompts: list[list[int]], tokens: list[list[int]], log_mus: list[list[float]]) -> dict[str, float]:
    """mean |Δp|, share ≥ 0.01 and the token count of the rows against the fp32 learner."""
    from rollcorr.engines.decoding import left_pad, right_pad

    pad = 0
    keep = [i for i, t in enumerate(tokens) if t]
    p_ids, p_mask = left_pad([prompts[i] for i in keep], pad, torch.device("cpu"))
    r_ids = right_pad([tokens[i] for i in keep], pad, torch.long)
    r_mask = right_pad([[1] * len(tokens[i]) for i in keep], 0, torch.bool)
    mu = right_pad([log_mus[i] for i in keep], 0.0, torch.float64)
    old = learner.log_prob((p_ids, p_mask, r_ids, r_mask)).double()
    dp = (mu.exp() - old.exp()).abs()[r_mask]
    return {"tokens": int(r_mask.sum()), "mean_abs_dp": float(dp.mean()), "share_ge_0.01": float((dp >= 0.01).double().mean())}


def run(model_path: str | None, n: int, draws: int, batch_size: int, max_new_tokens: int) -> dict[str, Any]:
    from rollcorr.audit.collect import builtin_prompts
    from rollcorr.engines import SamplingParams, make_learner, make_sampler

    learner = make_learner("hf", model_path)
    fast = make_sampler("hf:bf16", model_path)
    reference = make_sampler("hf:bf16", model_path, fast_decode=False)
    texts = builtin_prompts(n) if model_path is None else [f"What is {a} plus {b}?" for a, b in zip(range(n), range(7, 7 + n))]
    prompts = fast.encode(texts)
    per_arm: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    clock = Clock()
    for draw in range(draws):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=1000 * draw)
        rows = {
            "sampler": sampler_rows(fast, prompts, params, batch_size),
            "sampler_hfcache": sampler_rows(reference, prompts, params, batch_size),
            "sampler_alone": sampler_rows(fast, prompts, params, 1),
            "generate": generate_rows(fast.model, fast.tokenizer, prompts, params, params.seed, batch_size),
            "generate_alone": generate_rows(fast.model, fast.tokenizer, prompts, params, params.seed, 1),
        }
        for arm, (tokens, log_mus) in rows.items():
            per_arm[arm].append(score(learner, prompts, tokens, log_mus))
        log(f"  draw {draw}: " + ", ".join(f"{a} {per_arm[a][-1]['mean_abs_dp']:.2e}/{per_arm[a][-1]['tokens']}" for a in ARMS))
    summary = {
        arm: {
            "mean_abs_dp": statistics.mean(d["mean_abs_dp"] for d in draws_),
            "mean_abs_dp_sd": statistics.stdev(d["mean_abs_dp"] for d in draws_) if len(draws_) > 1 else 0.0,
            "tokens_min": min(d["tokens"] for d in draws_),
            "tokens_max": max(d["tokens"] for d in draws_),
            "share_ge_0.01": statistics.mean(d["share_ge_0.01"] for d in draws_),
        }
        for arm, draws_ in per_arm.items()
    }
    return {"model": model_path or "builtin", "responses": n, "draws": draws, "batch_size": batch_size,
            "max_new_tokens": max_new_tokens, "per_draw": per_arm, "summary": summary, "seconds": round(clock.seconds, 1),
            "machine": machine(), "code_commit": code_commit()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: the built-in model)")
    parser.add_argument("-n", type=int, default=128, help="responses per draw (one per prompt)")
    parser.add_argument("--draws", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = run(args.model, args.n, args.draws, args.batch_size, args.max_new_tokens)
    write_json(result, args.out / "results.json")
    for arm, s in result["summary"].items():
        log(f"{arm:16s} mean |Δp| {s['mean_abs_dp']:.2e} ± {s['mean_abs_dp_sd']:.1e}, tokens {s['tokens_min']}–{s['tokens_max']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def paragraph(results: Path = OUT) -> str:
    """docs/engines.md's reading of results.json (generated; tests/test_results_docs.py checks it is current)."""
    import json

    path = results / "results.json"
    if not path.is_file():
        return "*Pending: experiments/results/sampler_vs_generate/results.json is not in yet.*"
    r = json.loads(path.read_text())
    per, s = r["per_draw"], r["summary"]
    same = all(per["sampler"][i] == per["generate"][i] == per["sampler_hfcache"][i]
               and per["sampler_alone"][i] == per["generate_alone"][i] for i in range(r["draws"]))
    longest = max(range(r["draws"]), key=lambda i: per["sampler_alone"][i]["tokens"])
    batched = [d["mean_abs_dp"] for d in per["sampler"]]
    alone = [d["mean_abs_dp"] for d in per["sampler_alone"]]
    worst = max(range(r["draws"]), key=lambda i: alone[i])
    return (
        f"*{r['model']} model, {r['responses']} responses a draw (one per prompt, batches of {r['batch_size']}), "
        f"{r['draws']} draws, temperature 1, every response scored by the fp32 learner; {r['machine']['cpu']} "
        f"({r['machine']['capability']}), code {str(r['code_commit'])[:7]}.*\n\n"
        f"Given the same batches and seeds, rollcorr's hf:bf16 sampler and `model.generate` in bf16 draw "
        f"{'the same tokens with the same log-probs in every draw' if same else 'different tokens in some draws'} "
        f"(mean |Δp| against the fp32 learner {s['sampler']['mean_abs_dp']:.2e} ± {s['sampler']['mean_abs_dp_sd']:.1e} "
        f"for both, batched; {s['sampler_alone']['mean_abs_dp']:.2e} ± {s['sampler_alone']['mean_abs_dp_sd']:.1e} "
        f"one prompt at a time), and so does the sampler through transformers' own KV cache: no bug and no "
        f"difference of path. What differs between two runs is the draw (batching changes which tokens a seed "
        f"draws): per draw the batched mean |Δp| ranges {min(batched):.1e}–{max(batched):.1e} and the "
        f"one-at-a-time one {min(alone):.1e}–{max(alone):.1e}; "
        f"{'its largest draw is also the one with the most tokens' if worst == longest else 'its largest draw is not the longest'} "
        f"({per['sampler_alone'][worst]['tokens']} tokens; {min(d['tokens'] for d in per['sampler_alone'])}–"
        f"{sorted(d['tokens'] for d in per['sampler_alone'])[-2]} in the others). Compare samplers on the same "
        f"draws, or over many.")
