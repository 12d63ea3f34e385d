"""Which sampler engine and which mode are faster for this run, measured on this machine (``rollcorr train
--measure-engines``): nothing is trained.

For the run's config, each candidate sampler — the configured one, the hf backend in the same dtype, vLLM and
llama.cpp when installed and able to serve the model — is built and timed on one batch of the run's shape
(``rollout.prompts_per_step`` prompts × ``rollout.group_size`` responses of at most ``max_new_tokens`` tokens, the
run's temperature, its chat setting), after a one-prompt warm-up. The learner is timed once on that batch: the
π_old forward (no gradient) and the loss forward and backward (the optimizer's step is not included), and each
sampler's load of the learner's weights (a publish). Then per engine:

    sync   ≈ sample + learn + publish               (one after the other, every step)
    async  ≈ max(sample, learn + publish)           (overlapped — only when each has cores of its own)

A sampler process and the learner overlap only if the machine has cores for both: with fewer than
2 × ``trainer.threads`` cores they share them and async gains little (it measured 1.02× on the built-in task on
two cores), so the async line is printed as a bound, and recommended only where the cores allow it and the
overlap would save at least a quarter of a step. Start-up (loading an engine) is printed apart: it is paid once.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any

from rollcorr.engines.spec import parse_spec

MIN_SAVING = 0.25  # async is recommended when max(sample, learn) saves at least this share of a sync step


@dataclass(frozen=True)
class EngineTiming:
    """One candidate's measurement: seconds, or why it could not be measured."""

    spec: str
    startup_s: float | None = None
    sample_s: float | None = None
    publish_s: float = 0.0  # one load of the learner's weights into the sampler
    tokens: int = 0
    skipped: str | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return None if not self.sample_s else self.tokens / self.sample_s


def candidates(config) -> list[str]:
    """The configured sampler, hf in its dtype, vLLM and llama.cpp: each once, in that order."""
    spec = parse_spec(config.model.sampler)
    dtype = spec.dtype if spec.dtype in ("fp32", "bf16", "fp16") else "bf16"
    out = [config.model.sampler, f"hf:{dtype}", f"vllm:{dtype}", "llamacpp:q8_0" if dtype != "fp32" else "llamacpp:f32"]
    seen: list[str] = []
    for s in out:
        if str(parse_spec(s)) not in {str(parse_spec(x)) for x in seen}:
            seen.append(s)
    return seen


def _prompts(config, tokenizer) -> list[Any]:
    from rollcorr.tasks.chat import model_input, uses_chat

    task = config.task.build()
    items = task.sample(config.rollout.prompts_per_step, config.trainer.seed, split="train")
    chat = uses_chat(tokenizer, config.task.chat)
    return [model_input(tokenizer, item["prompt"], chat) for item in items]


def time_sampler(spec: str, config, prompts: list[Any], params, weights: dict) -> tuple[EngineTiming, Any]:
    """Build ``spec``, time one batch (after a one-prompt warm-up) and one publish of ``weights``; (timing, the
    batch's Rollout)."""
    from rollcorr.engines import make_sampler
    from rollcorr.engines.preflight import PreflightError, preflight

    path = None if config.model.path == "builtin" else config.model.path
    try:
        preflight(spec, path, role="sampler")
    except PreflightError as err:
        return EngineTiming(spec, skipped=str(err)), None
    start = time.perf_counter()
    sampler = make_sampler(spec, path, threads=config.trainer.threads)
    try:
        startup = time.perf_counter() - start
        sampler.generate(prompts[:1], replace(params, max_new_tokens=min(2, params.max_new_tokens)))  # warm-up
        start = time.perf_counter()
        rollout = sampler.generate(prompts, params, n=config.rollout.group_size)
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        sampler.load_weights(weights, 1)
        publish = time.perf_counter() - start
    finally:
        sampler.close()
    return EngineTiming(spec, startup, seconds, publish, int(rollout.response_mask.sum())), rollout


def time_learner(learner, config, rollout) -> float:
    """Seconds of the learner's share of a step on ``rollout``: π_old forward, loss forward + backward."""
    import torch

    learner.log_prob(rollout)  # warm-up
    start = time.perf_counter()
    with torch.no_grad():
        learner.log_prob(rollout, temperature=config.rollout.temperature)
    log_prob = learner.log_prob(rollout, temperature=config.rollout.temperature, grad=True)
    (log_prob * rollout.response_mask).sum().backward()
    return time.perf_counter() - start


def measure(config) -> tuple[list[EngineTiming], float]:
    """Every candidate's timing and the learner's seconds per step."""
    import torch

    from rollcorr.engines import make_learner
    from rollcorr.train.source import sampling_params

    if config.trainer.threads > 0:
        torch.set_num_threads(config.trainer.threads)
    learner = make_learner(config.model.learner, None if config.model.path == "builtin" else config.model.path)
    weights = learner.state_dict()
    from transformers import AutoTokenizer

    from rollcorr.models.builtin import builtin_path

    tokenizer = AutoTokenizer.from_pretrained(builtin_path(config.model.path), local_files_only=True)
    prompts = _prompts(config, tokenizer)
    params = sampling_params(config)
    timings, batch = [], None
    for spec in candidates(config):
        timing, rollout = time_sampler(spec, config, prompts, params, weights)
        timings.append(timing)
        batch = batch if batch is not None else rollout
    if batch is None:
        raise ValueError("no sampler engine could be built for this config: " + "; ".join(
            f"{t.spec}: {t.skipped}" for t in timings))  # fmt: skip
    return timings, time_learner(learner, config, batch)


def sync_s(t: EngineTiming, learn_s: float) -> float:
    """A sync step: sample, learn, publish, one after the other."""
    return t.sample_s + learn_s + t.publish_s


def async_s(t: EngineTiming, learn_s: float) -> float:
    """An async step's bound: the slower of the sampler and the learner (who also publishes)."""
    return max(t.sample_s, learn_s + t.publish_s)


def report(timings: list[EngineTiming], learn_s: float, cores: int, threads: int) -> str:
    """The table and the recommendation, in words."""
    lines = [f"{'sampler':16s} {'start-up s':>10s} {'sample s':>9s} {'tokens/s':>9s} {'publish s':>9s} "
             f"{'sync s/step':>11s} {'async bound':>11s}"]  # fmt: skip
    measured = [t for t in timings if t.sample_s is not None]
    for t in timings:
        if t.sample_s is None:
            lines.append(f"{t.spec:16s} not measured: {t.skipped}")
            continue
        lines.append(f"{t.spec:16s} {t.startup_s:10.1f} {t.sample_s:9.2f} {t.tokens_per_s:9.0f} {t.publish_s:9.2f} "
                     f"{sync_s(t, learn_s):11.2f} {async_s(t, learn_s):11.2f}")  # fmt: skip
    best = min(measured, key=lambda t: sync_s(t, learn_s))
    sync, overlapped = sync_s(best, learn_s), async_s(best, learn_s)
    room = cores >= 2 * max(threads, 1)
    lines.append(f"learner (π_old + loss forward/backward, no optimizer step): {learn_s:.2f} s a step")
    lines.append(f"fastest sampler here: {best.spec} (sync ≈ {sync:.2f} s a step; model.sampler={best.spec}).")
    if room and overlapped <= (1 - MIN_SAVING) * sync:
        lines.append(f"async (trainer.mode=async) could bring a step towards {overlapped:.2f} s: this machine has "
                     f"{cores} cores for a sampler and a learner of {threads} thread(s) each.")  # fmt: skip
    elif not room:
        lines.append(f"stay sync: {cores} cores cannot give a sampler and a learner of {threads} thread(s) cores of "
                     "their own, so async would only share them.")  # fmt: skip
    else:
        lines.append("stay sync: overlapping sampling and learning would save less than a quarter of a step.")
    return "\n".join(lines)


def run(config) -> str:
    timings, learn_s = measure(config)
    return report(timings, learn_s, os.cpu_count() or 1, config.trainer.threads)
