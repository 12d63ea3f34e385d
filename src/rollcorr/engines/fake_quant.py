"""Round-to-nearest k-bit fake quantisation of weights: a sampler whose mismatch is a dose you choose.

``hf:rtn<k>`` (k = 2 … 8) samples with weights rounded to k bits and computes in float32, so the only thing
that separates it from an ``hf:fp32`` learner is the weights' rounding — no kernel, precision or engine
confound. Each bit removed roughly doubles the rounding error, so the mismatch (k3, |Δp|) grows about 4× per
bit: the stress test "what would a k-bit rollout cost my run?" for any Hugging Face model.

The format is llama.cpp's Q4_0 block format generalised to k bits. Each row of a 2-D weight is cut into blocks
of ``BLOCK`` = 32 consecutive weights (along the input dimension); in a block with m the weight of largest
magnitude (signed),

    d = m / −2^(k−1),    q_i = clamp(round(x_i / d), −2^(k−1), 2^(k−1) − 1),    x̂_i = d · q_i

so the largest weight is represented exactly and the others by 2^k levels (round half to even). k = 4 is
Q4_0's grid (Q4_0 rounds halves up; its activations are also quantised to 8 bits, which rtn does not do).
Every 2-D floating weight whose rows split into whole blocks is quantised — linear layers, the token
embedding and the lm-head (tied or not) —; 1-D tensors (norms, biases) and matrices with a row length that
is not a multiple of 32 stay float32, as llama.cpp's converter keeps them.

The same rounding as a *learner* (``model.learner=hf:rtn<k>``) removes the mismatch instead of correcting it,
as quantisation-aware training does: the learner keeps float32 master weights W and computes every forward
with Ŵ = W + sg(rtn_k(W) − W) (``straight_through``; sg = stop-gradient), so its log-probs are the rounded
sampler's and its gradient ∂L/∂Ŵ is applied to W unchanged (the straight-through estimator).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

BLOCK = 32
MIN_BITS, MAX_BITS = 2, 8
RTN_PATTERN = re.compile(r"rtn(\d+)")


def rtn_bits(quant: str | None) -> int | None:
    """"rtn4" → 4; None for any other quantisation name. ValueError for rtn with bits outside 2 … 8."""
    match = RTN_PATTERN.fullmatch(quant or "")
    if match is None:
        return None
    bits = int(match.group(1))
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"rtn takes {MIN_BITS} to {MAX_BITS} bits (hf:rtn2 … hf:rtn8), got {quant!r}")
    return bits


def rtn_quantize(weight: Tensor, bits: int, block: int = BLOCK) -> Tensor:
    """(..., n) float → the same shape and dtype, each block of ``block`` weights along the last dimension
    rounded to ``bits`` bits as the module docstring states. ``n`` must be a multiple of ``block``."""
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in {MIN_BITS} … {MAX_BITS}, got {bits}")
    if weight.shape[-1] % block:
        raise ValueError(f"the last dimension ({weight.shape[-1]}) is not a multiple of the block ({block})")
    x = weight.detach().float().reshape(*weight.shape[:-1], -1, block)
    peak = x.gather(-1, x.abs().argmax(-1, keepdim=True))  # (..., nb, 1): the signed weight of largest magnitude
    half = 2 ** (bits - 1)
    scale = peak / -half
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero block stays zero
    q = torch.round(x / safe).clamp_(-half, half - 1)
    return (q * scale).reshape(weight.shape).to(weight.dtype)


def quantizable(name: str, value: Tensor, block: int = BLOCK) -> bool:
    """Whether a state-dict entry is rounded: 2-D floating weights whose rows split into whole blocks."""
    return value.dim() == 2 and value.is_floating_point() and value.shape[-1] % block == 0


@torch.no_grad()
def rtn_quantize_model(model: nn.Module, bits: int) -> int:
    """Round every quantizable weight of ``model`` in place (tied weights once). Returns how many tensors."""
    done: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in done or not quantizable(name, param):
            continue
        param.copy_(rtn_quantize(param, bits))
        done.add(id(param))
    return len(done)


@contextmanager
def straight_through(model: nn.Module, bits: int) -> Iterator[None]:
    """Inside the block every quantizable weight W of ``model`` reads as Ŵ = W + sg(rtn_k(W) − W): forwards
    compute with the ``bits``-bit rounded weights (bit for bit the ones ``rtn_quantize_model`` gives a sampler:
    Ŵ is formed as rtn_k(W) + (W − sg(W)), whose second term is exactly 0), and a backward pass gives W the gradient of Ŵ unchanged (straight-through). Tied weights are rounded once and
    stay tied. The parameters are put back on exit; a backward run after the block still reaches them."""
    rounded: dict[int, Tensor] = {}
    slots: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or not quantizable(name, param):
                continue
            if id(param) not in rounded:  # rtn_k(W) + (W − sg(W)): the value is rtn_k(W) bit for bit, the gradient W's
                rounded[id(param)] = rtn_quantize(param, bits) + (param - param.detach())
            slots.append((module, name, param))
    try:
        for module, name, param in slots:
            module._parameters[name] = rounded[id(param)]
        yield
    finally:
        for module, name, param in slots:
            module._parameters[name] = param
