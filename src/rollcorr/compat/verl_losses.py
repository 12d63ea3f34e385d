"""verl's policy losses under verl's calling convention, backed by `rollcorr.losses`.

`compute_policy_loss` reproduces verl (core_algos, newest snapshot) on
`tests/data/verl_vectors.json` and against the installed verl (`tests/test_verl_live.py`) — loss, metrics and d loss / d log_prob — for the loss modes
`vanilla`, `gspo`, `cispo`, `geo_mean` and the bypass `reinforce` loss. verl details kept on purpose:

- `vanilla` always applies the dual clip with `clip_ratio_c` (default 3.0, must be > 1);
- `gspo` aggregates with `loss_agg_mode` (verl 0.9.1; earlier verl forced `seq-mean-token-mean`);
- `geo_mean` ignores `loss_agg_mode`: plain mean over all B rows (fully-masked rows included);
- `reinforce` reads `old_log_prob` as the rollout log-prob (bypass sets π_old := μ) for its `ppo_kl` metric;
- `seq-mean-*` divide by the number of non-empty rows; `seq-mean-token-sum-norm` divides by that and by T;
- metrics are Python floats under verl's names (`actor/pg_clipfrac`, `actor/ppo_kl`,
  `actor/pg_clipfrac_lower`).

The other registered verl modes (`sapo`, `gpg`, `clip_cov`, `kl_cov`, `dppo_tv`, `dppo_kl`, `dro`) follow
verl's formulas (checked against hand-written float64 references in `tests/test_losses_verl_extra.py`; there
are no verl vectors for them): `sapo` forces `seq-mean-token-mean`; `gpg` returns no metric; `dppo_*` use
verl's value −A·sg(min(r, clip_ratio_c))·log π_θ·keep; `clip_cov` draws its tokens with ``generator``
(verl: the global RNG, so only the distribution of the draw can match, not the draw itself).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rollcorr.losses import AGG_MODES, LOSSES, aggregate
from rollcorr.losses.kl import KL_PENALTIES, kl_penalty  # noqa: F401 (verl's kl_penalty: one home, losses/kl.py)
from rollcorr.losses.registry import VerlCall

__all__ = ["LOSS_MODES", "agg_loss", "kl_penalty", "policy_loss_by_mode", "spec_of_mode", "verl_modes"]

# verl's loss modes of the built-in losses (their ``verl_name``); a loss registered later with a ``verl_name`` is a
# loss mode too (``verl_modes``, ``spec_of_mode``): the catalogue is read at each call, never a list kept here
LOSS_MODES = tuple(spec.verl_name for spec in LOSSES.values() if spec.verl_name is not None)


def verl_modes() -> tuple[str, ...]:
    """Every verl loss mode the catalogue serves now, in registration order."""
    return tuple(spec.verl_name for spec in LOSSES.values() if spec.verl_name is not None)


def spec_of_mode(loss_mode: str):
    """The catalogue's loss whose ``verl_name`` is ``loss_mode``; a one-line error naming the known ones."""
    for spec in LOSSES.values():
        if spec.verl_name == loss_mode:
            return spec
    raise ValueError(f"unsupported loss_mode {loss_mode!r}; choose one of {verl_modes()}")


def policy_loss_by_mode(
    loss_mode: str,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: Tensor | None = None,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
    dro_beta: float | None = 0.1,
    generator: torch.Generator | None = None,
    global_batch_info: dict[str, Any] | None = None,
    strict_verl: bool = False,
) -> tuple[Tensor, dict[str, Any]]:
    """verl's `compute_policy_loss_<mode>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
    config, rollout_is_weights)` with the config fields passed directly (defaults: verl's ActorConfig /
    PolicyLossConfig; `dro_beta` 0.1 is rollcorr's choice, None raises as verl's dro does). `global_batch_info`
    is verl's ``config.global_batch_info`` for `agg_loss`. ``strict_verl`` drops rollcorr's ±20 clamp of the
    log-ratio where verl has none (gspo's `actor/ppo_kl`, geo_mean, clip_cov, kl_cov) and lets an all-masked
    mean be NaN as in verl. Returns (scalar loss, metrics)."""
    spec = spec_of_mode(loss_mode)
    for name, value in (("old_log_prob", old_log_prob), ("advantages", advantages), ("mask", response_mask)):
        if value.shape != log_prob.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {tuple(log_prob.shape)}")
    if rollout_is_weights is not None and rollout_is_weights.shape != log_prob.shape:
        raise ValueError(
            f"rollout_is_weights has shape {tuple(rollout_is_weights.shape)}, expected {tuple(log_prob.shape)}"
        )
    positive = {"clip_cov": ("clip_cov_ratio", clip_cov_ratio), "kl_cov": ("kl_cov_ratio", kl_cov_ratio)}
    positive["dro"] = ("policy_loss.dro_beta", dro_beta)
    if loss_mode in positive and (positive[loss_mode][1] is None or not positive[loss_mode][1] > 0):
        raise ValueError(f"{positive[loss_mode][0]} must be > 0, got {positive[loss_mode][1]}")  # verl raises too
    call = VerlCall(log_prob, old_log_prob, advantages, response_mask, rollout_is_weights, clip_ratio_low,
                    clip_ratio_high, clip_ratio_c,
                    {"tau_pos": tau_pos, "tau_neg": tau_neg, "clip_cov_ratio": clip_cov_ratio, "clip_cov_lb": clip_cov_lb,
                     "clip_cov_ub": clip_cov_ub, "kl_cov_ratio": kl_cov_ratio, "ppo_kl_coef": ppo_kl_coef,
                     "dro_beta": dro_beta}, generator, strict_verl)
    loss, metrics, forced_agg, denominator = spec.call_as_verl(call)  # the spec's own adapter (rollcorr.losses)
    loss_agg_mode = forced_agg or loss_agg_mode
    if denominator == "batch":  # geo_mean: plain mean of the (B,) sequence losses, no global-batch info
        total = aggregate(loss, response_mask, loss_agg_mode, denominator=denominator)
    else:
        total = agg_loss(loss, response_mask, loss_agg_mode, **(global_batch_info or {}), strict_verl=strict_verl)
    return total, {k: float(v) for k, v in metrics.items()}


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | Tensor | None = None,
    global_batch_size: int | Tensor | None = None,
    loss_scale_factor: int | None = None,
    *,
    strict_verl: bool = False,
) -> Tensor:
    """verl's ``agg_loss``: the (B, T) loss reduced so that the gradient averaged over ``dp_size``
    data-parallel ranks equals the global-batch loss's gradient.

      token-mean               Σ L·m / N_tok · dp          N_tok = batch_num_tokens (global), else local Σ m
      token-sum                Σ L·m · dp
      seq-mean-token-sum       Σ_b S_b / N_seq · dp        S_b = Σ_t L·m,  N_seq = global_batch_size, else the
      seq-mean-token-mean      Σ_b S_b/(n_b+1e-8) / N_seq · dp    local rows with a valid token
      seq-mean-token-sum-norm  seq-mean-token-sum / C      C = loss_scale_factor, default T

    With ``dp_size > 1`` the global count must be given (verl raises the same error). Masked positions
    never reach the sum. An all-masked local batch gives 0 (verl: 0/0 = NaN; ``strict_verl=True``)."""
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}; choose one of {AGG_MODES}")
    dtype = loss_mat.dtype
    masked = torch.where(loss_mask.bool(), loss_mat, torch.zeros_like(loss_mat))  # summed in verl's order
    if loss_agg_mode == "token-sum":
        return masked.sum() * dp_size
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = loss_mask.sum()
        count = torch.as_tensor(batch_num_tokens, device=loss_mat.device).to(dtype)
        return masked.sum() / (count if strict_verl else count.clamp_min(1)) * dp_size
    row_sum = masked.sum(-1)
    n = loss_mask.sum(-1)
    if loss_agg_mode == "seq-mean-token-mean":  # verl adds its 1e-8 in the mask's sum dtype
        n_f = n if n.is_floating_point() else n.to(torch.get_default_dtype())
        row_sum = row_sum / (n_f + 1e-8).to(dtype)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        global_batch_size = (n > 0).sum()
    rows = torch.as_tensor(global_batch_size, device=loss_mat.device).to(dtype)
    total = torch.where(n > 0, row_sum, torch.zeros_like(row_sum)).sum()
    total = total / (rows if strict_verl else rows.clamp_min(1)) * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        total = total / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return total
