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
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.last_pos = pos[:, -1]
        return out.logits[:, -1]

    def step(self, tok: Tensor, active: Tensor) -> Tensor:
        self.mask = torch.cat([self.mask, active[:, None]], dim=1)
        self.last_pos = self.last_pos + 1
        out = self.model(input_ids=tok[:, None], attention_mask=self.mask.long(),
                         position_ids=self.last_pos[:, None], past_key_values=self.cache, use_cache=True)
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


class LlamaBlocks:
    """The layers of a Llama-family causal LM (qwen2, llama; eager attention) run by hand.

    ``forward`` runs tokens through every layer; ``kv(layer index, k, v)`` decides which keys and values they
    attend to (a static cache, or a shared prompt prefix + their own), so the decoder and the learner share one
    layer rule. The attention is transformers' eager one (see the module docstring).
    """

    def __init__(self, model: nn.Module) -> None:
        body = model.model
        self.embed, self.layers, self.norm, self.head = body.embed_tokens, list(body.layers), body.norm, model.lm_head
        self.rotary = body.rotary_emb
        attn = self.layers[0].self_attn
        self.head_dim, self.groups, self.scaling = attn.head_dim, attn.num_key_value_groups, attn.scaling
        self.kv_heads = model.config.num_key_value_heads
        self.dtype = self.embed.weight.dtype
        self.cos = self.sin = torch.empty(0)

    def rope(self, length: int, device: torch.device) -> None:
        """cos/sin (length, head_dim) for positions 0 … length − 1, from the model's own rotary module."""
        if self.cos.shape[0] >= length and self.cos.device == device:
            return
        positions = torch.arange(length, device=device)[None]
        cos, sin = self.rotary(torch.empty(0, dtype=self.dtype, device=device), positions)
        self.cos, self.sin = cos[0], sin[0]

    @staticmethod
    def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE as transformers applies it: x·cos + rotate_half(x)·sin; cos/sin (B, 1, L, d)."""
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def bias(self, allowed: Tensor) -> Tensor:
        """Boolean (…, L_q, L_k) → the additive attention mask: 0 where allowed, the dtype's min elsewhere."""
        zero = torch.zeros((), dtype=self.dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)

    def forward(self, ids: Tensor, pos: Tensor, bias: Tensor, kv) -> Tensor:
        """Tokens ``ids`` (B, L) at positions ``pos`` (B, L) → final-norm hidden states (B, L, H).

        ``bias`` (B, 1, L, K) masks the K keys that ``kv(i, k, v)`` returns for layer i from the new keys and
        values k, v (B, kv_heads, L, head_dim).
        """
        b, length = ids.shape
        self.rope(int(pos.max()) + 1, ids.device)
        h = self.embed(ids)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(b, length, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(b, length, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(b, length, -1, self.head_dim).transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            keys, values = kv(i, k, v)
            if self.groups > 1:
                keys = keys.repeat_interleave(self.groups, dim=1)
                values = values.repeat_interleave(self.groups, dim=1)
            scores = torch.matmul(q, keys.transpose(2, 3)) * self.scaling + bias
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(weights, values).transpose(1, 2).reshape(b, length, -1)
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


def distinct_rows(rows: Sequence[Sequence[int]] | Tensor) -> tuple[list[int], Tensor]:
    """(index of each distinct row's first occurrence, (B,) index of every row's distinct row)."""
    first: dict[tuple, int] = {}
    keys = [tuple(r.tolist() if isinstance(r, Tensor) else r) for r in rows]
    order = []
    for i, key in enumerate(keys):
        if key not in first:
            first[key] = len(first)
            order.append(i)
    return order, torch.tensor([first[key] for key in keys])


def prefix_shared_hidden(blocks: LlamaBlocks, ids: Tensor, mask: Tensor, p: int) -> Tensor:
    """Final-norm hidden states (B, T, H) predicting tokens p … p + T − 1 of ``ids`` (B, p + T), with each
    distinct prompt (``ids[:, :p]`` and its mask) run once and its keys/values shared by the rows that have it.

    Equal, up to float rounding, to a full forward's states at positions p − 1 … p + T − 2 (gradients flow
    into the shared prompt through the row copies).
    """
    order, rows = distinct_rows(torch.cat([ids[:, :p], mask[:, :p].long()], 1))
    rows = rows.to(ids.device)
    pos = positions_from_mask(mask)
    prompt_ids, prompt_mask, prompt_pos = ids[order, :p], mask[order, :p], pos[order, :p]
    causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril()
    prefix_kv: list[tuple[Tensor, Tensor]] = []

    def keep(_i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        prefix_kv.append((k, v))
        return k, v

    prompt_h = blocks.forward(prompt_ids, prompt_pos, blocks.bias((prompt_mask[:, None, :] & causal)[:, None]), keep)
    t = ids.shape[1] - p
    if t <= 1:
        return prompt_h[rows, -1:][:, :t]
    full = ids.shape[1]
    allowed = mask[:, None, :] & torch.ones(full, full, dtype=torch.bool, device=ids.device).tril()[p : full - 1]

    def extend(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        pk, pv = prefix_kv[i]
        return torch.cat([pk.index_select(0, rows), k], 2), torch.cat([pv.index_select(0, rows), v], 2)

    resp_h = blocks.forward(ids[:, p : full - 1], pos[:, p : full - 1], blocks.bias(allowed[:, None, :, : full - 1]),
                            extend)
    return torch.cat([prompt_h[rows, -1:], resp_h], 1)


class StaticKVDecoder:
    """Llama-family decode with a pre-allocated KV cache; see the module docstring.

    Cache per layer: keys and values (B, kv_heads, P + max_new_tokens, head_dim) in the model's dtype, filled
    column by column; ``mask`` (B, P + max_new_tokens) marks the columns a row may attend to.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.blocks, self.device = LlamaBlocks(model), device

    def _store(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new keys/values into cache columns ``col`` …; return every column so far."""
        k_cache, v_cache = self.cache[i]
        end = self.col + k.shape[2]
        k_cache[:, :, self.col : end] = k
        v_cache[:, :, self.col : end] = v
        return k_cache[:, :, :end], v_cache[:, :, :end]

    @torch.no_grad()
    def start(self, contexts: Sequence[Sequence[int]], pad_id: int, max_new_tokens: int) -> Tensor:
        """Prefill each distinct context once, copy its cache rows to every row that has it; (B, V) logits."""
        bl, dev = self.blocks, self.device
        order, rows = distinct_rows(contexts)
        rows = rows.to(dev)
        ids, mask = left_pad([contexts[i] for i in order], pad_id, dev)
        u, p = ids.shape
        b, width = len(contexts), p + max_new_tokens
        bl.rope(width, dev)
        shape = (u, bl.kv_heads, width, bl.head_dim)
        self.cache = [(torch.zeros(shape, dtype=bl.dtype, device=dev), torch.zeros(shape, dtype=bl.dtype, device=dev))
                      for _ in bl.layers]
        self.col = 0
        pos = positions_from_mask(mask)
        allowed = mask[:, None, :] & torch.ones(p, p, dtype=torch.bool, device=dev).tril()
        hidden = bl.forward(ids, pos, bl.bias(allowed[:, None]), self._store)[:, -1]
        if u < b:  # expand the distinct rows to all rows
            self.cache = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.cache]
            mask, pos, hidden = mask[rows], pos[rows], hidden[rows]
        self.mask = torch.zeros(b, width, dtype=torch.bool, device=dev)
        self.mask[:, :p] = mask
        self.col, self.last_pos = p, pos[:, -1]
        return bl.head(hidden)

    @torch.no_grad()
    def step(self, tok: Tensor, active: Tensor) -> Tensor:
        """Feed one token per row (``active`` False: a finished row, its token masked out); (B, V) logits."""
        bl = self.blocks
        self.mask[:, self.col] = active
        self.last_pos = self.last_pos + 1
        bias = bl.bias(self.mask[:, None, None, : self.col + 1])
        hidden = bl.forward(tok[:, None], self.last_pos[:, None], bias, self._store)[:, -1]
        self.col += 1
        return bl.head(hidden)


def make_decoder(model: nn.Module, device: torch.device, fast: bool = True) -> HFDecoder | StaticKVDecoder:
    """``StaticKVDecoder`` when it supports ``model`` (and ``fast``), else ``HFDecoder``."""
    return StaticKVDecoder(model, device) if fast and static_kv_supported(model) else HFDecoder(model, device)
