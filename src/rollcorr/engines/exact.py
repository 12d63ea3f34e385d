"""The arithmetic of ``hf:exact``: a sampler and a learner whose log-probs of the same tokens are bitwise identical —
the sampler's cached decode and the learner's full forward, whatever the batch, the padding and the cache hold
(the two engines, ``ExactSampler`` and ``ExactLearner``, are hf engines: ``engines/hf.py``).

Two float32 paths that are equal in exact arithmetic differ in the last bits when their reductions add in
another order: a matmul blocked for 64 rows, not 1; an attention sum over 37 keys padded to 48 or to 512; a
vectorised exp against its scalar tail. This module computes a Llama-family forward (Llama, Qwen2: the built-in
models, SmolLM2) from operations whose result for one element depends on that element's inputs only:

- **elementwise IEEE operations** — +, −, ×, ÷, √, max, comparisons, ``round``, ``ldexp`` — are correctly
  rounded whatever kernel runs them (SIMD body or scalar tail, CPU or CUDA);
- **every reduction is a pairwise tree** (``tree_sum``) over the reduced axis zero-padded to a power of two W:
  element i is added to element i + W/2, and so on down to one. The tree depends only on the axis' logical
  layout, and padding with zeros to 2W first adds an exact zero to each element — so a sum over a sequence's
  keys is the same bits in a 40-token forward and in a decode step over a 1,024-slot cache;
- **exp and log** are polynomials evaluated in float64 with those operations (``exp``, ``log``: range
  reduction by powers of two, Taylor / atanh series), rounded once to float32: the same bits on every path;
- **positions are logical**: a left-padded prompt is shifted so its first real token is position 0 for the keys'
  order too; the rotary cos/sin table is computed once in float64 and indexed by logical position.

Matmuls are ``tree_dot`` over the input dimension (products, then the tree), in chunks; their backward pass is
an ordinary matmul (gradients need not be bitwise invariant, only the forward's log-probs). The cost is the
price: elementwise work instead of BLAS (``benchmarks/bench_exact.py`` measures it against ``hf:fp32``).

Sampling uses temperature only (no top-k / top-p); the draw itself is any draw — what must be exact is the
log μ recorded for the token, and it is the same function the learner computes. Mixture-of-experts models are
refused (their routers' top-k would need the same treatment).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

CHUNK = 1 << 20  # elements of products held at once (4 MiB of float32: larger blocks cost more in page faults)
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM")


# ---- exact reductions ------------------------------------------------------------------------------------


def tree_sum(x: Tensor, dim: int = -1) -> Tensor:
    """Σ over ``dim`` by a pairwise tree on the axis zero-padded to a power of two (module docstring)."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = torch.cat([x, x.new_zeros(*x.shape[:-1], width - n)], -1)
    while x.shape[-1] > 1:  # element i plus element i + width/2: contiguous halves
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


class _TreeDot(torch.autograd.Function):
    """(…, K) · (…, K) → (…): the products summed by ``tree_sum`` (forward); an ordinary backward."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return tree_sum(a * b)

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b = ctx.saved_tensors
        g = grad[..., None]
        return _unbroadcast(g * b, a.shape), _unbroadcast(g * a, b.shape)


def _unbroadcast(x: Tensor, shape: torch.Size) -> Tensor:
    while x.dim() > len(shape):
        x = x.sum(0)
    for i, size in enumerate(shape):
        if size == 1 and x.shape[i] != 1:
            x = x.sum(i, keepdim=True)
    return x


def tree_dot(a: Tensor, b: Tensor) -> Tensor:
    """Σ_k a[…, k] b[…, k] by the tree, a and b broadcast against each other."""
    return _TreeDot.apply(a, b)


class _Linear(torch.autograd.Function):
    """x (…, K) @ Wᵀ (M, K) → (…, M) by ``tree_dot`` row chunks; backward by matmul."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        flat = x.reshape(-1, x.shape[-1])
        rows = max(1, CHUNK // max(1, weight.numel()))
        out = torch.cat([tree_sum(flat[i : i + rows, None, :] * weight[None]) for i in range(0, flat.shape[0], rows)])
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        flat_g, flat_x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        return (grad @ weight).reshape(x.shape), flat_g.T @ flat_x


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    out = _Linear.apply(x, weight)
    return out if bias is None else out + bias


# ---- exact exp and log (float64 polynomials, one rounding to float32) -------------------------------------

_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_EXP_TERMS = [1.0 / math.factorial(n) for n in range(14)]  # |r| ≤ ln2/2: the 14th term is < 1e-17


def _exp64(x: Tensor) -> Tensor:
    """exp of float64 ``x`` in [-745, 709]: x = k ln2 + r, exp = 2^k · Σ rⁿ/n! (Horner)."""
    k = torch.round(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = torch.full_like(r, _EXP_TERMS[-1])
    for c in reversed(_EXP_TERMS[:-1]):
        p = p * r + c
    return torch.ldexp(p, k)


def _log64(x: Tensor) -> Tensor:
    """log of float64 ``x`` > 0: x = m 2^e with m in [√½, √2), log m = 2 atanh((m − 1)/(m + 1)) (odd series)."""
    m, e = torch.frexp(x)
    small = m < math.sqrt(0.5)
    m = torch.where(small, m * 2, m)
    e = (e - small.to(e.dtype)).to(x.dtype)
    s = (m - 1) / (m + 1)
    s2 = s * s
    p = torch.full_like(s, 1.0 / 23)
    for n in range(21, 0, -2):  # Σ s^(2j+1)/(2j+1), |s| ≤ 0.172: 12 terms reach 1e-18
        p = p * s2 + 1.0 / n
    return e * _LN2_HI + (e * _LN2_LO + 2 * s * p)


class _Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        out = _exp64(x.double().clamp(-745.0, 709.0)).to(x.dtype)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (out,) = ctx.saved_tensors
        return grad * out


class _Log(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        x64 = x.double()
        out = torch.where(x64 > 0, _log64(x64.clamp(min=torch.finfo(torch.float64).tiny)), float("-inf"))
        ctx.save_for_backward(x)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        return grad / x


def exp(x: Tensor) -> Tensor:
    """e^x, the same bits on every path (−inf → 0)."""
    return _Exp.apply(x)


def log(x: Tensor) -> Tensor:
    """ln x for x ≥ 0 (0 → −inf), the same bits on every path."""
    return _Log.apply(x)


def log_softmax(z: Tensor) -> Tensor:
    """z − (max + log Σ exp(z − max)) over the last dim, each reduction exact (the max is exact anyway)."""
    top = z.detach().amax(-1, keepdim=True)
    return z - (top + log(tree_sum(exp(z - top)))[..., None])


# ---- a Llama-family forward from those pieces --------------------------------------------------------------


def check_model(model: nn.Module) -> None:
    """ValueError for a model this exact forward does not cover."""
    arch = type(model).__name__
    if arch not in SUPPORTED:
        raise ValueError(f"hf:exact covers {', '.join(SUPPORTED)} models; this one is {arch}")
    act = getattr(model.config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hf:exact covers SiLU MLPs; this model's hidden_act is {act!r}")


class ExactForward:
    """The exact forward of one transformers Llama / Qwen2 model, reading its parameters at each call (so an
    optimizer's updates and ``load_weights`` are seen). Hidden states are float32."""

    def __init__(self, model: nn.Module) -> None:
        check_model(model)
        self.model = model
        c = model.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        rotary = model.get_decoder().rotary_emb
        inv_freq = rotary.inv_freq.detach().double().cpu()
        positions = torch.arange(c.max_position_embeddings, dtype=torch.float64)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat([angles, angles], -1)
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.cos = (angles.cos() * scale).float()  # (max positions, head_dim), one table for both sides
        self.sin = (angles.sin() * scale).float()
        self.scaling = self.head_dim**-0.5

    def norm(self, x: Tensor, weight: Tensor) -> Tensor:
        variance = tree_sum(x * x) / x.shape[-1]
        return weight * (x / torch.sqrt(variance + self.eps)[..., None])

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, heads, L, D) at logical ``positions`` (B, L)."""
        cos, sin = self.cos.to(x.device)[positions][:, None], self.sin.to(x.device)[positions][:, None]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def attend(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
        """q (B, H, Lq, D), k and v (B, kvH, Lk, D) in logical key order, ``allowed`` (B, Lq, Lk) → (B, Lq, H·D)."""
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        per_row = q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]  # the (H, Lq, Lk, D) products of one row
        rows = max(1, CHUNK // max(1, per_row))
        out = []
        for lo in range(0, q.shape[0], rows):  # rows in chunks bound the products held at once
            qb, kb, vb, ab = q[lo : lo + rows], k[lo : lo + rows], v[lo : lo + rows], allowed[lo : lo + rows]
            scores = tree_dot(qb[:, :, :, None, :], kb[:, :, None, :, :]) * self.scaling  # (b, H, Lq, Lk): Σ over D
            scores = scores.masked_fill(~ab[:, None], float("-inf"))
            top = scores.detach().amax(-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)
            e = exp(scores - top)
            p = e / tree_sum(e)[..., None]
            # (b, H, Lq, D): Σ_j p_j v_j by the tree over the keys
            out.append(tree_dot(p[:, :, :, None, :], vb.transpose(-1, -2)[:, :, None, :, :]))
        o = torch.cat(out)  # (B, H, Lq, D)
        return o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    def layer(self, i: int, h: Tensor, positions: Tensor, cache: dict | None, allowed: Tensor,
              write: Tensor | None) -> Tensor:
        """Decoder layer ``i`` on h (B, L, H) at logical ``positions``. ``cache``: this layer's keys and values
        (B, kvH, slots, D) in logical order, updated at ``write`` (B, L) slot indices; attention over the cache
        (decode) or over this call's own keys (a full forward, ``cache`` None)."""
        layer = self.model.get_decoder().layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        b, length, _ = h.shape
        x = self.norm(h, layer.input_layernorm.weight)
        q = linear(x, attn.q_proj.weight, attn.q_proj.bias).view(b, length, self.heads, self.head_dim).transpose(1, 2)
        k = linear(x, attn.k_proj.weight, attn.k_proj.bias).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = linear(x, attn.v_proj.weight, attn.v_proj.bias).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rotate(q, positions), self.rotate(k, positions)
        if cache is not None:
            index = write[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
            cache["k"] = cache["k"].scatter(2, index, k)
            cache["v"] = cache["v"].scatter(2, index, v)
            k, v = cache["k"], cache["v"]
        h = h + linear(self.attend(q, k, v, allowed), attn.o_proj.weight, attn.o_proj.bias)
        x = self.norm(h, layer.post_attention_layernorm.weight)
        gate, up = linear(x, mlp.gate_proj.weight), linear(x, mlp.up_proj.weight)
        return h + linear(gate / (1 + exp(-gate)) * up, mlp.down_proj.weight)

    def hidden(self, ids: Tensor, positions: Tensor, allowed: Tensor, caches: list | None = None,
               write: Tensor | None = None) -> Tensor:
        """Final-normed hidden states (B, L, H) of ``ids`` (B, L) at logical ``positions``."""
        body = self.model.get_decoder()
        h = body.embed_tokens.weight[ids].float()
        for i in range(len(body.layers)):
            h = self.layer(i, h, positions, None if caches is None else caches[i], allowed, write)
        return self.norm(h, body.norm.weight)

    def log_probs(self, hidden: Tensor, temperature: float) -> Tensor:
        """(…, V) float32 log-softmax of the lm-head's logits / temperature, exact."""
        logits = linear(hidden, self.model.get_output_embeddings().weight)
        return log_softmax(logits / temperature)


def logical(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A padded batch (B, L) whose real tokens are contiguous → (ids shifted so each row's first real token is at
    column 0 (B, Lr), their logical positions, the valid mask), and the column shift of each row."""
    mask = mask.bool()
    first = mask.float().argmax(1)
    lengths = mask.sum(1)
    width = int(lengths.max())
    cols = torch.arange(width, device=ids.device)
    source = (first[:, None] + cols[None]).clamp(max=ids.shape[1] - 1)
    valid = cols[None] < lengths[:, None]
    return torch.where(valid, ids.gather(1, source), 0), valid, first


def score(forward: ExactForward, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
          response_mask: Tensor, temperature: float, with_entropy: bool = False,
          scored: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """log p(y_t) (B, T) float32 of the response tokens by one exact full forward (0 on padding) [, the entropy
    of each position's distribution (ordinary sums: a diagnostic, not needed bit for bit)]. The forward attends
    to ``response_mask``'s tokens; ``scored`` (default the same) are the ones given a log-prob (a trajectory's
    model tokens, not the environment's)."""
    scored = response_mask if scored is None else scored
    ids = torch.cat([prompt_ids, response_ids], 1)
    mask = torch.cat([prompt_mask.bool(), response_mask.bool()], 1)
    packed, valid, _ = logical(ids, mask)
    width = packed.shape[1]
    positions = torch.arange(width, device=ids.device)[None].expand(packed.shape[0], -1)
    causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
    allowed = causal[None] & valid[:, None, :]
    hidden = forward.hidden(packed, positions, allowed)
    p_len = prompt_mask.bool().sum(1)  # a row's response starts after its real prompt tokens
    t = response_ids.shape[1]
    where = (p_len[:, None] - 1 + torch.arange(t, device=ids.device)[None]).clamp(max=width - 1)
    picked = hidden.gather(1, where[..., None].expand(-1, -1, hidden.shape[-1]))
    full = forward.log_probs(picked, temperature)
    log_p = full.gather(-1, response_ids[..., None]).squeeze(-1).masked_fill(~scored.bool(), 0.0)
    if not with_entropy:
        return log_p
    entropy = -(full.exp() * full).nan_to_num(0.0).sum(-1).masked_fill(~scored.bool(), 0.0)
    return log_p, entropy


@torch.no_grad()
def decode(forward: ExactForward, contexts: Sequence[Sequence[int]], budgets: Sequence[int], temperature: float,
           greedy: bool, eos_id: int | None, generator: torch.Generator, limit: int, device: torch.device):
    """The sampler's loop: prefill every context into a KV cache in logical order, then one token per step.
    Per row: tokens, log μ (exact log-softmax at ``temperature``; 0 when greedy), log kept mass (0; the argmax's
    untempered log-prob when greedy), finished."""
    b = len(contexts)
    lengths = torch.tensor([len(c) for c in contexts], device=device)
    slots = int(lengths.max()) + limit
    layers = len(forward.model.get_decoder().layers)
    caches = [{"k": torch.zeros(b, forward.kv_heads, slots, forward.head_dim, device=device),
               "v": torch.zeros(b, forward.kv_heads, slots, forward.head_dim, device=device)} for _ in range(layers)]
    width = int(lengths.max())
    ids = torch.zeros(b, width, dtype=torch.long, device=device)
    for i, c in enumerate(contexts):
        ids[i, : len(c)] = torch.as_tensor(list(c), device=device)
    cols = torch.arange(width, device=device)
    positions = cols[None].expand(b, -1)
    keys = torch.arange(slots, device=device)
    allowed = (keys[None, None, :] <= cols[None, :, None]) & (keys[None, None, :] < lengths[:, None, None])
    hidden = forward.hidden(ids, positions, allowed, caches, write=positions)
    last = hidden[torch.arange(b, device=device), lengths - 1]
    tokens, log_mus, kepts = [[] for _ in range(b)], [[] for _ in range(b)], [[] for _ in range(b)]
    active = torch.ones(b, dtype=torch.bool, device=device)
    budget = torch.as_tensor(list(budgets), device=device)
    position = lengths.clone()
    for step in range(limit):
        if greedy:
            log_p = forward.log_probs(last, 1.0)
            tok = log_p.argmax(-1)
            mu, kept = torch.zeros(b, device=device), log_p.gather(-1, tok[:, None]).squeeze(-1)
        else:
            log_p = forward.log_probs(last, temperature)
            tok = torch.multinomial(log_p.exp(), 1, generator=generator).squeeze(-1)
            mu, kept = log_p.gather(-1, tok[:, None]).squeeze(-1), torch.zeros(b, device=device)
        for i in torch.nonzero(active).flatten().tolist():
            tokens[i].append(int(tok[i]))
            log_mus[i].append(float(mu[i]))
            kepts[i].append(float(kept[i]))
        ended = (tok == eos_id) if eos_id is not None else torch.zeros_like(active)
        active = active & ~ended & (step + 1 < budget)
        if not bool(active.any()) or step + 1 == limit:
            break
        at = position[:, None]
        allowed = (keys[None, None, :] <= at[:, :, None])
        hidden = forward.hidden(tok[:, None], at, allowed, caches, write=at)
        last = hidden[:, 0]
        position = position + 1
    return tokens, log_mus, kepts, (~active).tolist()
