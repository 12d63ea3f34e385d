"""One training step, read top to bottom as one walk over a ``Rollout`` (docs/architecture.md):

    rollout (tokens, μ, per-token versions, rewards)           ← executor
    rollout.old_log_prob = proximal.old_log_prob(...)           ← π_old by the chosen strategy
    (OPSM only: rollout.advantages = advantages(...) here)      ← OPSM reads them; otherwise computed below
    corr = compute_correction(old, μ, mask, config)             ← is_weights, kept_mask, metrics
    proximal.after_correction(rollout, version)                 ← the strategy sees the keep share and lag
    rollout.advantages = advantages(rewards, groups, kept)      ← rejected rows out of the baselines
    for epoch, mini-batch, micro-batch: policy_loss → backward   ← π_θ with gradient
    optimizer step (skipped when the loss or a gradient is not finite; undone when a weight becomes non-finite)

The learner's weight version does not change inside ``train_step``: the caller publishes afterwards.

Data-parallel from the first line (``ranks``, rollcorr.distributed; one process is a group of one, whose
collectives return their input): every rank holds the whole rewarded rollout, but runs the model — π_old,
log π_θ, backward — only on its rows (``distributed.split``: whole groups, an equal share of each mini-batch).
The per-token log-probs are all-gathered (one (B, T) tensor each), so the correction, its ``rollout_corr/*``
metrics (quantile-free, but maxima, minima, std and ESS exact too), the advantages and the reward metrics are
computed on the global batch on every rank. Each part's loss is scaled by its share of the global
mini-batch's loss count (``count_of``), so the gradient summed over ranks and micro-batches is the
global-batch gradient.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rollcorr.advantages import compute_advantages, turn_advantages
from rollcorr.config.correction import CorrectionConfig
from rollcorr.correction.weights import LOCAL
from rollcorr.distributed.ranks import ONE_PROCESS, Ranks
from rollcorr.distributed.split import rank_rows
from rollcorr.envs import episode_metrics
from rollcorr.losses import LossConfig, masked_mean, policy_loss
from rollcorr.losses.aggregation import loss_count
from rollcorr.moe import RoutingFlips
from rollcorr.rollout import Rollout
from rollcorr.shards import local_tensor
from rollcorr.train.memory import release_freed


@dataclass(frozen=True)
class StepConfig:
    """Everything one training step needs to know, resolved once from a ``TrainConfig``
    (``rollcorr.train.build.build_step_config``)."""

    loss: LossConfig
    correction: CorrectionConfig
    advantage: str  # grpo | rloo | drgrpo | oapl
    norm_std: bool
    dynamic_sampling: bool
    baseline_excludes_rejected: bool
    oapl_beta1: float
    temperature: float  # the sampler's temperature: the learner scores with the same one
    mini_batches: int = 1
    micro_batch_size: int = 0  # 0 = whole mini-batch
    ppo_epochs: int = 1
    grad_clip: float = 1.0
    skip_zero_grad: bool = True  # no optimizer step when the gradient is exactly zero (see optimize)
    publish_every: int = 1  # weights go to the sampler every N versions (OAPL: algorithm.oapl_sync_every)
    advantage_level: str = "trajectory"  # multi-turn: "turn" gives each turn its reward-to-go's advantage
    kl_coef: float = 0.0  # algorithm.kl: β of the KL term to the frozen reference (0: none)
    kl_estimator: str = "low_var_kl"
    kl_where: str = "loss"  # loss | reward
    mask_truncated: bool = False  # responses cut at the token cap leave the loss (rollout.mask_truncated)
    max_new_tokens: int = 0  # the response cap (DAPO's overlong punishment measures from it)
    overlong_buffer: int = 0  # DAPO's soft overlong punishment (0: off) and its factor
    overlong_penalty: float = 1.0

    @property
    def advantages_first(self) -> bool:
        """Whether the correction reads the advantages (OPSM), so they are computed before it."""
        return self.correction.opsm_delta is not None


@dataclass
class StepResult:
    """What one step did: its metrics, and the optimizer steps skipped for a non-finite loss, gradient or weight."""

    metrics: dict[str, float] = field(default_factory=dict)
    skipped_updates: int = 0
    rollout: Rollout | None = None  # the global batch as trained: old log-probs, weights, kept mask, advantages


def _float_metrics(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def check_rewards(rollout: Rollout) -> None:
    """The task's rewards (B,) are finite: the advantages, the loss and the reward metrics read them."""
    bad = ~torch.isfinite(rollout.rewards.float())
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(f"rollout.rewards: {len(rows)} non-finite reward(s) (rows {rows[:8]}); a task's reward "
                         "must be a finite number")


def truncated_rows(rollout: Rollout) -> Tensor:
    """(B,) bool: the responses cut at the token cap, their last token not EOS (``meta[i]["truncated"]``, set when
    the batch is rewarded: ``train.source.RolloutSource.reward``); False for rows without the flag."""
    return torch.tensor([bool(m.get("truncated", False)) for m in rollout.meta] if rollout.meta
                        else [False] * rollout.batch_size, dtype=torch.bool)


def reward_metrics(rollout: Rollout) -> dict[str, float]:
    """Rewards and lengths (the model's tokens), as TRL names them where it has them: ``clipped_ratio`` (cut at
    the token cap), the mean length of the responses that ended (EOS; NaN when none did), and the share of groups
    whose rewards are all equal (TRL's frac_reward_zero_std: no advantage, no gradient from them); a batch of
    trajectories adds ``env/…`` (``episode_metrics``)."""
    rewards = rollout.rewards.float()
    lengths = rollout.response_mask.float().sum(1)
    cut = truncated_rows(rollout)
    _, group = torch.unique(rollout.group_ids, return_inverse=True)
    low = torch.full((int(group.max()) + 1,), math.inf).scatter_reduce(0, group, rewards, "amin")
    high = torch.full_like(low, -math.inf).scatter_reduce(0, group, rewards, "amax")
    return {
        **reward_part_metrics(rollout),
        "reward/mean": float(rewards.mean()),
        "reward/accuracy": float((rewards >= 1.0).float().mean()),
        "reward/zero_std_group_fraction": float((low == high).float().mean()),
        "response/length_mean": float(lengths.mean()),
        "response/tokens": float(lengths.sum()),
        **episode_metrics(rollout),
        "response/clipped_ratio": float(cut.float().mean()),
        "response/terminated_length_mean": float(lengths[~cut].mean()) if (~cut).any() else math.nan,
    }


def reward_part_metrics(rollout: Rollout) -> dict[str, float]:
    """``reward/<name>/mean`` and ``/std`` of each function of a reward list (``meta[i]["reward_parts"]``, TRL's
    ``rewards/<name>/mean``), over the responses it scored (a batched function's None left out); {} without one."""
    parts: dict[str, list[float]] = {}
    for meta in rollout.meta:
        for name, value in meta.get("reward_parts", {}).items():
            if not math.isnan(value):
                parts.setdefault(name, []).append(value)
    out = {}
    for name, values in parts.items():
        v = torch.tensor(values, dtype=torch.float64)
        out[f"reward/{name}/mean"] = float(v.mean())
        out[f"reward/{name}/std"] = float(v.std(correction=0))
    return out


def shaped_rewards(rollout: Rollout, config: StepConfig) -> tuple[Rollout, dict[str, float]]:
    """The rewards the advantages read: the task's, minus DAPO's soft overlong punishment (verl's overlong_buffer:
    min(−(|y| − (L − buffer)) / buffer · penalty, 0), L = max_new_tokens) and, with ``algorithm.kl.where=reward``,
    β · Σ_t KL(π_old ‖ π_ref) (verl's apply_kl_penalty). Unchanged (and no metric) without either."""
    penalty = torch.zeros(rollout.batch_size, dtype=torch.float32)
    metrics = {}
    if config.overlong_buffer > 0:
        exceed = rollout.response_mask.float().sum(1) - (config.max_new_tokens - config.overlong_buffer)
        overlong = (-exceed / config.overlong_buffer * config.overlong_penalty).clamp(max=0.0)
        penalty = penalty - overlong
        metrics["reward/overlong_penalty_mean"] = float(-overlong.mean())
    if config.kl_coef and config.kl_where == "reward" and rollout.ref_log_prob is not None:
        from rollcorr.losses.kl import kl_reward_penalty

        kl = config.kl_coef * kl_reward_penalty(rollout.old_log_prob, rollout.ref_log_prob, rollout.response_mask,
                                                config.kl_estimator).float().cpu()
        penalty = penalty + kl
        metrics["reward/kl_penalty_mean"] = float(kl.mean())
    if not metrics:
        return rollout, metrics
    rewards = rollout.rewards.float() - penalty
    metrics["reward/shaped_mean"] = float(rewards.mean())
    return rollout.replace(rewards=rewards), metrics


def attach_correction(
    rollout: Rollout, config: StepConfig, log_prob: Tensor | None, group: object | None = None
) -> tuple[Rollout, dict]:
    """Attach ``is_weights`` and ``kept_mask`` (docs/spec.md §2–3); returns the rollout and the metrics.

    ``log_prob``: detached log π_θ before the update when available (required in bypass mode, where the
    ratio is π_θ/μ); it also enables the correction's discrepancy/drift metrics. OPSM reads
    ``rollout.advantages``. The version lag is not the correction's business: ``Rollout.lag_metrics`` logs it.
    ``group``: the batch normalisation's process group (``correction.weights.LOCAL``: the rollout is already the
    global batch).
    """
    from rollcorr.correction import compute_correction, metrics_to_floats

    if rollout.rollout_log_prob is None:
        raise ValueError("the sampler returned no rollout_log_prob: the correction needs log μ")
    res = compute_correction(
        rollout.old_log_prob,
        rollout.rollout_log_prob,
        rollout.response_mask,
        config.correction,
        log_prob=log_prob,
        advantages=rollout.advantages,
        log_kept_mass=rollout.log_kept_mass,
        warn=False,  # the trainer says it in words through train/alerts.py
        group=group,
    )
    kept = res.kept_mask.bool() & rollout.response_mask.bool()
    weights = None if res.is_weights is None else res.is_weights.detach()
    return rollout.replace(is_weights=weights, kept_mask=kept), metrics_to_floats(res.metrics)


def attach_reference(rollout: Rollout, own: Rollout, learner, reference, config: StepConfig, everyone
                     ) -> tuple[Rollout, dict[str, float]]:
    """``ref_log_prob`` from the frozen reference (this rank's rows scored, every rank's gathered) and
    ``kl/reference``: the mean per-token estimate of KL(π_old ‖ π_ref) over valid tokens (``config.kl_estimator``)."""
    from rollcorr.losses.kl import kl_penalty

    start = time.perf_counter()
    ref = everyone(reference.log_prob(learner, own, config.temperature))
    mask = rollout.response_mask.bool().to(ref.device)
    old = rollout.old_log_prob.to(ref.device)
    kl = kl_penalty(torch.where(mask, old, 0.0), torch.where(mask, ref, 0.0), config.kl_estimator.removesuffix("+"))
    metrics = {"kl/reference": float(masked_mean(kl, mask)), "time/reference_s": time.perf_counter() - start}
    return rollout.replace(ref_log_prob=ref), metrics


def attach_advantages(rollout: Rollout, config: StepConfig) -> tuple[Rollout, Tensor, dict[str, float]]:
    """(B, T) advantages from rewards and group ids; returns (rollout, rows used (B,), metrics).

    With ``baseline_excludes_rejected`` a sequence with no kept token leaves its group's mean / std; with
    ``dynamic_sampling`` groups whose rewards are all equal are dropped (DAPO).
    """
    valid = rollout.response_mask.bool().any(1)
    kept = rollout.kept_mask.any(1) if config.baseline_excludes_rejected else valid
    options = dict(keep=kept & valid, norm_std=config.norm_std, beta1=config.oapl_beta1,
                   filter_uniform_groups=config.dynamic_sampling)
    if config.advantage_level == "turn" and rollout.turn is not None:
        turns = rollout.turns
        per_turn = [m.get("turn_rewards", [float(r)]) for m, r in zip(rollout.meta, rollout.rewards.tolist())]
        table = torch.zeros(rollout.batch_size, int(turns.max()))
        for i, values in enumerate(per_turn):
            table[i, : len(values)] = torch.tensor(values[: table.shape[1]])
        adv, used = turn_advantages(config.advantage, table, turns, rollout.group_ids, rollout.turn,
                                    rollout.kept_mask, **options)
    else:
        adv, used = compute_advantages(config.advantage, rollout.rewards.float(), rollout.group_ids,
                                       rollout.kept_mask, **options)
    metrics = {
        "advantage/abs_mean": float(adv.abs().sum() / rollout.kept_mask.sum().clamp_min(1)),
        "advantage/used_fraction": float(used.float().mean()),
    }
    return rollout.replace(advantages=adv), used, metrics


def _loss(config: StepConfig, part: Rollout, log_prob: Tensor, generator: torch.Generator | None
          ) -> tuple[Tensor, dict]:
    """``config.loss`` on one micro-batch's kept tokens: a regression loss (OAPL) regresses on log μ and the
    rewards, every other loss takes π_old, the advantages and the correction's weights (clip_cov also the
    run's generator for its draw)."""
    if config.loss.regresses_on_rollout:
        return policy_loss(
            config.loss,
            log_prob,
            None,
            None,
            part.kept_mask,
            rollout_log_prob=part.rollout_log_prob,
            rewards=part.rewards.float(),
            group_ids=part.group_ids,
            denominator_mask=part.response_mask,
        )
    loss, metrics = policy_loss(
        config.loss,
        log_prob,
        part.old_log_prob,
        part.advantages,
        part.kept_mask,
        weights=part.is_weights,
        denominator_mask=part.response_mask,
        generator=generator,
    )
    if config.kl_coef and config.kl_where == "loss" and part.ref_log_prob is not None:  # β · KL(π_θ ‖ π_ref)
        from rollcorr.losses.kl import kl_loss

        kl = kl_loss(log_prob, part.ref_log_prob.to(log_prob.device), part.kept_mask, config.kl_estimator,
                     config.loss.agg_mode, per_sequence=config.loss.per_sequence, denominator=config.loss.denominator,
                     denominator_mask=part.response_mask, norm_constant=config.loss.norm_constant)
        loss = loss + config.kl_coef * kl
        metrics = {**metrics, "actor/kl_loss": kl.detach()}
    return loss, metrics


def _finite_on(mask: Tensor, x: Tensor) -> bool:
    """(B, T) ``x`` is finite where ``mask`` is set."""
    return bool(torch.isfinite(x.detach()[mask.bool()]).all())


def renormalize(part: Rollout, config: StepConfig, scope: str) -> Rollout:
    """``part`` with its IS weights divided by their mean over ``part`` when the correction normalises them
    per ``scope`` (``batch_norm_scope`` mini_batch | micro_batch; ``compute_correction`` already normalised
    over the whole batch, and w/mean_part(w/f) = w/mean_part(w), so re-normalising a part is exact)."""
    c = config.correction
    if not c.batch_normalize or c.batch_norm_scope != scope or part.is_weights is None:
        return part
    from rollcorr.correction.weights import norm_factor

    mask = part.response_mask.bool()
    factor = norm_factor(part.is_weights, mask.sum(-1), mask.any(-1), c.is_level)
    return part.replace(is_weights=part.is_weights / factor)


def mini_batch_rows(batch_size: int, mini_batches: int) -> list[list[int]]:
    """Rows of each mini-batch: ``mini_batches`` equal runs of consecutive rows (whole groups: the config's rule,
    ``distributed.split.split_problem``)."""
    size = batch_size // mini_batches
    return [list(range(i, i + size)) for i in range(0, batch_size, size)]


def _micro_batches(n: int, size: int) -> list[list[int]]:
    size = n if size <= 0 else size
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def count_of(config: StepConfig, part: Rollout) -> float | None:
    """The count ``config.loss`` divides by on ``part`` (``losses.aggregation.loss_count``: tokens or sequences;
    None: token-sum). A part's loss scaled by count(part) / count(global mini-batch) — on any rank, in any
    micro-batch — adds up to the global mini-batch's loss (verl's global-batch normalisation)."""
    count = loss_count(part.kept_mask, config.loss.agg_mode, denominator=config.loss.denominator,
                       denominator_mask=part.response_mask, per_sequence=config.loss.per_sequence)
    return None if count is None else float(count)


@dataclass(frozen=True)
class RowSplit:
    """A batch's rows (global indices) as this rank trains on them (``distributed.split``; one process: all)."""

    mini_batches: list[list[int]]  # every mini-batch's rows
    shares: list[list[int]]  # this rank's share of each mini-batch
    order: list[int]  # every rank's rows, rank 0's first: the order ``Ranks.gather_rows`` returns them in

    @classmethod
    def of(cls, rollout: Rollout, config: StepConfig, ranks: Ranks) -> RowSplit:
        minis = mini_batch_rows(rollout.batch_size, config.mini_batches)
        per_rank = [rank_rows(minis, rollout.group_ids, r, ranks.world) for r in range(ranks.world)]
        return cls(minis, per_rank[ranks.rank], [row for rows in per_rank for share in rows for row in share])

    @property
    def own_rows(self) -> list[int]:
        return [row for share in self.shares for row in share]

    def gather(self, x: Tensor, ranks: Ranks) -> Tensor:
        """Every rank's (rows of its shares, T) tensor → the (B, T) tensor in the batch's row order."""
        gathered = ranks.gather_rows(x)
        full = torch.empty_like(gathered)
        full[torch.tensor(self.order, device=full.device)] = gathered
        return full


@dataclass
class Updates:
    """What ``optimize``'s mini-batches came to: each ends in exactly one way, counted here, and the applied ones'
    gradient norms and loss metrics are summed.

    applied            optimizer steps taken
    skipped            bad steps: a non-finite loss, gradient or weight (``train/skipped_updates``)
    nonfinite_weights  of those, a step undone because a weight became unusable (``GuardedStep``)
    amp_overflows      fp16 mixed precision: steps skipped for an overflow (not bad steps)
    zero_grads         mini-batches whose gradient was exactly zero (finite), skipped or not
    zero_grad_skips    of those, skipped (``skip_zero_grad``: every token rejected or every advantage zero)
    """

    applied: int = 0
    skipped: int = 0
    nonfinite_weights: int = 0
    amp_overflows: int = 0
    zero_grads: int = 0
    zero_grad_skips: int = 0
    grad_norms: float = 0.0  # summed over the applied mini-batches (global norms)
    loss_sums: dict[str, float] = field(default_factory=dict)  # this rank's part of the applied ones' loss metrics
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("loss_forward", "backward", "optimizer"), 0.0))

    def add(self, step_metrics: dict[str, float], grad_norm: float) -> None:
        """An applied mini-batch: its gradient norm and this rank's part of its loss metrics."""
        self.applied += 1
        self.grad_norms += grad_norm
        for k, v in step_metrics.items():
            self.loss_sums[k] = self.loss_sums.get(k, 0.0) + v

    def metrics(self, ranks: Ranks, loss_scaler=None) -> dict[str, float]:
        """The loss metrics averaged over the applied steps (summed over the ranks once: every rank applied the same
        mini-batches, so the same keys), the counters, and where the time went."""
        keys = sorted(self.loss_sums)
        summed = ranks.all_reduce(torch.tensor([self.loss_sums[k] for k in keys], dtype=torch.float64)) if keys else None
        metrics = {k: summed[keys.index(k)].item() / max(self.applied, 1) for k in self.loss_sums}
        if self.applied:
            metrics["loss/grad_norm"] = self.grad_norms / self.applied
        metrics["train/zero_grad_skips"] = float(self.zero_grad_skips)
        metrics["train/nonfinite_weight_steps"] = float(self.nonfinite_weights)
        metrics["train/zero_grad_minibatches"] = float(self.zero_grads)
        if loss_scaler is not None:  # fp16 mixed precision: steps skipped for an overflow, and the scale now
            metrics["train/amp_overflow_skips"] = float(self.amp_overflows)
            metrics["train/amp_loss_scale"] = float(loss_scaler.scale)
        metrics.update({f"time/{name}_s": value for name, value in self.seconds.items()})
        return metrics


def optimize(
    rollout: Rollout,
    learner,
    optimizer: torch.optim.Optimizer,
    config: StepConfig,
    split: RowSplit,
    after_optimizer_step=None,
    generator: torch.Generator | None = None,
    ranks: Ranks = ONE_PROCESS,
    loss_scaler=None,
) -> tuple[dict[str, float], Updates]:
    """PPO epochs × mini-batches of optimizer steps over ``rollout``'s kept tokens (``kept_mask``).

    Each mini-batch: this rank's micro-batches accumulate its gradient (``_accumulate``), then one optimizer step
    or the reason there is none (``_step``); ``Updates`` counts how each ended. Returns (metrics averaged over
    optimizer steps, the ``Updates``). A mixture-of-experts rollout with routing also gets
    ``routing/flip_share`` and ``routing/flip_token_share`` from the first epoch's forwards (``RoutingFlips``).
    """
    params = [p for p in learner.model.parameters() if p.requires_grad]
    updates = Updates()
    guarded_step = GuardedStep(optimizer, params, ranks)
    routing = RoutingFlips(learner.model, rollout)
    release_freed()  # what sampling and π_old's forward freed: their pages back before the updates' forwards
    for epoch in range(config.ppo_epochs):
        for rows, own_rows in zip(split.mini_batches, split.shares):
            optimizer.zero_grad(set_to_none=True)
            finite, step_metrics = _accumulate(rollout, rows, own_rows, learner, config, updates, routing,
                                               measure=epoch == 0, generator=generator, ranks=ranks,
                                               loss_scaler=loss_scaler)
            release_freed()  # the forward's activations, freed by the backward: their pages back before AdamW's step
            grad_norm = _step(finite, params, optimizer, config, updates, guarded_step, ranks, loss_scaler)
            if grad_norm is None:
                continue
            updates.add(step_metrics, grad_norm)
            if after_optimizer_step is not None:
                after_optimizer_step(learner.model)
    optimizer.zero_grad(set_to_none=True)
    metrics = updates.metrics(ranks, loss_scaler)
    metrics.update(routing.metrics(ranks.all_reduce))
    return metrics, updates


def _accumulate(rollout: Rollout, rows: list[int], own_rows: list[int], learner, config: StepConfig, updates: Updates,
                routing: RoutingFlips, *, measure: bool, generator, ranks: Ranks, loss_scaler
                ) -> tuple[bool, dict[str, float]]:
    """The gradient of one global mini-batch (``rows``), this rank's share of it (``own_rows``) micro-batch by
    micro-batch: each micro loss is scaled by its share of the mini-batch's loss count (``count_of``: tokens,
    sequences, or none for token-sum), so the gradient summed over micro-batches and ranks is the mini-batch's.
    Returns (whether every loss was finite, this rank's part of the loss metrics: each weighted by its part's
    share, exact for metrics averaged as the loss is). Diverged weights give NaN/inf log-probs: a bad step."""
    mini = renormalize(rollout.select(rows), config, "mini_batch")  # the global mini-batch
    total = count_of(config, mini)
    first = rows.index(own_rows[0])  # a rank's share is a contiguous slice of the mini-batch
    own = mini if own_rows == rows else mini.select(list(range(first, first + len(own_rows))))
    # a sharded learner's gradients are reduce-scattered as the *mean* over ranks: scale by N to get their sum
    grad_scale = float(ranks.world)
    scale = loss_scaler.scale if loss_scaler is not None else 1.0  # fp16 amp: the loss scaled up
    step_metrics: dict[str, float] = {}
    for micro_rows in _micro_batches(len(own_rows), config.micro_batch_size):
        part = own.select(micro_rows) if len(micro_rows) < len(own_rows) else own
        part = renormalize(part, config, "micro_batch")
        count = count_of(config, part)
        share = 1.0 if total is None else count / max(total, 1.0)
        clock = time.perf_counter()
        with routing.scoring(part, measure=measure):
            log_prob, entropy = learner.log_prob(part, temperature=config.temperature, grad=True, with_entropy=True)
        loss, metrics = None, {}
        ok = _finite_on(part.response_mask, log_prob)  # π_old was checked by its strategy
        if ok:
            loss, metrics = _loss(config, part, log_prob, generator)
            ok = bool(torch.isfinite(loss))
        if ranks.backward_is_collective:  # every rank takes the same branch around FSDP's collectives
            ok = ranks.all_true(ok)
        updates.seconds["loss_forward"] += time.perf_counter() - clock
        if not ok:
            return False, step_metrics
        clock = time.perf_counter()
        (loss * (share * grad_scale * scale)).backward()
        updates.seconds["backward"] += time.perf_counter() - clock
        step_metrics["loss/policy"] = step_metrics.get("loss/policy", 0.0) + float(loss.detach()) * share
        for k, v in _float_metrics(metrics).items():
            step_metrics[k] = step_metrics.get(k, 0.0) + v * share
        # entropy: a mean over valid tokens, weighted by the part's share of them
        tokens = float(part.response_mask.sum()) / max(float(mini.response_mask.sum()), 1.0)
        entropy_mean = float(masked_mean(entropy.detach(), part.response_mask))
        step_metrics["actor/entropy"] = step_metrics.get("actor/entropy", 0.0) + tokens * entropy_mean
    return True, step_metrics


def _step(finite: bool, params: list[Tensor], optimizer: torch.optim.Optimizer, config: StepConfig, updates: Updates,
          guarded_step: GuardedStep, ranks: Ranks, loss_scaler) -> float | None:
    """One mini-batch's optimizer step from its accumulated gradient: the gradient norm when the step was taken,
    None when it was not (counted in ``updates`` by why). A replicated learner's gradients are averaged over the
    ranks first, with whether every rank's loss was finite."""
    finite = ranks.reduce_gradients(params, finite)
    if finite and loss_scaler is not None:  # unscale; an overflow skips this step (not a bad step)
        unscaled = ranks.all_true(loss_scaler.unscale(params))
        loss_scaler.update(unscaled)
        if not unscaled:
            optimizer.zero_grad(set_to_none=True)
            updates.amp_overflows += 1
            return None
    grad_norm = _grad_norm(params, config.grad_clip) if finite else float("nan")
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        updates.skipped += 1
        return None
    updates.zero_grads += grad_norm == 0.0
    if config.skip_zero_grad and grad_norm == 0.0:
        # Every token rejected, or every advantage zero. Adam would still move the weights by its
        # momentum m/√v (and v keeps decaying, which inflates the next real step): skip it entirely.
        updates.zero_grad_skips += 1
        return None
    clock = time.perf_counter()
    stepped = guarded_step()
    updates.seconds["optimizer"] += time.perf_counter() - clock
    if not stepped:  # weights would turn NaN/inf: undone, a bad step
        updates.skipped += 1
        updates.nonfinite_weights += 1
        return None
    return grad_norm


class GuardedStep:
    """``optimizer.step()``, taken only when no weight would become unusable (else nothing changes).

    A finite loss and gradient can still give unusable weights (lr = 1e30; fp16 AdamW, whose eps rounds to 0),
    and those must never be published or checkpointed. Unusable: NaN/inf, or so large that its square
    overflows the dtype (|w| > √max, 1.8e19 in fp32), since every norm or dot product with it is then inf.

    The step is tried first one parameter at a time (a dry run): the parameter's weight and optimizer state are
    copied aside, the optimizer steps it alone (every other gradient set aside, so it skips them), its max |w| is
    kept, and weight and state are put back. Only when no parameter came out unusable does the real step run. An
    update of a parameter that reads only its own gradient and state (SGD, Adam, AdamW: what the trainer builds)
    is the same alone as within the whole step, element for element, so the dry run sees exactly what the step
    writes. It costs the optimizer's arithmetic twice and copies of one parameter (with its state) at a time —
    not a copy of every weight and every moment, which for a 135 M-parameter model was 1.6 GB held through
    each step.

    Sharded parameters (FSDP2 ``DTensor``): each rank tries its own shards, and a max over ``ranks`` makes every
    rank take the same decision. A replicated learner's ranks hold equal weights (the same AdamW step from the
    same all-reduced gradients), so each decides alone, as every other rank does.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[Tensor], ranks: Ranks = ONE_PROCESS) -> None:
        self.optimizer, self.params = optimizer, params
        self.ranks = ranks
        # |w| limit of each non-empty tensor (a shard is empty when N > its rows: nothing to check there)
        self._limits = {i: math.sqrt(torch.finfo(p.dtype).max) for i, p in enumerate(params) if local_tensor(p).numel()}

    @torch.no_grad()
    def _try_alone(self, param: Tensor, limit: float) -> Tensor:
        """max |w| / limit of ``param`` after the step (float64; NaN when a weight is NaN), weight and optimizer
        state left as they were (a parameter without state yet has none again)."""
        weight = local_tensor(param)
        kept_weight = weight.clone()
        state = self.optimizer.state.get(param)
        kept = {k: local_tensor(v).clone() if isinstance(v, Tensor) else v for k, v in state.items()} if state else None
        self.optimizer.step()
        ratio = weight.abs().amax().double() / limit
        weight.copy_(kept_weight)
        if kept is None:
            self.optimizer.state.pop(param, None)
            return ratio
        state = self.optimizer.state[param]
        for key, value in kept.items():
            if isinstance(value, Tensor):
                local_tensor(state[key]).copy_(value)
            else:
                state[key] = value
        return ratio

    @torch.no_grad()
    def __call__(self) -> bool:
        """Take the step; False (and nothing changed) if a weight would become unusable."""
        stepped = [p for group in self.optimizer.param_groups for p in group["params"]]
        grads = {id(p): p.grad for p in stepped}
        for p in stepped:
            p.grad = None
        ratios = []
        try:
            for i, param in enumerate(self.params):
                if i in self._limits and grads.get(id(param)) is not None:
                    param.grad = grads[id(param)]
                    ratios.append(self._try_alone(param, self._limits[i]))
                    param.grad = None
        finally:
            for p in stepped:
                p.grad = grads[id(p)]
        # the largest ratio (NaN counts as unusable; 0: nothing to check), one sync for all of them
        largest = (torch.stack(ratios).max() if ratios else torch.zeros((), dtype=torch.float64)).nan_to_num(nan=math.inf)
        if not self.ranks.holds_whole_model:  # shards: the largest over the ranks
            largest = self.ranks.all_reduce(largest, "max")
        if not bool(largest <= 1.0):
            return False
        self.optimizer.step()
        return True


def _grad_norm(params: list[Tensor], max_norm: float) -> float:
    """Global gradient norm (before clipping); clips in place when ``max_norm`` > 0. NaN/inf propagate.
    Sharded gradients (``DTensor``): the norm over every rank's shards (a collective)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)
    else:
        norm = torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def log_prob_before_update(rollout: Rollout, own: Rollout, learner, proximal, prox, config: StepConfig, exact: bool,
                           everyone) -> Tensor | None:
    """(B, T) log π_θ before the update, or None: read only in bypass mode (the ratio is π_θ/μ) and when π_old is
    exact (the discrepancy × drift factors). Free under recompute (π_θ is π_old, already gathered); otherwise this
    rank's rows scored without gradient and gathered."""
    if config.correction.mode != "bypass" and not exact:
        return None
    current = proximal.current_log_prob(prox)
    if current is prox.old_log_prob:  # recompute: π_θ is π_old, gathered already
        return rollout.old_log_prob
    if current is None:
        with torch.no_grad():
            current = learner.log_prob(own, temperature=config.temperature, grad=False)
            current = current[0] if isinstance(current, tuple) else current
    return everyone(current)


def correct_and_advantage(rollout: Rollout, config: StepConfig, current: Tensor | None, proximal, version: int
                          ) -> tuple[Rollout, dict[str, float]]:
    """The correction (``is_weights``, ``kept_mask``) and the advantages of the global batch, in the order the
    correction needs; the rollout's ``kept_mask`` then holds the tokens the loss sees. ``current``: log π_θ before
    the update, when read (bypass, the factor metrics)."""
    metrics: dict[str, float] = {}
    # OPSM reads the advantages: then they are computed before the correction, every valid sequence in the
    # baselines (as DeepSeek-V3.2 and slime do), and the loss uses the same ones; otherwise after it, with
    # rejected sequences out of the baselines. One advantages pass either way.
    if config.advantages_first:
        rollout, used, adv_metrics = attach_advantages(rollout.replace(kept_mask=rollout.response_mask.bool()), config)

    # correction: IS weights, rejection mask, the verl-named diagnostics
    # the correction sees the global batch on every rank: its batch normalisation needs no all-reduce (LOCAL)
    rollout, corr_metrics = attach_correction(rollout, config, current, group=LOCAL)
    metrics.update(corr_metrics)
    proximal.after_correction(rollout, version)  # the strategy sees the keep share and the measured lag

    # advantages (dynamic sampling drops uniform groups); the loss sees the kept tokens of the rows they use
    if not config.advantages_first:
        rollout, used, adv_metrics = attach_advantages(rollout, config)
    metrics.update(adv_metrics)
    # the loss sees the kept tokens of the rows the advantages use; with rollout.mask_truncated not those of the
    # responses cut at the token cap (which stayed in their groups' baselines)
    used = used & ~truncated_rows(rollout).to(used.device) if config.mask_truncated else used
    rollout = rollout.replace(kept_mask=rollout.kept_mask & used[:, None])
    return rollout, metrics


def train_step(
    rollout: Rollout,
    learner,
    optimizer: torch.optim.Optimizer,
    proximal,
    config: StepConfig,
    version: int,
    generator: torch.Generator | None = None,
    ranks: Ranks = ONE_PROCESS,
    loss_scaler=None,
    reference=None,
) -> StepResult:
    """One walk from a rewarded rollout to updated learner weights (see module docstring).

    ``version`` is the learner's current weight version (the rollout's tokens carry their own, ≤ version);
    ``generator`` is the run's stream for the loss's random draw (clip_cov; None = torch's global RNG).
    ``ranks``: this rank of the data-parallel group (every rank passes the same global ``rollout``; see the
    module docstring). ``reference``: the frozen π_ref of ``algorithm.kl`` (``train.reference.FrozenReference``),
    scored after π_old; its KL term goes into the rewards or the loss (``config.kl_where``).
    """
    check_rewards(rollout)
    metrics = {**reward_metrics(rollout), **rollout.lag_metrics(version)}
    split = RowSplit.of(rollout, config, ranks)
    own = rollout if split.own_rows == list(range(rollout.batch_size)) else rollout.select(split.own_rows)

    def everyone(x: Tensor) -> Tensor:  # this rank's rows → the global batch's
        return split.gather(x, ranks)

    # π_old by the chosen strategy (timed, with its memory cost and, when measurable, its error)
    start = time.perf_counter()
    prox = proximal.old_log_prob(own, learner, version)
    rollout = rollout.replace(old_log_prob=everyone(prox.old_log_prob))
    metrics.update(prox.to_metrics("proximal/"))
    metrics["time/old_log_prob_s"] = time.perf_counter() - start
    if reference is not None:  # π_ref, and the KL estimate of π_old against it
        rollout, ref_metrics = attach_reference(rollout, own, learner, reference, config, everyone)
        metrics.update(ref_metrics)
    rollout, shaping = shaped_rewards(rollout, config)
    metrics.update(shaping)
    start = time.perf_counter()  # time/correction_s: log π_θ if needed, the correction, the advantages

    # log π_θ before the update, when the correction or the factor metrics need it (free under recompute)
    exact = proximal.is_exact(rollout, version)  # π_old is π_train(v_gen) for every token
    current = log_prob_before_update(rollout, own, learner, proximal, prox, config, exact, everyone)

    rollout, step_metrics = correct_and_advantage(rollout, config, current, proximal, version)
    metrics.update(step_metrics)

    # discrepancy × drift (docs/spec.md §1): exact when π_old is π_train(v_gen)
    if exact and current is not None and rollout.response_mask.any():
        from rollcorr.proximal.base import discrepancy_drift

        factors = discrepancy_drift(
            rollout.rollout_log_prob, rollout.old_log_prob, current, rollout.response_mask
        )
        metrics.update({f"factors/{k}": v for k, v in factors.items()})
    metrics["time/correction_s"] = time.perf_counter() - start

    start = time.perf_counter()
    opt_metrics, updates = optimize(
        rollout, learner, optimizer, config, split,
        after_optimizer_step=proximal.after_optimizer_step, generator=generator, ranks=ranks, loss_scaler=loss_scaler,
    )
    metrics.update(opt_metrics)
    metrics["time/optimize_s"] = time.perf_counter() - start
    metrics["train/skipped_updates"] = float(updates.skipped)
    metrics["train/applied_updates"] = float(updates.applied)
    return StepResult(metrics=metrics, skipped_updates=updates.skipped, rollout=rollout)
