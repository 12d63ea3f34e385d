"""Memory-lean token log-probabilities and entropies.

Two entry points, both with temperature τ (z = logits / τ) and both computing in float32 or wider:

- `logprobs_from_logits(logits (B, T, V), targets (B, T))`: the logits already exist; rows are processed
  in chunks so no full-size float32 copy / log-softmax is ever built, and the backward recomputes the
  chunk softmax instead of keeping it (custom autograd Function).
- `logprobs_from_hidden(hidden (N, H), weight (V, H), targets (N,))`: the lm-head matmul is fused in;
  the vocabulary is walked in chunks with an online log-sum-exp, so the (N, V) logits never exist, and
  the backward recomputes each chunk's logits. Gradients flow to `hidden` and `weight`.

Formulas per row (p = softmax(z), lse = log Σ_v exp z_v):
  log p(y) = z_y − lse                      H = lse − Σ_v p_v z_v
  ∂ log p(y)/∂z = onehot(y) − p             ∂H/∂z_v = −p_v (log p_v + H)
  and ∂/∂logits = (∂/∂z) / τ.
Online log-sum-exp over vocabulary chunks c, with m' = max(m, max z_c):
  s ← s·e^{m−m'} + Σ e^{z_c−m'}          u ← e^{m−m'}·(u + s·(m−m')) + Σ e^{z_c−m'}(z_c−m')
so that at the end lse = m + log s and H = log s − u/s (u/s = Σ p (z − m), no large-term cancellation).

Over a kept set S (top-k / top-p replayed: DeepSeek-V3.2's "keep sampling mask"), `logprobs_over_kept` and
`logprobs_over_kept_logits` score the renormalised distribution π_S = softmax over S of z:
  log π_S(y) = z_y − log Σ_{v∈S} e^{z_v}      ∂ log π_S(y)/∂z_v = 1[v = y] − π_S(v) for v ∈ S, 0 outside S
so only the K ids of S are ever multiplied by the hidden state (the full log-sum-exp cancels).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "logprobs_over_kept",
    "logprobs_over_kept_logits",
    "naive_logprobs_from_hidden",
]

KEPT_CHUNK_ELEMENTS = 2**23  # gathered lm-head rows (rows × K × H) per chunk of `logprobs_over_kept`


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half / bfloat16 / float32 inputs, float64 for float64 (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _check_targets(targets: Tensor, vocab: int) -> None:
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be int64/int32 token ids, got {targets.dtype}")
    if targets.numel() and (targets.min() < 0 or targets.max() >= vocab):
        raise ValueError(f"targets hold ids outside [0, {vocab})")


# ----------------------------------------------------------------------------------------------- from logits


class _LogitsLogProb(torch.autograd.Function):
    """(N, V) logits → (N,) log p(target), (N,) entropy; backward recomputes the softmax per row chunk."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_size: int):
        ctx.set_materialize_grads(False)
        acc = _acc_dtype(logits.dtype)
        n = logits.shape[0]
        logp = torch.empty(n, dtype=acc, device=logits.device)
        entropy = torch.empty(n, dtype=acc, device=logits.device)
        lse_all = torch.empty(n, dtype=acc, device=logits.device)
        for start in range(0, n, chunk_size):
            z = logits[start : start + chunk_size].to(acc) / temperature
            lse = torch.logsumexp(z, dim=-1)
            log_p = z - lse[:, None]
            tgt = targets[start : start + chunk_size]
            logp[start : start + chunk_size] = log_p.gather(-1, tgt[:, None]).squeeze(-1)
            entropy[start : start + chunk_size] = -(torch.exp(log_p) * log_p).sum(-1)
            lse_all[start : start + chunk_size] = lse
        ctx.save_for_backward(logits, targets, lse_all, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        logits, targets, lse_all, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None
        acc = lse_all.dtype
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            sl = slice(start, start + ctx.chunk_size)
            z = logits[sl].to(acc) / ctx.temperature
            log_p = z - lse_all[sl, None]
            p = torch.exp(log_p)
            g = torch.zeros_like(z)
            if grad_logp is not None:
                g_rows = grad_logp[sl].to(acc)
                g -= p * g_rows[:, None]
                g.scatter_add_(-1, targets[sl, None], g_rows[:, None])
            if grad_entropy is not None:
                g -= p * (log_p + entropy[sl, None]) * grad_entropy[sl].to(acc)[:, None]
            grad[sl] = (g / ctx.temperature).to(logits.dtype)
        return grad, None, None, None


def logprobs_from_logits(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> tuple[Tensor, Tensor]:
    """Log-probabilities of `targets` and entropies under softmax(logits / τ).

    logits (..., V) any float dtype, targets (...) int. Returns (log_prob, entropy), each (...) in float32
    (float64 for float64 logits). Work is done `chunk_size` rows at a time; differentiable w.r.t. logits.
    """
    _check_temperature(temperature)
    if logits.dim() < 1 or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_targets(targets, logits.shape[-1])
    lead = targets.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).long()
    logp, entropy = _LogitsLogProb.apply(flat_logits, flat_targets, float(temperature), int(chunk_size))
    return logp.reshape(lead), entropy.reshape(lead)


# ----------------------------------------------------------------------------------------------- from hidden


class _ChunkedLMHeadLogProb(torch.autograd.Function):
    """hidden (N, H) × weight (V, H) → (N,) log p(target) [, (N,) entropy], vocabulary chunk by chunk.

    Every (N, chunk) temporary is updated in place, so at most two of them are alive at once.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int, with_entropy: bool):
        ctx.set_materialize_grads(False)
        acc = _acc_dtype(hidden.dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        m = torch.full((n,), -torch.inf, dtype=acc, device=hidden.device)
        s = torch.zeros(n, dtype=acc, device=hidden.device)
        u = torch.zeros(n, dtype=acc, device=hidden.device)
        target_logit = torch.zeros(n, dtype=acc, device=hidden.device)
        for start in range(0, vocab, chunk_size):
            z = (hidden @ weight[start : start + chunk_size].T).to(acc)
            if temperature != 1.0:
                z.div_(temperature)
            local = targets - start
            inside = (local >= 0) & (local < z.shape[1])
            picked = z.gather(-1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(-1)
            target_logit = torch.where(inside, picked, target_logit)
            m_new = torch.maximum(m, z.amax(-1))
            scale = torch.exp(m - m_new)
            z.sub_(m_new[:, None])  # z − m'
            if with_entropy:
                e = torch.exp(z)
                # u tracks Σ e^{z−m}(z−m): re-centre the old terms on the new max (0 before the first chunk)
                recentre = torch.where(s > 0, s * (m - m_new), torch.zeros_like(s))
                u = scale * (u + recentre) + torch.linalg.vecdot(e, z)
            else:
                e = z.exp_()
            s = s * scale + e.sum(-1)
            m = m_new
        log_s = torch.log(s)
        lse = m + log_s
        logp = target_logit - lse
        entropy = log_s - u / s if with_entropy else None  # = lse − Σ p z, no large-term cancellation
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        acc, dtype = lse.dtype, hidden.dtype
        grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_weight = torch.empty_like(weight) if need_w else None
        g_logp = None if grad_logp is None else grad_logp.to(acc)[:, None]
        g_ent = None if grad_entropy is None else grad_entropy.to(acc)[:, None]
        for start in range(0, weight.shape[0], ctx.chunk_size):
            w_c = weight[start : start + ctx.chunk_size]
            log_p = (hidden @ w_c.T).to(acc)
            if ctx.temperature != 1.0:
                log_p.div_(ctx.temperature)
            log_p.sub_(lse[:, None])
            # ∂/∂z = g_logp·(onehot − p) − g_ent·p·(log p + H) = onehot·g_logp − p·coef
            if g_ent is None:
                g = log_p.exp_().mul_(-g_logp)
            else:
                p = torch.exp(log_p)
                coef = log_p.add_(entropy[:, None]).mul_(g_ent)
                if g_logp is not None:
                    coef.add_(g_logp)
                g = p.mul_(coef).neg_()
                del coef, log_p
            if g_logp is not None:
                local = targets - start
                inside = (local >= 0) & (local < w_c.shape[0])
                src = torch.where(inside[:, None], g_logp, torch.zeros_like(g_logp))
                g.scatter_add_(-1, local.clamp(0, w_c.shape[0] - 1)[:, None], src)
            if ctx.temperature != 1.0:
                g.div_(ctx.temperature)
            g = g.to(dtype)
            if need_h:
                if dtype == acc:
                    grad_hidden.addmm_(g, w_c)
                else:
                    grad_hidden += (g @ w_c).to(acc)
            if need_w:
                torch.mm(g.T, hidden, out=grad_weight[start : start + ctx.chunk_size])
        if need_h:
            grad_hidden = grad_hidden.to(dtype)
        return grad_hidden, grad_weight, None, None, None, None


def logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 4096,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log p(target) and entropy of softmax(hidden @ weightᵀ / τ), never building the (N, V) logits.

    hidden (N, H), weight (V, H) (the lm-head, no bias), targets (N,) int. Returns (log_prob, entropy),
    each (N,) in float32 (float64 for float64 inputs); entropy is None when `with_entropy=False` (saves one
    pass per chunk). The matmul runs in the input dtype, the softmax statistics in float32. Backward
    recomputes each vocabulary chunk's logits (one extra matmul per chunk) instead of storing them.
    """
    _check_temperature(temperature)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be (N, H) and (V, H)"
        )
    if tuple(targets.shape) != (hidden.shape[0],):
        raise ValueError(f"targets has shape {tuple(targets.shape)}, expected {(hidden.shape[0],)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_targets(targets, weight.shape[0])
    return _ChunkedLMHeadLogProb.apply(
        hidden, weight, targets.long(), float(temperature), int(chunk_size), bool(with_entropy)
    )


def naive_logprobs_from_hidden(
    hidden: Tensor, weight: Tensor, targets: Tensor, *, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[Tensor, Tensor | None]:
    """Reference: full (N, V) float32 logits, log_softmax, gather. Same outputs as `logprobs_from_hidden`."""
    acc = _acc_dtype(hidden.dtype)
    logits = (hidden @ weight.T).to(acc) / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if with_entropy else None
    return log_p.gather(-1, targets.long()[:, None]).squeeze(-1), entropy


# ----------------------------------------------------------------------------------------------- over kept sets


def _check_kept(kept_ids: Tensor, targets: Tensor, vocab: int) -> None:
    if kept_ids.dim() != 2 or kept_ids.shape[0] != targets.shape[0]:
        raise ValueError(f"kept_ids has shape {tuple(kept_ids.shape)}, expected ({targets.shape[0]}, K)")
    if kept_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"kept_ids must be int64/int32 token ids (−1 = none), got {kept_ids.dtype}")
    if kept_ids.numel() and (kept_ids.min() < -1 or kept_ids.max() >= vocab):
        raise ValueError(f"kept_ids hold ids outside [0, {vocab}) (−1 marks no token)")


def _kept_log_prob(z: Tensor, ids: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Kept logits z (r, K) (−inf on −1 ids) → (log π_S(y) (r,), lse over S (r,), rows whose non-empty set lacks
    their target (r,) bool); a row with an empty set (padding) scores 0."""
    empty = (ids < 0).all(-1)
    hit = ids == targets[:, None]
    z = torch.where(empty[:, None], torch.zeros_like(z), z)  # no −inf-only row: no NaN in a backward pass
    lse = torch.logsumexp(z, dim=-1)
    picked = torch.where(hit, z, torch.full_like(z, -torch.inf)).amax(-1)
    logp = torch.where(empty | ~hit.any(-1), torch.zeros_like(lse), picked - lse)
    return logp, lse, ~empty & ~hit.any(-1)


def _missing_error(missing: Tensor) -> ValueError:
    rows = missing.nonzero().flatten().tolist()
    return ValueError(f"{len(rows)} scored token(s) are not in their own kept set (rows {rows[:8]} of the flattened "
                      "batch): kept_ids must be the sets the tokens were drawn from")


class _KeptLogProb(torch.autograd.Function):
    """hidden (N, H), weight (V, H), kept ids (N, K) → (N,) log π_S(target); rows chunked so that the gathered
    lm-head rows (rows × K × H) stay under ``KEPT_CHUNK_ELEMENTS``; backward recomputes each chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, kept, temperature: float):
        ctx.set_materialize_grads(False)
        acc = _acc_dtype(hidden.dtype)
        n, k = kept.shape
        rows = max(1, KEPT_CHUNK_ELEMENTS // max(k * hidden.shape[1], 1))
        logp = torch.zeros(n, dtype=acc, device=hidden.device)
        lse = torch.zeros(n, dtype=acc, device=hidden.device)
        missing = torch.zeros(n, dtype=torch.bool, device=hidden.device)
        for start in range(0, n, rows):
            sl = slice(start, start + rows)
            z = _KeptLogProb.logits(hidden[sl], weight, kept[sl], temperature, acc)
            logp[sl], lse[sl], missing[sl] = _kept_log_prob(z, kept[sl], targets[sl])
        if missing.any():
            raise _missing_error(missing)
        ctx.save_for_backward(hidden, weight, targets, kept, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return logp

    @staticmethod
    def logits(hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float, acc: torch.dtype) -> Tensor:
        """z (r, K) = hidden · weight[ids] / τ in ``acc``, −inf where ids = −1."""
        z = torch.bmm(weight[ids.clamp_min(0)], hidden[:, :, None]).squeeze(-1).to(acc)
        if temperature != 1.0:
            z = z / temperature
        return z.masked_fill(ids < 0, -torch.inf)

    @staticmethod
    def backward(ctx, grad_logp):
        hidden, weight, targets, kept, lse = ctx.saved_tensors
        if grad_logp is None:
            return None, None, None, None, None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = lse.dtype
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        for start in range(0, kept.shape[0], ctx.rows):
            sl = slice(start, start + ctx.rows)
            ids = kept[sl]
            z = _KeptLogProb.logits(hidden[sl], weight, ids, ctx.temperature, acc)
            empty = (ids < 0).all(-1, keepdim=True)
            p = torch.exp(z - lse[sl, None]).masked_fill(empty, 0.0)  # π_S over the set, 0 on padding rows
            hit = ((ids == targets[sl, None]) & ~empty).to(acc)
            g = (hit - p) * (grad_logp[sl].to(acc)[:, None] / ctx.temperature)  # ∂/∂z_S, 0 at −1 ids (p = 0 there)
            if need_h:
                grad_hidden[sl] = torch.bmm(g[:, None, :].to(weight.dtype), weight[ids.clamp_min(0)]).squeeze(1).to(hidden.dtype)
            if need_w:
                grad_weight.index_add_(0, ids.clamp_min(0).flatten(), (g[:, :, None] * hidden[sl, None, :].to(acc)).flatten(0, 1))
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def logprobs_over_kept(hidden: Tensor, weight: Tensor, targets: Tensor, kept_ids: Tensor, *,
                       temperature: float = 1.0) -> Tensor:
    """log π_S(target) (N,) of softmax(hidden @ weightᵀ / τ) renormalised over each row's kept set S.

    hidden (N, H), weight (V, H) (the lm-head, no bias), targets (N,), kept_ids (N, K) token ids with −1 for "no
    token". A row whose set is empty (padding) scores 0; a row whose target is outside its non-empty set raises
    ValueError. The products run in the input dtype, the softmax statistics in float32 (float64 for float64);
    differentiable w.r.t. hidden and weight, never building more than ``KEPT_CHUNK_ELEMENTS`` gathered weights.
    """
    _check_temperature(temperature)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be (N, H) and (V, H)")
    if tuple(targets.shape) != (hidden.shape[0],):
        raise ValueError(f"targets has shape {tuple(targets.shape)}, expected {(hidden.shape[0],)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    _check_targets(targets, weight.shape[0])
    _check_kept(kept_ids, targets, weight.shape[0])
    return _KeptLogProb.apply(hidden, weight, targets.long(), kept_ids.long(), float(temperature))


def logprobs_over_kept_logits(logits: Tensor, targets: Tensor, kept_ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """`logprobs_over_kept` when the (N, V) logits already exist: log π_S(target) (N,), differentiable."""
    _check_temperature(temperature)
    if logits.dim() != 2 or tuple(targets.shape) != (logits.shape[0],):
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}")
    _check_targets(targets, logits.shape[-1])
    _check_kept(kept_ids, targets, logits.shape[-1])
    ids = kept_ids.long()
    z = logits.gather(-1, ids.clamp_min(0)).to(_acc_dtype(logits.dtype)) / temperature
    logp, _, missing = _kept_log_prob(z.masked_fill(ids < 0, -torch.inf), ids, targets.long())
    if missing.any():
        raise _missing_error(missing)
    return logp
