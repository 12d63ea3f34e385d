"""The ``hf`` backend: transformers models as sampler (own KV-cache decode loop) and learner.

Sampler: left-padded prompts, position ids from the attention mask, a KV cache (``engines/kvdecode.py``: a
static pre-allocated one with each distinct prompt prefilled once for Llama-family models, else transformers'
``DynamicCache``; ``fast_decode=False`` forces the latter); at each step the last logits go through
``process_logits`` (temperature → top-k → top-p, docs/spec.md §8), a token is drawn from the processed
distribution with a seeded ``torch.Generator``, and log μ of that token plus the log kept mass are
recorded. Rows stop at EOS. For a mixture-of-experts model the routers' choices are captured through the loop
(rollcorr.moe): the prefill gives every prompt position's experts, each decode step the experts of the
position that predicts the next token (``Rollout.routed_experts``, ``prompt_routed_experts``). Dtype float32 / bfloat16 / float16, attention eager / sdpa, or int8 dynamic
quantisation of every ``nn.Linear`` (float32 activations, int8 weights), or ``rtn<k>``: weights rounded to k bits in
blocks of 32 (``engines/fake_quant.py``), float32 compute — a mismatch of a chosen size and nothing else.

Learner: full-sequence forwards over prompt + response (Llama-family models: each distinct prompt run once
and its keys/values shared by the responses to it, ``kvdecode.prefix_shared_hidden``), log-softmax at the
response tokens (logits / the sampling temperature), optional entropy, lm-head applied in vocabulary chunks
(rollcorr.logprobs). ``routing_replay="r3"`` (MoE models): every forward replays the rollout's routed experts
(rollcorr.moe.replay_routing; the gate weights come from the learner's own router logits). ``hf:rtn<k>`` as a
learner: float32 master weights, every forward through the k-bit rounded ones (straight-through gradient), so
an ``hf:rtn<k>`` sampler and its learner compute with the same weights — the mismatch removed, not corrected.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import Tensor, nn

from rollcorr.engines import exact
from rollcorr.engines.base import SamplingParams, copy_weights, draw, kept_token_ids, process_logits
from rollcorr.engines.decoding import (  # noqa: F401
    DecodingSampler,
    encode_prompts,
    finished_rows,
    kept_rows,
    left_pad,
    right_pad,
)
from rollcorr.engines.fake_quant import (
    MAX_BITS,
    MIN_BITS,
    quantizable,
    rtn_bits,
    rtn_quantize,
    rtn_quantize_model,
    straight_through,
)
from rollcorr.engines.kvdecode import (
    LlamaBlocks,
    make_decoder,
    positions_from_mask,
    prefix_shared_hidden,
    static_kv_supported,
)
from rollcorr.engines.spec import FLOAT_DTYPES, Backend, EngineSpec, register_backend
from rollcorr.logprobs import (
    logprobs_from_hidden,
    logprobs_from_logits,
    logprobs_over_kept,
    logprobs_over_kept_logits,
)
from rollcorr.models.builtin import BUILTIN, load_model, resolve_dtype
from rollcorr.moe import (
    ROUTING_REPLAY_MODES,
    capture_routing,
    compact_expert_dtype,
    is_moe,
    replay_routing,
    response_routing,
    routing_shape,
    sequence_routing,
)
from rollcorr.rollout import Rollout

QUANTIZATIONS = (None, "int8", *(f"rtn{k}" for k in range(MIN_BITS, MAX_BITS + 1)))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def quantize_int8(model: nn.Module) -> nn.Module:
    """A copy of a float32 ``model`` whose ``nn.Linear`` layers hold int8 weights (dynamic quantisation).

    Uses ``torch.ao.quantization.quantize_dynamic`` (deprecated in favour of torchao but still the CPU
    dynamic int8 path in torch 2.13); activations are quantised per call, so outputs stay float32.
    """
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=False)


class Float32Head(nn.Module):
    """A bias-free lm-head in float32 over a lower-precision model: logits = h.float() @ W.T (``weight`` keeps
    the name, so a state dict's ``lm_head.weight`` loads into it)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)

    def forward(self, hidden: Tensor) -> Tensor:
        return nn.functional.linear(hidden.float(), self.weight)


class HFSampler(DecodingSampler):
    """Sampler on a transformers causal LM. ``version`` is the weight version it holds (starts at 0)."""

    def __init__(
        self,
        model_path: str | Path = BUILTIN,
        dtype: torch.dtype | str = torch.float32,
        attn: str = "eager",
        quant: str | None = None,
        device: str | torch.device | None = None,
        version: int = 0,
        fast_decode: bool = True,
        head_fp32: bool = False,
        shared: tuple[nn.Module, object] | None = None,
    ) -> None:
        """``head_fp32``: a bf16 / fp16 model with its lm-head kept in float32 (the checkpoint's float weights, the
        last hidden state cast up), as some engines offer — what ``rollcorr audit --whatif lm_head_fp32`` asks.
        ``shared``: (model, tokenizer) already loaded, decoded with as they are — tensors shared, not copied (a
        plain float32 model: ``HFLearner.evaluation_sampler``)."""
        if shared is not None and (quant is not None or head_fp32 or resolve_dtype(dtype) != torch.float32):
            raise ValueError("a sampler sharing a model's tensors decodes a float32 model as it is: no quantisation, "
                             "no other dtype, no float32 head")
        if quant not in QUANTIZATIONS:
            raise ValueError(f"unknown quantisation {quant!r}; use one of {QUANTIZATIONS}")
        self.dtype = resolve_dtype(dtype)
        if quant is not None and self.dtype != torch.float32:
            raise ValueError(f"{quant} quantisation runs float32 activations: use dtype float32 with {quant}")
        if device is None:
            device = "cpu" if quant == "int8" else default_device()
        self.device = torch.device(device)
        if quant == "int8" and self.device.type != "cpu":
            raise ValueError("int8 dynamic quantisation is CPU-only; use device='cpu'")
        self.quant = quant
        self.attn = attn
        self.model_path = str(model_path)
        low_head = head_fp32 and self.dtype != torch.float32
        model, self.tokenizer = shared or load_model(model_path, dtype=torch.float32 if low_head else self.dtype,
                                                     attn=attn)
        if low_head:  # the head's float weights kept, the rest cast down
            head = Float32Head(model.get_output_embeddings().weight.detach().clone())
            model = model.to(self.dtype)
            model.set_output_embeddings(head)
        self.float_model = model.to(self.device) if quant is None else model  # the one holding float weights
        self.rtn_bits = rtn_bits(quant)  # k of hf:rtn<k>: weights rounded in place, float32 compute
        if self.rtn_bits is not None:
            rtn_quantize_model(model, self.rtn_bits)
        self.model = quantize_int8(model) if quant == "int8" else model
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id
        self.version = int(version)
        self.fast_decode = fast_decode  # False: decode through model(...) with a DynamicCache (the reference)

    def _take_routing(self) -> tuple[list[Tensor], list[Tensor]] | None:
        routing, self._routing = getattr(self, "_routing", None), None
        return routing

    def _take_kept_ids(self) -> list[Tensor] | None:
        kept, self._kept = getattr(self, "_kept", None), None
        return kept

    def _expert_dtype(self) -> torch.dtype:
        return compact_expert_dtype(routing_shape(self.model)[2])

    def __repr__(self) -> str:
        kind = self.quant or str(self.dtype).removeprefix("torch.")
        return f"HFSampler({self.model_path!r}, {kind}, attn={self.attn}, version={self.version})"

    # ---- weights ------------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> int:
        """Copy float weights into the sampler (cast to its dtype; re-quantised for int8 and rtn<k>). Returns
        the version."""
        own = self.float_model.state_dict()
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"state_dict does not fit the sampler's model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name, value in state_dict.items():
            if tuple(value.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"{name}: shape {tuple(value.shape)} does not match {tuple(own[name].shape)}"
                )
            value = value.detach()
            if self.rtn_bits is not None and quantizable(name, value):
                value = rtn_quantize(value.float(), self.rtn_bits)
            if own[name].data_ptr() != value.data_ptr() or own[name].device != value.device:  # shared: as it is
                own[name].copy_(value)  # copy_ casts dtype and moves device
        if self.quant == "int8":
            self.model = quantize_int8(self.float_model)
        self.version = int(version)
        return self.version

    def kept_weights(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """A CPU copy of ``state_dict`` that ``load_weights`` turns into the same sampler state, each tensor in the
        dtype this sampler holds it (``load_weights`` casts the same way: a bf16 / fp16 sampler's copy is half an
        fp32 one; int8 and rtn<k> quantise from float32, so they keep float32), tied tensors once."""
        own = self.float_model.state_dict()
        return copy_weights(state_dict, {name: own[name].dtype for name in state_dict if name in own})

    def close(self) -> None:
        self.model = self.float_model = None

    def _check_open(self) -> None:
        if self.model is None:
            raise RuntimeError("this sampler was closed")

    # ---- sampling -----------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        """Prompts (strings or token id lists) → token id lists, checked against the vocabulary."""
        return encode_prompts(self.tokenizer, prompts, self.float_model.get_input_embeddings().weight.shape[0])

    @torch.no_grad()
    def _decode(
        self,
        contexts: list[list[int]],
        budgets: list[int],
        params: SamplingParams,
        max_steps: int | None,
    ) -> tuple[list[list[int]], list[list[float]], list[list[float]], list[bool]]:
        """The decode loop. Per row: sampled tokens, their log μ, log kept mass, and whether it finished.

        A row finishes at EOS (kept as its last token) or when it has ``budgets[i]`` new tokens. The
        generator is seeded with ``params.seed`` (None = nondeterministic).
        """
        dev = self.device
        gen = torch.Generator(device=dev)
        if params.seed is not None:
            gen.manual_seed(params.seed)
        else:
            gen.seed()

        b = len(contexts)
        budget = torch.as_tensor(budgets, device=dev)
        limit = max(budgets) if max_steps is None else min(max(budgets), max_steps)
        decoder = make_decoder(self.model, dev, fast=self.fast_decode)
        moe = is_moe(self.model)
        with capture_routing(self.model) if moe else nullcontext() as recorder:
            logits = decoder.start(contexts, self.pad_id, limit)

            active = torch.ones(b, dtype=torch.bool, device=dev)  # still generating
            steps_tok, steps_lp, steps_lk, steps_valid, steps_kept = [], [], [], [], []
            for step in range(limit):
                log_mu, log_kept = process_logits(logits, params)
                if params.records_kept_ids:
                    steps_kept.append(kept_token_ids(log_mu).cpu())
                tok = draw(log_mu, params, gen)
                tok = torch.where(active, tok, torch.full_like(tok, self.pad_id))
                steps_tok.append(tok)
                steps_lp.append(log_mu.gather(-1, tok[:, None]).squeeze(-1))
                steps_lk.append(log_kept)
                steps_valid.append(active.clone())
                active = active & (tok != self.eos_id) & (step + 1 < budget)
                if not bool(active.any()) or step + 1 == limit:
                    break
                logits = decoder.step(tok, active)

        tok = torch.stack(steps_tok, 1).cpu()
        valid = torch.stack(steps_valid, 1).cpu()
        self._routing = split_routing(recorder.take(), contexts, valid) if moe else None
        self._kept = kept_rows(steps_kept, valid) if steps_kept else None
        lp = torch.stack(steps_lp, 1).float().cpu()
        lk = torch.stack(steps_lk, 1).float().cpu()
        finished = (~active).cpu().tolist()
        tokens = [tok[i][valid[i]].tolist() for i in range(b)]
        return (
            tokens,
            [lp[i][valid[i]].tolist() for i in range(b)],
            [lk[i][valid[i]].tolist() for i in range(b)],
            finished,
        )


def split_routing(
    calls: list[Tensor], contexts: list[list[int]], valid: Tensor
) -> tuple[list[Tensor], list[Tensor]]:
    """A decode loop's captured routing → per row (context routing (len(context), L, k), response routing
    (n_tokens, L, k)). ``calls[0]`` is the prefill over the left-padded contexts (B·P, L, k); ``calls[s]``
    (B, L, k) the step that fed token s − 1, i.e. the position predicting token s; ``valid`` (B, steps)."""
    b, width = len(contexts), max(len(c) for c in contexts)
    prefill = calls[0].view(b, width, *calls[0].shape[1:])
    predicting = torch.stack([prefill[:, -1]] + [c.view(b, *c.shape[1:]) for c in calls[1:]], 1)
    prompt_rows = [prefill[i, width - len(c) :] for i, c in enumerate(contexts)]
    response_rows = [predicting[i, : valid.shape[1]][valid[i]] for i in range(b)]
    return prompt_rows, response_rows


AMP = {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}  # learner dtype → the autocast compute dtype


class HFLearner:
    """Learner on a transformers causal LM (float32 by default): log-probs and entropy of response tokens.

    ``dtype`` "amp-bf16" / "amp-fp16": mixed precision as production learners run it — float32 master weights
    (and so float32 AdamW state), every forward under ``torch.autocast`` in bf16 / fp16 (matmuls in the low
    dtype, norms and softmax statistics as autocast keeps them), the lm-head's matmul in the low dtype with the
    log-softmax statistics in float32. An fp16 learner's gradients need loss scaling (``train.amp.LossScaler``).

    ``quant`` "rtn<k>": float32 master weights, every forward through the k-bit rounded weights with a
    straight-through gradient (``fake_quant.straight_through``) — the learner of an ``hf:rtn<k>`` sampler with
    the mismatch removed rather than corrected, as quantisation-aware training does."""

    def __init__(
        self,
        model_path: str | Path = BUILTIN,
        dtype: torch.dtype | str = torch.float32,
        attn: str = "eager",
        device: str | torch.device | None = None,
        chunk_size: int = 4096,
        share_prompts: bool = True,
        routing_replay: str | None = None,
        skeleton: bool = False,
        gradient_checkpointing: bool = False,
        lora: dict | None = None,
        quant: str | None = None,
    ) -> None:
        """``skeleton``: the model's structure on the meta device, no weights read or held (a data-parallel
        rank > 0: ``distributed.shard.ShardedLearner`` fills its shards from rank 0); it cannot score until
        then. ``gradient_checkpointing``: a scoring forward with gradients keeps only each decoder layer's
        input and recomputes the layer in the backward pass (``checkpointed_layers``). ``lora``: {r, alpha,
        dropout, target_modules} — LoRA adapters on a frozen base (``engines/lora.py``); ``state_dict`` then
        gives the merged weights."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
        if routing_replay not in ROUTING_REPLAY_MODES:
            raise ValueError(f"unknown routing_replay {routing_replay!r}; use one of {ROUTING_REPLAY_MODES}")
        self.rtn_bits = rtn_bits(quant)  # hf:rtn<k> as a learner: forwards through the rounded weights
        if quant is not None and self.rtn_bits is None:
            raise ValueError(f"a learner takes rtn<k> quantisation only (a straight-through forward), got {quant!r}")
        if self.rtn_bits is not None and (gradient_checkpointing or lora is not None):
            raise ValueError(f"hf:{quant} as a learner does not combine with gradient checkpointing or LoRA (both "
                             "recompute or add weights outside its rounded forward)")
        self.autocast = AMP.get(dtype) if isinstance(dtype, str) else None  # None: compute in the weights' dtype
        self.dtype = torch.float32 if self.autocast is not None else resolve_dtype(dtype)
        self.device = torch.device(device) if device is not None else default_device()
        self.model_path = str(model_path)
        model, self.tokenizer = load_model(model_path, dtype=self.dtype, attn=attn, skeleton=skeleton)
        self.attn = attn
        if lora is not None:
            from rollcorr.engines.lora import apply_lora

            apply_lora(model, **lora)
        self.model = model if skeleton else model.to(self.device)
        self.gradient_checkpointing = gradient_checkpointing
        self.chunk_size = chunk_size  # vocabulary rows per lm-head chunk (rollcorr.logprobs)
        # Llama-family models with eager attention: score through LlamaBlocks with shared prompts
        # (share_prompts=False: one full forward through the transformers model, the reference)
        self.share_prompts = share_prompts
        if routing_replay is not None and not is_moe(self.model):
            raise ValueError(f"routing_replay={routing_replay!r} needs a mixture-of-experts model; {model_path} is dense")
        self.routing_replay = routing_replay
        self.replayed_pairs = 0  # token × layer router decisions replaced by the rollout's, over all calls

    def __repr__(self) -> str:
        kind = f"amp-{str(self.autocast).removeprefix('torch.')}" if self.autocast else str(self.dtype).removeprefix("torch.")
        if self.rtn_bits is not None:
            kind = f"rtn{self.rtn_bits} straight-through"
        return f"HFLearner({self.model_path!r}, {kind})"

    def computing(self):
        """The context a forward runs in: autocast to the amp dtype, or nothing."""
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast)

    @property
    def can_shard(self) -> bool:
        """Whether FSDP2 may shard this learner: not an rtn<k> one (FSDP gathers the weights in its own forward
        hooks, which the rounded forward cannot see)."""
        return self.rtn_bits is None

    def rounding(self):
        """The context of a whole scoring pass (forward and lm-head): ``hf:rtn<k>``'s straight-through rounded
        weights, or nothing."""
        return nullcontext() if self.rtn_bits is None else straight_through(self.model, self.rtn_bits)

    def evaluation_sampler(self) -> HFSampler | None:
        """A float32 sampler decoding with this learner's own tensors (no copy): what an hf:fp32 sampler loaded
        with ``state_dict()`` decodes, token for token, for greedy evaluation. None where the model's tensors are
        not those weights or not float32 (LoRA: merged on export; rtn<k>: rounded in each forward; a bf16 learner;
        a skeleton)."""
        from rollcorr.engines.lora import is_lora

        if (self.dtype != torch.float32 or self.rtn_bits is not None or self.attn != "eager"
                or is_lora(self.model) or any(p.is_meta for p in self.model.parameters())):
            return None
        return HFSampler(self.model_path, attn=self.attn, device=self.device, shared=(self.model, self.tokenizer))

    def state_dict(self) -> dict[str, Tensor]:
        """The weights a sampler or an exported model takes: the model's own, or with LoRA the merged ones."""
        from rollcorr.engines.lora import merged_state_dict

        return merged_state_dict(self.model)

    @torch.no_grad()
    def routed_experts(self, rollout: Rollout) -> Tensor:
        """(B, T, L, k) int64: the experts this learner's routers use (after its replay, if any) at the
        positions that predict each response token, from one scoring forward; 0 on padding."""
        with capture_routing(self.model) as recorder:
            self.log_prob(rollout)
        return response_routing(recorder.take(), rollout.prompt_ids.shape[1], rollout.response_mask)

    def replaying(self, rollout: Rollout | tuple):
        """The routing-replay context of this learner for one forward over ``rollout`` (a no-op without
        ``routing_replay``)."""
        return replay_context(self.model, self.routing_replay, rollout)

    def parameters(self):
        return self.model.parameters()

    def named_parameters(self):
        return self.model.named_parameters()

    def log_prob(
        self,
        rollout_or_input: Rollout | tuple[Tensor, Tensor, Tensor, Tensor],
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        grad: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """log π(y_t) (B, T) float32 of the response tokens, 0 on padding [, entropy (B, T)].

        Input: a Rollout or (prompt_ids (B, P) left-padded, prompt_mask, response_ids (B, T) right-padded,
        response_mask). One forward over prompt + response (shared prompts: see the module docstring); the
        logits predicting y_t sit at position P − 1 + t. log π = log_softmax(logits / temperature) (temperature 0 = greedy sampling, scored at 1).
        The lm-head and softmax are ``rollcorr.logprobs.logprobs_from_hidden``: ``chunk_size`` vocabulary rows
        at a time with an online log-sum-exp (recomputed in the backward pass), so the (B, T, V) logits never
        exist. A head that is not a bias-free ``nn.Linear`` (e.g. int8-quantised) gives its logits to
        ``logprobs_from_logits`` instead. A Rollout with ``kept_ids`` (the sampler's top-k / top-p kept sets) is
        scored over them: log π_S(y_t) = log π(y_t) − log π(S_t) (``rollcorr.logprobs.logprobs_over_kept``).
        """
        prompt_ids, prompt_mask, response_ids, token_mask, response_mask = unpack(rollout_or_input)
        if not (temperature >= 0):
            raise ValueError(f"temperature must be ≥ 0, got {temperature!r}")
        temp = 1.0 if temperature == 0 else float(temperature)
        dev = self.device
        ids = torch.cat([prompt_ids, response_ids], 1).to(dev)
        mask = torch.cat([prompt_mask.bool(), token_mask.bool()], 1).to(dev)
        p, t = prompt_ids.shape[1], response_ids.shape[1]
        if p == 0:
            raise ValueError("empty prompt: the first response token has no context to be scored from")

        checkpointing = grad and self.gradient_checkpointing
        with torch.set_grad_enabled(grad), self.replaying(rollout_or_input) as replay, self.rounding(), \
                checkpointed_layers(self.model) if checkpointing else nullcontext():
            with self.computing():
                if self.share_prompts and not checkpointing and static_kv_supported(self.model):  # (may be swapped in)
                    hidden = prefix_shared_hidden(LlamaBlocks(self.model), ids, mask, p)
                else:
                    body = self.model.get_decoder()
                    hidden = body(
                        input_ids=ids,
                        attention_mask=mask.long(),
                        position_ids=positions_from_mask(mask),
                        use_cache=False,
                    ).last_hidden_state
                    hidden = hidden[:, p - 1 : p - 1 + t]  # (B, T, H): the states that predict the response tokens
            if replay is not None:
                self.replayed_pairs += replay.forced_tokens
            b = hidden.shape[0]
            flat, targets = hidden.reshape(b * t, -1), response_ids.to(dev).reshape(-1)
            kept = kept_ids_of(rollout_or_input)
            log_prob, entropy = self._head_log_prob(flat, targets, temp, with_entropy,
                                                    None if kept is None else kept.to(dev).reshape(b * t, -1))
            valid = response_mask.bool().to(dev)
            log_prob = log_prob.reshape(b, t).masked_fill(~valid, 0.0)
            if not with_entropy:
                return log_prob
            return log_prob, entropy.reshape(b, t).masked_fill(~valid, 0.0)


    def _head_log_prob(self, flat: Tensor, targets: Tensor, temp: float, with_entropy: bool, kept: Tensor | None
                       ) -> tuple[Tensor, Tensor | None]:
        """(log π (N,), entropy (N,) or None) of the lm-head over hidden states (N, H). ``kept`` (N, K): each token
        scored over its kept set (``logprobs_over_kept``), the entropy still the full distribution's (no gradient)."""
        head = self.model.get_output_embeddings()
        fused = isinstance(head, nn.Linear) and head.bias is None  # the (N, V) logits never exist
        if not fused:  # another head (biased, or int8-quantised by an experiment): its logits, softmax row-chunked
            with self.computing():
                logits = head(flat).float()
            if kept is not None:
                entropy = logprobs_from_logits(logits.detach(), targets, temperature=temp)[1] if with_entropy else None
                return logprobs_over_kept_logits(logits, targets, kept, temperature=temp), entropy
            return logprobs_from_logits(logits, targets, temperature=temp)
        weight = head.weight
        if self.autocast is not None:  # the head's matmul in the amp dtype, as autocast would run it
            flat, weight = flat.to(self.autocast), weight.to(self.autocast)
        if kept is None:
            return logprobs_from_hidden(flat, weight, targets, temperature=temp, chunk_size=self.chunk_size,
                                        with_entropy=with_entropy)
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = logprobs_from_hidden(flat, weight, targets, temperature=temp, chunk_size=self.chunk_size)[1]
        return logprobs_over_kept(flat, weight, targets, kept, temperature=temp), entropy


def kept_ids_of(rollout_or_input: Rollout | tuple) -> Tensor | None:
    """The kept sets a Rollout carries (``Rollout.kept_ids``, recorded under ``sampler_distribution="keep_mask"``),
    which every scoring of it renormalises over; None for a tuple or a rollout without them."""
    return rollout_or_input.kept_ids if isinstance(rollout_or_input, Rollout) else None


@contextmanager
def checkpointed_layers(model: nn.Module):
    """Inside: every decoder layer of ``model`` runs under ``torch.utils.checkpoint`` (non-reentrant): its
    activations are recomputed in the backward pass instead of kept, so a forward with gradients holds one
    layer's activations at a time beside each layer's input. The same arithmetic, so the same gradients."""
    from torch.utils.checkpoint import checkpoint

    layers = list(model.get_decoder().layers)
    for layer in layers:
        layer.forward = functools.partial(checkpoint, type(layer).forward.__get__(layer), use_reentrant=False)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # back to the class's forward


def replay_context(model: nn.Module, mode: str | None, rollout: Rollout | tuple):
    """``replay_routing`` of a rollout's routed experts over its prompt + response when ``mode`` is "r3";
    a no-op context otherwise. ValueError when replay is asked for and the rollout carries no routing."""
    if mode is None:
        return nullcontext()
    if not isinstance(rollout, Rollout) or rollout.routed_experts is None:
        raise ValueError(
            "routing_replay='r3' needs the sampler's routed experts: score a Rollout from an MoE sampler "
            "that captures them (Rollout.routed_experts)"
        )
    ids = sequence_routing(rollout.prompt_mask, rollout.response_mask, rollout.routed_experts,
                           rollout.prompt_routed_experts)
    return replay_routing(model, ids)


def unpack(x: Rollout | tuple[Tensor, Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(prompt_ids, prompt_mask, response_ids, token_mask, response_mask) from a Rollout or a 4-tuple
    (prompt_ids, prompt_mask, response_ids, response_mask), checked: a forward attends to ``token_mask`` (the
    environment's tokens of a multi-turn Rollout too) and scores ``response_mask`` (the model's)."""
    if isinstance(x, Rollout):
        return x.prompt_ids, x.prompt_mask, x.response_ids, x.token_mask, x.response_mask
    if not (isinstance(x, tuple | list) and len(x) == 4):
        raise TypeError(
            "log_prob expects a Rollout or (prompt_ids, prompt_mask, response_ids, response_mask)"
        )
    prompt_ids, prompt_mask, response_ids, response_mask = x
    if prompt_ids.dim() != 2 or response_ids.dim() != 2 or prompt_ids.shape[0] != response_ids.shape[0]:
        raise ValueError(
            f"expected (B, P) and (B, T) ids, got {tuple(prompt_ids.shape)} and {tuple(response_ids.shape)}"
        )
    if prompt_mask.shape != prompt_ids.shape or response_mask.shape != response_ids.shape:
        raise ValueError("masks must have the shapes of their ids")
    return prompt_ids, prompt_mask, response_ids, response_mask, response_mask


# ---- hf:exact: the bitwise-exact pair (its arithmetic: engines/exact.py) --------------------------------------


class ExactSampler(HFSampler):
    """``hf:exact`` as a sampler: float32 weights, the exact decode (``exact.decode``); temperature only."""

    def __init__(self, model_path, **kwargs) -> None:
        kwargs.pop("dtype", None)
        super().__init__(model_path, dtype=torch.float32, **kwargs)
        self.forward = exact.ExactForward(self.model)

    def __repr__(self) -> str:
        return f"ExactSampler({self.model_path!r}, version={self.version})"

    def _decode(self, contexts, budgets, params, max_steps):
        if params.top_k or params.top_p < 1.0:  # refused before: engines.spec.check_truncation
            raise ValueError(f"hf:exact: top_k {params.top_k}, top_p {params.top_p}: {NO_TRUNCATION}")
        gen = torch.Generator(device=self.device)
        if params.seed is not None:
            gen.manual_seed(params.seed)
        else:
            gen.seed()
        limit = max(budgets) if max_steps is None else min(max(budgets), max_steps)
        return exact.decode(self.forward, contexts, budgets, params.temperature or 1.0, params.greedy, self.eos_id,
                            gen, limit, self.device)


class ExactLearner(HFLearner):
    """``hf:exact`` as a learner: float32 weights trained as usual, log-probs by the exact full forward."""

    def __init__(self, model_path, **kwargs) -> None:
        kwargs.pop("dtype", None)
        if kwargs.get("routing_replay") or kwargs.get("lora"):
            raise ValueError("hf:exact covers dense models without LoRA")
        super().__init__(model_path, dtype=torch.float32, **kwargs)
        self.forward = exact.ExactForward(self.model)

    def __repr__(self) -> str:
        return f"ExactLearner({self.model_path!r})"

    def log_prob(self, rollout_or_input, *, temperature: float = 1.0, with_entropy: bool = False, grad: bool = False):
        if kept_ids_of(rollout_or_input) is not None:
            raise ValueError("hf:exact scores the full distribution only: it cannot renormalise over a top-k/top-p "
                             "kept set (use another learner, or algorithm.correction.sampler_distribution=truncated)")
        prompt_ids, prompt_mask, response_ids, token_mask, response_mask = unpack(rollout_or_input)
        if self.forward.model is not self.model:  # a strategy scored with other weights swapped in
            self.forward = exact.ExactForward(self.model)
        dev = self.device
        temp = 1.0 if temperature == 0 else float(temperature)
        with torch.set_grad_enabled(grad):
            return exact.score(self.forward, prompt_ids.to(dev), prompt_mask.to(dev), response_ids.to(dev),
                               token_mask.to(dev), temp, with_entropy, scored=response_mask.to(dev))


# ---- the backend: the hf spec grammar, its refusals and engines ----------------------------------------------

RTN = tuple(f"rtn{k}" for k in range(MIN_BITS, MAX_BITS + 1))  # hf:rtn<k>: k-bit round-to-nearest weights
EXACT = "exact"  # hf:exact: the bitwise-exact sampler / learner pair
NO_TRUNCATION = ("hf:exact samples at a temperature only (a truncated distribution's kept mass would need the same "
                 "exact reductions)")
DTYPES = (*FLOAT_DTYPES, "int8", *AMP, EXACT)  # the first option: a dtype, int8, an amp learner or exact
ATTNS = ("eager", "sdpa")


class HFBackend(Backend):
    """``hf[:fp32|bf16|fp16|int8|rtn<k>|amp-bf16|amp-fp16|exact][:eager|sdpa]``, options in any order (default
    fp32, eager). int8 and rtn<k> quantise a float32 sampler (rtn<k> as a learner: a rounded forward with a
    straight-through gradient to float32 master weights); amp-* are learners (float32 master weights, autocast
    compute); exact is the bitwise-exact pair. Samplers and learners; the sampler runs in this process."""

    name = "hf"
    builds_learner = True
    in_process = True
    captures_routing = True
    precisions = FLOAT_DTYPES

    def parse(self, spec: str, options: list[str]) -> EngineSpec:
        dtype = attn = quant = None
        for opt in options:
            if (opt in DTYPES or opt in RTN) and dtype is None and quant is None:
                if opt == "int8" or opt in RTN:
                    quant, dtype = opt, "fp32"
                else:
                    dtype = opt
            elif opt in ATTNS and attn is None:
                attn = opt
            else:
                known = (*DTYPES, RTN[0] + "…" + RTN[-1][3:], *ATTNS)
                raise ValueError(f"unknown or repeated option {opt!r} in engine spec {spec!r}; hf accepts {known}")
        return EngineSpec("hf", dtype=dtype or "fp32", attn=attn or "eager", quant=quant)

    def check_spec(self, parsed: EngineSpec, spec: str, role: str) -> None:
        if role == "learner" and parsed.quant == "int8":
            raise ValueError(f"{spec!r}: int8 quantisation is for samplers; a learner trains float weights (use hf, "
                             "hf:bf16, or hf:rtn<k>: float32 master weights with a rounded forward)")
        if role == "sampler" and parsed.dtype in AMP:
            compute = parsed.dtype.removeprefix("amp-")
            raise ValueError(f"hf:{parsed.dtype} is a learner (float32 master weights, {compute} compute under "
                             f"autocast); as a sampler use hf:{compute}")

    def check_trainable(self, parsed: EngineSpec, spec: str) -> None:
        """fp16 weights cannot take AdamW steps: eps = 1e-8 rounds to 0 in fp16, so m/(√v + eps) is 0/0 = NaN
        wherever v underflows, and every weight turns NaN within a step (there are no fp32 master weights)."""
        if parsed.dtype == "fp16" and parsed.quant is None:
            raise ValueError(f"{spec!r} cannot be trained (fp16 weights with no fp32 master copy: AdamW's eps rounds "
                             "to 0 and the weights turn NaN); use hf:amp-fp16 (fp32 master weights, fp16 compute, "
                             "loss scaling), hf:fp32 or hf:bf16 (the sampler may stay fp16)")

    def can_shard(self, parsed: EngineSpec) -> bool:
        """Not an rtn<k> learner: FSDP2 gathers the weights in hooks its rounded forward cannot see."""
        return parsed.quant is None

    def sampler_class(self, parsed: EngineSpec) -> type:
        return ExactSampler if parsed.dtype == EXACT else HFSampler

    def no_truncation(self, parsed: EngineSpec) -> str | None:
        return NO_TRUNCATION if parsed.dtype == EXACT else None

    def make_sampler(self, parsed: EngineSpec, model_path, *, threads: int = 0, **kwargs) -> HFSampler:
        """``threads`` is not the engine's: hf samplers run in torch's pool, which the process sets."""
        if parsed.dtype == EXACT:
            return ExactSampler(model_path, **kwargs)
        return HFSampler(model_path, dtype=parsed.dtype, attn=parsed.attn, quant=parsed.quant, **kwargs)

    def make_learner(self, parsed: EngineSpec, model_path, **kwargs) -> HFLearner:
        if parsed.dtype == EXACT:
            return ExactLearner(model_path, **kwargs)
        return HFLearner(model_path, dtype=parsed.dtype, attn=parsed.attn, quant=parsed.quant, **kwargs)

    def with_dtype(self, parsed: EngineSpec, dtype: str) -> str:
        """The attention option is kept: hf:bf16:sdpa → hf:fp16:sdpa."""
        attn = f":{parsed.attn}" if parsed.attn and parsed.attn != "eager" else ""
        return super().with_dtype(parsed, dtype) + attn


register_backend(HFBackend())

__all__ = ["ExactLearner", "ExactSampler", "HFBackend", "HFLearner", "HFSampler", "finished_rows", "quantize_int8"]
