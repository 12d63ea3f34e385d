"""What would remove the mismatch — measured on the audited model, not quoted (``rollcorr audit --whatif``).

Each change reruns the sampler side with one thing different, on the same prompts, sampling parameters and
seed, and scores its tokens with the same learner; its row has the probability table of the audit
(``prob_diff_frac_*``, max and mean |Δp|, k3, the verdict level), so "fp16 would remove most of it" is a number
for this model. The changes:

- ``fp16`` / ``bf16`` / ``fp32``: the same engine in that precision (``fp32`` is the learner's: what is left is
  the engine's own path — its decode loop, kernels and cache — against the learner's forward);
- ``lm_head_fp32``: the same sampler with its lm-head in float32 (engines in this process: hf);
- ``batch``: the batch component, separated from precision — the sampler's forward of the same tokens with
  each response scored alone against all of them in one batch, so only the batch's composition differs
  (engines in this process: hf; a sampler whose kernels do not depend on the batch gives 0).

What applies is the audited engine's backend's to say (``Backend.in_process``, ``precisions``, ``with_dtype``).
``default_changes(spec)`` picks the ones that apply to it; a change that cannot apply is refused in one line
before any work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rollcorr.engines import backend_of, parse_spec
from rollcorr.engines.spec import FLOAT_DTYPES, backends_that

CHANGES = (*FLOAT_DTYPES, "lm_head_fp32", "batch")
IN_PROCESS = ("lm_head_fp32", "batch")  # changes that reach into the sampler's modules


def default_changes(spec: str) -> list[str]:
    """The changes worth measuring for a sampler: a bf16 one → fp16, lm_head_fp32, batch; fp16 → lm_head_fp32,
    batch; a quantised one (int8, rtn<k>, a GGUF type) → fp32 (and batch). lm_head_fp32 and batch only for a
    sampler in this process (``Backend.in_process``), a precision only one its backend can switch to."""
    parsed, backend = parse_spec(spec), backend_of(spec)
    here = backend.in_process
    if parsed.quant is not None or parsed.dtype is None:  # quantised, or chosen by a backend's own option
        changes = ["fp32"] + (["batch"] if here else [])
    elif parsed.dtype == "bf16":
        changes = ["fp16"] + (list(IN_PROCESS) if here else [])
    elif parsed.dtype == "fp16":
        changes = list(IN_PROCESS) if here else ["fp32"]
    else:
        changes = ["batch"] if here else []
    return [c for c in changes if c not in FLOAT_DTYPES or c in backend.precisions]


def parse_changes(text: str | None, spec: str) -> list[str]:
    """``--whatif`` (a comma list, or empty for the engine's defaults) → changes; ValueError naming one that does
    not exist or cannot apply to ``spec``."""
    if not text:
        return default_changes(spec)
    backend = backend_of(spec)
    named = [c.strip() for c in text.split(",") if c.strip()]
    if not named:  # "," or " , ": a list of nothing would measure nothing and say nothing
        raise ValueError(f"--whatif {text!r}: names no change; give some of {', '.join(CHANGES)} (comma-separated), "
                         "or --whatif alone for the ones that apply to the sampler")
    out = []
    for change in named:
        if change not in CHANGES:
            raise ValueError(f"--whatif: unknown change {change!r}; use any of {', '.join(CHANGES)}")
        if change in IN_PROCESS and not backend.in_process:
            raise ValueError(f"--whatif {change}: needs the sampler's modules in this process (an "
                             f"{' / '.join(backends_that('in_process'))} sampler); {spec} runs its own kernels")
        if change in FLOAT_DTYPES:
            try:
                changed_spec(spec, change)
            except ValueError as err:
                raise ValueError(f"--whatif {change}: {err}") from None
        out.append(change)
    return out


def changed_spec(spec: str, change: str) -> str:
    """The sampler spec a precision change gives (options such as the attention kept): ``Backend.with_dtype``."""
    return backend_of(spec).with_dtype(parse_spec(spec), change)


def _table(log_mu: torch.Tensor, log_old: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    from rollcorr.audit.stats import audit_stats

    stats = audit_stats(log_mu, log_old, mask)
    return {**stats["probability"], "k3_kl": stats["divergence"]["k3_kl"], "verdict_level": stats["verdict_level"]["level"],
            "n_tokens": stats["n_tokens"]}


@torch.no_grad()
def batch_component(sampler, rollout) -> dict[str, Any]:
    """The sampler's forward of the audited tokens, each response alone against all in one batch: the table of
    the |Δp| that the batch's composition alone makes."""
    from rollcorr.audit.localize import response_log_probs

    model = sampler.model
    device = next(model.parameters()).device
    ids = torch.cat([rollout.prompt_ids, rollout.response_ids], 1).to(device)
    mask = rollout.attention_mask.to(device)  # the environment's tokens of a trajectory attended, as the learner does
    targets, p = rollout.response_ids.to(device), rollout.prompt_ids.shape[1]
    together = response_log_probs(model, ids, mask, p, targets, 1.0)
    alone = torch.cat([response_log_probs(model, ids[i : i + 1], mask[i : i + 1], p, targets[i : i + 1], 1.0)
                       for i in range(ids.shape[0])])
    valid = rollout.response_mask.bool()
    return _table(alone.cpu().float(), together.cpu().float(), valid)


def run_whatif(changes: list[str], spec: str, make_sampler: Callable[..., Any], sample_and_score: Callable[[Any], Any],
               sampler, rollout, on_change: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per change. ``make_sampler(spec, **kwargs)`` builds a sampler like the audited one;
    ``sample_and_score(sampler)`` samples the audit's prompts with it and returns their ``AuditData``; ``sampler``
    and ``rollout`` are the audited ones (for ``batch``)."""
    rows = []
    for change in changes:
        if on_change is not None:
            on_change(change)
        if change == "batch":
            rows.append({"change": change, "sampler": spec, "what": "each response alone vs one batch, the sampler's "
                         "forward of the same tokens", **batch_component(sampler, rollout)})
            continue
        new_spec, kwargs = (spec, {"head_fp32": True}) if change == "lm_head_fp32" else (changed_spec(spec, change), {})
        other = make_sampler(new_spec, **kwargs)
        try:
            scored = sample_and_score(other)
        finally:
            getattr(other, "close", lambda: None)()
        table = _table(scored.rollout_log_prob, scored.old_log_prob, scored.response_mask.bool())  # an AuditData
        rows.append({"change": change, "sampler": new_spec + (" (lm-head fp32)" if kwargs else ""), **table})
    return rows
