"""Warnings that speak: steps whose correction rejected most of the batch or all of it, that had no gradient,
or after which greedy accuracy collapsed (a learning rate too large for the model).

The trainer hands every step's metrics to ``RunAlerts.observe``; it adds one 0/1 flag per condition and a
running count (``alerts/<condition>`` and ``alerts/<condition>_steps``) to the metrics and returns the
messages to print. A condition is announced in plain words the first time it happens in a run, and again
while it **persists**: when ``repeat_every`` further steps have shown it since it was last said (its 1st, 26th,
51st, … occurrence with the default 25), so a run stuck in it keeps saying so without printing every step. ``summary()`` is the
end-of-run line, e.g. "37 of 150 steps rejected > 50 % of sequences; 12 steps had no gradient".

The conditions, read from the step's metrics (``rollout_corr/*`` counts of ``compute_correction`` and the
optimizer counters of ``train/step.py``):

- ``rejected_all``: the correction kept no token (``rollout_corr/num_kept_tokens`` = 0 of > 0);
- ``rejected_most_sequences``: more than half of the valid sequences lost every token;
- ``rejected_most_tokens``: more than half of the valid tokens were rejected;
- ``no_gradient``: every optimizer step of the step had an exactly-zero gradient (all tokens rejected, or
  every kept group had one reward, so every advantage was 0);
- ``amp_overflow`` (``model.learner=hf:amp-fp16``): an optimizer step skipped because the fp16 gradients
  overflowed at the current loss scale (``train.amp.LossScaler``; the scale is halved);
- ``accuracy_drop``: greedy accuracy fell since the previous evaluation by ≥ ``ACCURACY_DROP`` (0.25), or by
  ≥ ``ACCURACY_DROP_SMALL`` (0.1) to half or less of its previous value, and at least ``MIN_LOST_ANSWERS`` (3)
  held-out answers were lost (``eval/prompts`` × the fall: on 4 prompts one answer is already 0.25) —
  updates that undo this many of the held-out answers are what a learning rate too large for the model does
  (SmolLM2-135M at lr 3e-4: 0.875 → 0.25 in one update on one data set, 0.175 → 0.05 → 0.0 on another).

A step that rejects everything also counts as rejecting more than half; its message says it once.

``lr_warning(n_params, lr, trainable)`` is said once when a run starts: a model of ≥ ``LARGE_MODEL`` (50 M)
parameters with ``optim.lr`` > ``LARGE_MODEL_LR`` (1e-4) — RL fine-tuning of pretrained language models uses
learning rates of about 1e-7 to 5e-5 (TRL's GRPOTrainer and verl's actor default to 1e-6), and the default 3e-4
was chosen for the ~1 M-parameter built-in model. When only part of the model trains (LoRA adapters: ``trainable``
< ``n_params``) the bound is ``LORA_LR_FACTOR`` (10) times higher: LoRA's best learning rate is about ten times
full fine-tuning's ("LoRA Without Regret", Thinking Machines, 2025), so 1e-5 to 5e-4.

``truncation_warning(params, sampler_distribution)`` is said once when a run samples with top-k / top-p and
compares the learner's full distribution with the sampler's renormalised one (``sampler_distribution=truncated``):
on identical models every ratio is then the kept mass, not 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MOST = 0.5  # "most": strictly more than half
ACCURACY_DROP, ACCURACY_DROP_SMALL = 0.25, 0.1  # greedy accuracy falling this much between two evaluations
MIN_LOST_ANSWERS = 3  # ... and this many held-out answers lost, so one answer of a handful of prompts is not it
LARGE_MODEL, LARGE_MODEL_LR = 50_000_000, 1e-4
LORA_LR_FACTOR = 10  # LoRA's usual learning rate over full fine-tuning's
REPEAT_EVERY = 25  # a persisting condition is said again every this many further occurrences
PREFIX = "alerts/"
# in the order of the end-of-run summary; each phrase follows "N of M steps" (or "N steps")
CONDITIONS: dict[str, str] = {
    "rejected_most_sequences": "rejected > 50 % of sequences",
    "rejected_most_tokens": "rejected > 50 % of tokens",
    "rejected_all": "rejected every token",
    "no_gradient": "had no gradient",
    "accuracy_drop": "lost a large share of their greedy accuracy since the previous evaluation",
    "amp_overflow": "skipped an optimizer step for an fp16 gradient overflow (the loss scale halved)",
}
LR_ADVICE = "lower optim.lr (RL fine-tuning of pretrained models usually uses 1e-7 to 5e-5)"
ADVICE = (
    "the correction's thresholds are tighter than this sampler/learner mismatch; widen them "
    "(algorithm.correction.rs_thresholds) or choose a preset made for it "
    "(docs/configuration.md, Presets)"
)


def step_conditions(metrics: dict[str, float]) -> dict[str, bool]:
    """Which conditions one step's metrics show (all False when the metrics lack the counts)."""
    g = metrics.get
    tokens, kept_tokens = g("rollout_corr/num_tokens", 0.0), g("rollout_corr/num_kept_tokens", 0.0)
    seqs, kept_seqs = g("rollout_corr/num_valid_seqs", 0.0), g("rollout_corr/num_kept_seqs", 0.0)
    has_tokens = "rollout_corr/num_kept_tokens" in metrics and tokens > 0
    has_seqs = "rollout_corr/num_kept_seqs" in metrics and seqs > 0
    # optimizer steps with a finite gradient: the applied ones plus those skipped for a zero gradient
    finite = g("train/applied_updates", 0.0) + g("train/zero_grad_skips", 0.0)
    zero = g("train/zero_grad_minibatches", 0.0)
    return {
        "rejected_most_sequences": has_seqs and seqs - kept_seqs > MOST * seqs,
        "rejected_most_tokens": has_tokens and tokens - kept_tokens > MOST * tokens,
        "rejected_all": has_tokens and kept_tokens == 0,
        "no_gradient": zero > 0 and zero == finite,
        "accuracy_drop": False,  # needs the previous evaluation: RunAlerts.observe
        "amp_overflow": g("train/amp_overflow_skips", 0.0) > 0,
    }


def accuracy_dropped(previous: float, now: float, prompts: float | None = None) -> bool:
    """The ``accuracy_drop`` rule (module docstring); ``prompts``: how many held-out prompts were evaluated
    (None: not known, the share alone decides)."""
    fall = previous - now
    if prompts is not None and fall * prompts < MIN_LOST_ANSWERS - 1e-9:
        return False
    return fall >= ACCURACY_DROP or (fall >= ACCURACY_DROP_SMALL and now <= previous / 2)


def lr_warning(n_params: int, lr: float, trainable: int | None = None) -> str | None:
    """The start-of-run learning-rate rule (module docstring), or None. ``trainable``: the parameters the optimizer
    steps (None: all of them); fewer than ``n_params`` (LoRA) raises the bound ``LORA_LR_FACTOR``-fold."""
    if n_params < LARGE_MODEL:
        return None
    if trainable is not None and trainable < n_params:
        if lr <= LORA_LR_FACTOR * LARGE_MODEL_LR:
            return None
        return (f"warning: optim.lr={lr:g} is far above the usual range for LoRA adapters ({trainable / 1e6:.1f} M "
                f"trainable weights on a model of {n_params / 1e6:.0f} M): LoRA usually trains at about ten times "
                "full fine-tuning's rate, 1e-5 to 5e-4; lower optim.lr, e.g. optim.lr=1e-4 (docs/tasks.md, LoRA)")
    if lr > LARGE_MODEL_LR:
        return (f"warning: optim.lr={lr:g} is far above the usual range for a model of {n_params / 1e6:.0f} M "
                f"parameters (the default 3e-4 suits the ~1 M-parameter built-in model); {LR_ADVICE}, "
                "e.g. optim.lr=1e-5 (docs/tasks.md, a real model)")
    return None


def truncation_warning(top_k: int, top_p: float, truncated: bool, sampler_distribution: str) -> str | None:
    """The start-of-run top-k / top-p rule (module docstring), or None."""
    if not truncated or sampler_distribution != "truncated":
        return None
    cut = " and ".join(part for part in (f"rollout.top_k={top_k}" if top_k else "",
                                         f"rollout.top_p={top_p:g}" if top_p < 1 else "") if part)
    return (f"warning: {cut} with algorithm.correction.sampler_distribution=truncated compares the learner's full "
            "distribution with the sampler's renormalised one, so every ratio π/μ carries the mass top-k/top-p kept "
            "(on identical models ρ = kept mass, not 1); sampler_distribution=keep_mask (the default) renormalises "
            "π_old and π_θ over the sampler's kept sets (docs/three-policies.md)")


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f} %"


def describe(step: int, condition: str, metrics: dict[str, float]) -> str:
    """The plain-words message for ``condition`` at ``step``."""
    g = metrics.get
    tokens, kept_tokens = g("rollout_corr/num_tokens", 0.0), g("rollout_corr/num_kept_tokens", 0.0)
    seqs, kept_seqs = g("rollout_corr/num_valid_seqs", 0.0), g("rollout_corr/num_kept_seqs", 0.0)
    skipped = g("train/zero_grad_skips", 0.0) > 0
    no_step = (
        "no optimizer step was taken"
        if skipped
        else "Adam still moved the weights by its momentum (optim.skip_zero_grad=false)"
    )
    if condition == "rejected_all":
        return (f"step {step}: the correction rejected every token ({tokens:.0f} tokens in {seqs:.0f} sequences), "
                f"so this step learned nothing and {no_step}; {ADVICE}.")
    if condition == "rejected_most_sequences":
        return (f"step {step}: the correction rejected {_pct(seqs - kept_seqs, seqs)} of the sequences "
                f"({seqs - kept_seqs:.0f} of {seqs:.0f}); the update rests on the other {kept_seqs:.0f}; {ADVICE}.")
    if condition == "rejected_most_tokens":
        return (f"step {step}: the correction rejected {_pct(tokens - kept_tokens, tokens)} of the tokens "
                f"({tokens - kept_tokens:.0f} of {tokens:.0f}); {ADVICE}.")
    if condition == "amp_overflow":
        return (f"step {step}: {g('train/amp_overflow_skips', 0.0):.0f} optimizer step(s) skipped: the fp16 gradients "
                f"overflowed, so the loss scale was halved (now {g('train/amp_loss_scale', 0.0):g}). A few while the "
                "scale finds its level are normal; many mean the loss itself is unstable.")
    if condition == "accuracy_drop":
        return (f"step {step}: greedy accuracy fell from {g('alerts/previous_accuracy', 0.0):.3f} to "
                f"{g('eval/accuracy', 0.0):.3f} since the previous evaluation; updates that undo this many answers "
                f"usually mean the learning rate (optim.lr={g('train/lr', 0.0):g}) is too large for this model: "
                f"{LR_ADVICE}.")
    scale = g("train/amp_loss_scale")  # fp16 mixed precision only
    if scale is not None and scale < 1.0:
        why = (f"the fp16 loss scale has fallen to {scale:g} (it halves at every overflow), which shrinks every "
               "gradient before fp16 holds it, and fp16 flushes those below 6e-8 to 0: the loss overflows fp16 at "
               "any scale (an unstable loss, a learning rate too large) or needs bf16's range "
               "(model.learner=hf:amp-bf16)")
    elif g("advantage/abs_mean", 1.0) == 0:
        why = "every kept group's responses got the same reward, so every advantage was 0"
    else:
        why = "the kept tokens' loss terms cancel or are all clipped"
    return f"step {step}: the gradient was exactly 0 ({why}); {no_step}."


@dataclass
class RunAlerts:
    """Counts the conditions over a run and decides when to speak (see the module docstring)."""

    repeat_every: int = REPEAT_EVERY
    steps: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CONDITIONS, 0))
    said_at: dict[str, int] = field(default_factory=dict)  # condition → its count when last said
    last_accuracy: float | None = None  # the previous evaluation's greedy accuracy

    def seen_evaluation(self, metrics: dict[str, float]) -> None:
        """An evaluation outside a step (step 0's) is the baseline of the next accuracy comparison."""
        if metrics.get("eval/accuracy") is not None:
            self.last_accuracy = float(metrics["eval/accuracy"])

    @classmethod
    def from_records(cls, records: Iterable[dict[str, Any]], repeat_every: int | None = None) -> RunAlerts:
        """Counts of a run continued from its ``metrics.jsonl`` records (the steps already trained)."""
        alerts = cls(repeat_every=repeat_every or REPEAT_EVERY)
        for record in records:
            alerts.seen_evaluation(record)
            if "train/applied_updates" not in record:  # step 0's evaluation, or an evaluation-only line
                continue
            alerts.steps += 1
            for name in CONDITIONS:
                alerts.counts[name] += int(bool(record.get(PREFIX + name)))
        return alerts

    @classmethod
    def of_run(cls, run_dir: Path, repeat_every: int | None = None) -> RunAlerts:
        """``from_records`` of the run folder's ``metrics.jsonl`` (none yet: a fresh run)."""
        from rollcorr.train.logging import read_metrics

        exists = (Path(run_dir) / "metrics.jsonl").is_file()
        return cls.from_records(read_metrics(run_dir) if exists else [], repeat_every)

    def _due(self, name: str) -> bool:
        return name not in self.said_at or self.counts[name] - self.said_at[name] >= self.repeat_every

    def observe(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Add ``alerts/*`` flags and counts to ``metrics`` (in place); return the messages to print now."""
        flags = step_conditions(metrics)
        if metrics.get("eval/accuracy") is not None:
            if self.last_accuracy is not None:
                metrics[PREFIX + "previous_accuracy"] = self.last_accuracy
                flags["accuracy_drop"] = accuracy_dropped(self.last_accuracy, float(metrics["eval/accuracy"]),
                                                          metrics.get("eval/prompts"))
            self.seen_evaluation(metrics)
        self.steps += 1
        for name, flag in flags.items():
            self.counts[name] += int(flag)
            metrics[PREFIX + name] = float(flag)
            metrics[f"{PREFIX}{name}_steps"] = float(self.counts[name])
        # one rejection message per step, the most severe one that is due; "rejected every token" implies
        # the other two and the zero gradient, which are then not said separately
        said = []
        order = ("rejected_all", "rejected_most_sequences", "rejected_most_tokens")
        for name in order:
            if flags[name]:
                if self._due(name):
                    said.append(self._say(step, name, metrics))
                break
        if flags["no_gradient"] and not flags["rejected_all"] and self._due("no_gradient"):
            said.append(self._say(step, "no_gradient", metrics))
        for name in ("accuracy_drop", "amp_overflow"):
            if flags[name] and self._due(name):
                said.append(self._say(step, name, metrics))
        return said

    def _say(self, step: int, name: str, metrics: dict[str, float]) -> str:
        n = self.counts[name]
        first = name not in self.said_at
        self.said_at[name] = n
        if first:
            tail = f"(first warning of this kind in this run; repeated every {self.repeat_every} such steps)"
        else:
            tail = f"(still happening: {n} of {self.steps} steps so far)"
        return f"warning: {describe(step, name, metrics)} {tail}"

    def summary(self) -> str | None:
        """ "37 of 150 steps rejected > 50 % of sequences; 12 steps had no gradient", or None if none did."""
        found = [(name, phrase) for name, phrase in CONDITIONS.items() if self.counts[name]]
        parts = [
            f"{self.counts[name]} of {self.steps} steps {phrase}"
            if i == 0
            else f"{self.counts[name]} step{'' if self.counts[name] == 1 else 's'} {phrase}"
            for i, (name, phrase) in enumerate(found)
        ]
        return "alerts: " + "; ".join(parts) if parts else None
