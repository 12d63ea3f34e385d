"""Forward passes for the hf sampler's decode loop: one prefill over the prompts, then one token per row per step.

Two decoders with the same surface (``start`` → last logits (B, V); ``step(tok, active)`` → next logits):

- ``HFDecoder`` calls the transformers model with a ``DynamicCache`` (any causal LM; the reference path).
- ``StaticKVDecoder`` (Llama-family models with eager attention: qwen2, llama) runs the model's own modules
  (norms, projections, MLP) layer by layer with its own attention over a KV cache pre-allocated for the whole
  response, skipping the model-level machinery (mask building, cache objects, output capture) whose Python
  cost dominates a ~1 M-parameter model. Rows that share a context (the n responses of a prompt) are
  prefilled once and their cache rows copied. The attention is the eager one of transformers:

      a = softmax_fp32(q kᵀ · d^-½ + mask).to(dtype);  out = a v          (keys 0 … t; mask: padding, causal)

  so its tokens and log-probs match ``HFDecoder``'s up to float rounding (tests/test_engines_hf.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from rollcorr.engines.decoding import left_pad


def positions_from_mask(mask: Tensor) -> Tensor:
    """Position ids for a left-padded batch: 0 at each row's first real token, (B, L) int64."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class HFDecoder:
    """Decode through ``model(...)`` with a transformers ``DynamicCache`` (works for any causal LM)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device

    def start(self, contexts: Sequence[Sequence[int]], pad_id: int, max_new_tokens: int) -> Tensor:
        from transformers import DynamicCache

        ids, self.mask = left_pad(contexts, pad_id, self.device)
        self.cache = DynamicCache(config=self.model.config)
        pos = positions_from_mask(self.mask)
        out = self.model(input_ids=ids, attention_mask=self.mask.long(), position_ids=pos,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)  # fmt: skip
        self.last_pos = pos[:, -1]
        return out.logits[:, -1]

    def step(self, tok: Tensor, active: Tensor) -> Tensor:
        self.mask = torch.cat([self.mask, active[:, None]], dim=1)
        self.last_pos = self.last_pos + 1
        out = self.model(input_ids=tok[:, None], attention_mask=self.mask.long(),
                         position_ids=self.last_pos[:, None], past_key_values=self.cache, use_cache=True)  # fmt: skip
        return out.logits[:, -1]


def static_kv_supported(model: nn.Module) -> bool:
    """Whether ``StaticKVDecoder`` reproduces ``model``: a Llama-family layout, eager attention, plain RoPE."""
    config = model.config
    if config.model_type not in ("qwen2", "llama") or config._attn_implementation != "eager":
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False  # sliding-window layers
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    return "dynamic" not in rope and "longrope" not in rope


class StaticKVDecoder:
    """Llama-family decode with a pre-allocated KV cache; see the module docstring.

    Cache per layer: keys and values (B, kv_heads, P + max_new_tokens, head_dim) in the model's dtype, filled
    column by column; ``mask`` (B, P + max_new_tokens) marks the columns a row may attend to.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        body = model.model
        self.embed, self.layers, self.norm, self.head = body.embed_tokens, list(body.layers), body.norm, model.lm_head
        self.rotary = body.rotary_emb
        attn = self.layers[0].self_attn
        self.head_dim, self.groups, self.scaling = attn.head_dim, attn.num_key_value_groups, attn.scaling
        self.kv_heads = model.config.num_key_value_heads
        self.dtype = self.embed.weight.dtype

    # ---- pieces ------------------------------------------------------------------------------------

    def _rope_tables(self, length: int) -> None:
        """cos/sin (length, head_dim) for positions 0 … length − 1, from the model's own rotary module."""
        positions = torch.arange(length, device=self.device)[None]
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, positions)
        self.cos, self.sin = cos[0], sin[0]

    @staticmethod
    def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE as transformers applies it: x·cos + rotate_half(x)·sin; cos/sin (B, 1, L, d)."""
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _forward(self, ids: Tensor, pos: Tensor, col: int, bias: Tensor) -> Tensor:
        """Run tokens ``ids`` (B, L) at positions ``pos`` (B, L) into cache columns col … col + L − 1.

        ``bias`` (B, 1, L, col + L): the additive attention mask (0 allowed, dtype min masked). Returns the
        final-norm hidden state of the last position (B, H).
        """
        b, length = ids.shape
        h = self.embed(ids)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        end = col + length
        for layer, (k_cache, v_cache) in zip(self.layers, self.cache):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(b, length, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(b, length, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(b, length, -1, self.head_dim).transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            k_cache[:, :, col:end] = k
            v_cache[:, :, col:end] = v
            keys, values = k_cache[:, :, :end], v_cache[:, :, :end]
            if self.groups > 1:
                keys = keys.repeat_interleave(self.groups, dim=1)
                values = values.repeat_interleave(self.groups, dim=1)
            scores = torch.matmul(q, keys.transpose(2, 3)) * self.scaling + bias
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(weights, values).transpose(1, 2).reshape(b, length, -1)
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h[:, -1])

    # ---- the decoder surface -----------------------------------------------------------------------

    @torch.no_grad()
    def start(self, contexts: Sequence[Sequence[int]], pad_id: int, max_new_tokens: int) -> Tensor:
        """Prefill each distinct context once, copy its cache rows to every row that has it; (B, V) logits."""
        keys = [tuple(c) for c in contexts]
        first = {}
        for key in keys:
            first.setdefault(key, len(first))
        rows = torch.tensor([first[key] for key in keys], device=self.device)
        ids, mask = left_pad([list(k) for k in first], pad_id, self.device)
        u, p = ids.shape
        b, width = len(contexts), p + max_new_tokens
        self._rope_tables(width)
        shape = (u, self.kv_heads, width, self.head_dim)
        self.cache = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in self.layers]  # fmt: skip
        pos = positions_from_mask(mask)
        allowed = mask[:, None, :] & torch.ones(p, p, dtype=torch.bool, device=self.device).tril()
        hidden = self._forward(ids, pos, 0, self._bias(allowed[:, None]))
        if u < b:  # expand the distinct rows to all rows
            self.cache = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.cache]
            mask, pos, hidden = mask[rows], pos[rows], hidden[rows]
        self.mask = torch.zeros(b, width, dtype=torch.bool, device=self.device)
        self.mask[:, :p] = mask
        self.col, self.last_pos = p, pos[:, -1]
        return self.head(hidden)

    def _bias(self, allowed: Tensor) -> Tensor:
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)

    @torch.no_grad()
    def step(self, tok: Tensor, active: Tensor) -> Tensor:
        """Feed one token per row (``active`` False: a finished row, its token masked out); (B, V) logits."""
        self.mask[:, self.col] = active
        self.last_pos = self.last_pos + 1
        bias = self._bias(self.mask[:, None, None, : self.col + 1])
        hidden = self._forward(tok[:, None], self.last_pos[:, None], self.col, bias)
        self.col += 1
        return self.head(hidden)


def make_decoder(model: nn.Module, device: torch.device, fast: bool = True) -> HFDecoder | StaticKVDecoder:
    """``StaticKVDecoder`` when it supports ``model`` (and ``fast``), else ``HFDecoder``."""
    return StaticKVDecoder(model, device) if fast and static_kv_supported(model) else HFDecoder(model, device)
