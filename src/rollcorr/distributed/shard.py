"""The learner sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

    units    every decoder layer (``model.model.layers[i]``) is one FSDP unit; the root unit holds the rest
             (token embeddings, final norm, lm head — tied or not)
    root     a small module whose ``forward`` is ``HFLearner.log_prob``: the chunked lm-head
             (``rollcorr.logprobs``) reads ``lm_head.weight`` directly rather than calling the module, so the
             root parameters must be gathered for the whole scoring call, and their gradients reduce-scattered
             after its backward; FSDP's hooks on this root do exactly that
    scoring  through transformers' own decoder forward (``share_prompts=False``): FSDP gathers a layer in that
             layer's ``forward``, and the shared-prompt path (``kvdecode.LlamaBlocks``) calls the layers'
             sub-modules by hand and each layer twice

Building: rank 0 loads the weights; the other ranks may build the model as a skeleton on the meta device
(``make_learner(..., skeleton=True)``, what the trainer does) and receive their shards from rank 0 after
sharding (``load_from_rank0``), so no rank but rank 0 ever holds the whole model. The trainer builds rank 0's
in host memory: ``fully_shard`` moves each unit's weights to the rank's device as it shards it, so no GPU
holds more than its shards and one unit's full weights while the model is built.

At rest each rank holds 1/N of every parameter, gradient and AdamW state (``DTensor`` shards along dim 0);
a layer's full weights exist only while it runs. Gradients are reduce-scattered with their mean over ranks
(FSDP's default), so ``train/step.py`` scales each rank's loss by N (``Ranks.world``) to get the sum the
global-batch normalisation needs.

``group.ProcessGroup.shard`` builds one (``Ranks.shard``: what the trainer calls, with ``fsdp_options``).

Why FSDP2 and not DDP: DDP keeps the whole model and optimizer state on every rank (it all-reduces gradients
only), so it cannot train a model that does not fit one process; FSDP2 with ``reshard_after_forward=False``
keeps parameters gathered between forward and backward (DDP's speed, ZeRO-2's memory) and is what
``reshard_after_forward`` selects. rollcorr uses FSDP2 everywhere (also at N=1 under torchrun) so there is
one code path; DDP would only be worth it for models so small that FSDP's per-layer all-gathers dominate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rollcorr.distributed.ranks import DistributedError, Ranks
from rollcorr.engines.hf import unpack
from rollcorr.rollout import Rollout
from rollcorr.shards import local_tensor


class _ScoringRoot(nn.Module):
    """FSDP's root unit: ``forward`` is the wrapped learner's ``log_prob`` (see the module docstring)."""

    def __init__(self, learner) -> None:
        super().__init__()
        self.model = learner.model
        self.__dict__["_learner"] = learner  # not a submodule: its model is already registered above

    def forward(self, rollout_or_input, temperature: float, with_entropy: bool, grad: bool):
        # the Rollout itself when there is one: its routed experts are what routing replay forces
        return self._learner.log_prob(rollout_or_input, temperature=temperature, with_entropy=with_entropy, grad=grad)


def one_row_stand_in(rollout_or_input):
    """A one-row input of the same widths, for a rank with no rows to join the collectives with: ids and masks
    1; a Rollout's routed experts (routing replay) expert j in top-k slot j, so the replay stays valid."""
    prompt_ids, prompt_mask, response_ids, response_mask = (x.new_ones((1, x.shape[1])) for x in unpack(rollout_or_input)[:4])
    if not isinstance(rollout_or_input, Rollout):
        return prompt_ids, prompt_mask, response_ids, response_mask

    def routing(x: Tensor | None) -> Tensor | None:
        return None if x is None else torch.arange(x.shape[-1], dtype=x.dtype).expand(1, *x.shape[1:]).clone()

    return Rollout(prompt_ids, prompt_mask, response_ids, response_mask, rollout_log_prob=None,
                   version=response_ids.new_zeros(response_ids.shape), group_ids=response_ids.new_zeros((1,)),
                   routed_experts=routing(rollout_or_input.routed_experts),
                   prompt_routed_experts=routing(rollout_or_input.prompt_routed_experts))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers causal LM (``model.model.layers``), each one FSDP unit."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no decoder layers found (expected model.model.layers)")
    return list(layers)


class ShardedLearner:
    """An ``HFLearner`` whose model is sharded over ``ranks`` with FSDP2; same ``log_prob`` contract.

    ``model`` is the (sharded) transformers model: its parameters are ``DTensor`` shards, which is what the
    optimizer is built on (``model.state_dict()``: this rank's shards). ``state_dict()`` is the Learner
    protocol's, the weights a sampler takes: the full weights, gathered (rank 0 gets them, on the CPU).
    ``reshard_after_forward`` and ``mp_policy`` are FSDP2's own options (``trainer.fsdp``, ``fsdp_options``).

    Scoring is a collective (``collective``): every rank calls ``log_prob`` the same number of times, a rank
    with no rows too (it then runs a one-token stand-in forward and returns (0, T)). After a no-grad call every
    unit is resharded, so between calls the shards are the only copy of the weights: a π_old strategy may
    exchange them for weights it holds (``proximal.scoring.swapped_in``) and the next forward gathers those.
    """

    collective = True  # proximal.scoring.scores_together

    def __init__(
        self, learner, ranks: Ranks, *, reshard_after_forward: bool = True, mp_policy: Any = None
    ) -> None:
        from torch.distributed.fsdp import fully_shard

        if not getattr(learner, "can_shard", True):
            raise ValueError(f"{learner!r} cannot be sharded (FSDP2 gathers the weights in its own hooks, outside the "
                             "learner's forward): use trainer.data_parallel=replicate")
        self.ranks = ranks
        self.inner = learner
        learner.share_prompts = False  # transformers' decoder forward: FSDP gathers each layer in its forward
        skeleton = any(p.is_meta for p in learner.model.parameters())
        if skeleton and ranks.is_main:
            raise ValueError("rank 0 must load the model's weights (skeleton=False): the other ranks' come from it")
        from_rank0 = not ranks.all_true(not skeleton)  # some rank holds a skeleton (every rank takes this branch)
        full = learner.model.state_dict() if from_rank0 and ranks.is_main else {}  # kept until sent
        learner.device = ranks.device  # fully_shard moves each unit's weights there as it shards it
        kwargs: dict[str, Any] = {"mesh": ranks.mesh, "reshard_after_forward": reshard_after_forward}
        if mp_policy is not None:
            kwargs["mp_policy"] = mp_policy
        self.units: list[nn.Module] = []
        for layer in decoder_layers(learner.model):
            fully_shard(layer, **kwargs)
            self.units.append(layer)
        self.root = _ScoringRoot(learner)
        fully_shard(self.root, **kwargs)
        self.units.append(self.root)
        if from_rank0:
            load_from_rank0(learner.model, full, ranks)
            del full
        self.model = learner.model
        self.tokenizer = learner.tokenizer
        self.device = ranks.device
        self.dtype = learner.dtype
        self.model_path = learner.model_path

    def __repr__(self) -> str:
        return f"ShardedLearner({self.inner!r}, rank {self.ranks.rank} of {self.ranks.world})"

    def parameters(self):
        return self.model.parameters()

    def named_parameters(self):
        return self.model.named_parameters()

    def reshard(self) -> None:
        """Free every gathered copy of the weights. With ``reshard_after_forward=False`` FSDP2 keeps every unit's
        after a forward (the root's too: the option is passed explicitly, so FSDP2's keep-the-root default is
        off); with ``True`` this is a no-op."""
        for unit in self.units:
            unit.reshard()

    def log_prob(self, rollout_or_input, *, temperature: float = 1.0, with_entropy: bool = False,
                 grad: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """``HFLearner.log_prob`` through the FSDP root (every rank calls it, with its own rows). The result
        comes back on the rollout's device (the correction and loss run where the rollout is; on a GPU the
        backward crosses back once per micro-batch)."""
        if self.model is not self.inner.model:  # proximal.scoring.with_model: the root would score its own
            raise TypeError("a sharded learner scores with its own sharded model only; hold other weights as "
                            "proximal.scoring.copy_state copies and score them with score(..., weights=)")
        response_ids = unpack(rollout_or_input)[2]
        rows, home = response_ids.shape[0], response_ids.device
        if rows == 0:  # join the collectives with a one-row stand-in; nothing to return
            rollout_or_input = one_row_stand_in(rollout_or_input)
        out = self.root(rollout_or_input, temperature, with_entropy, grad)
        if not grad:
            self.reshard()
        outs = out if isinstance(out, tuple) else (out,)
        outs = tuple(x[:rows].to(home) for x in outs)
        return outs if isinstance(out, tuple) else outs[0]

    def state_dict(self) -> dict[str, Tensor]:
        """The full weights on rank 0 (CPU tensors; other ranks get {}), called on every rank.

        One ``gather`` of every rank's shards packed into one buffer (FSDP2 shards dim 0 as ``torch.chunk``
        does: rank r holds rows [r·c, (r+1)·c) with c = ⌈rows / N⌉, the last ranks fewer or none), instead of
        one collective per parameter (``get_model_state_dict(full_state_dict=True)``: 50 collectives for the
        built-in model, seconds on a loaded machine). Falls back to that when the weights mix dtypes.
        """
        import torch.distributed as dist

        state = self.model.state_dict()
        world = self.ranks.world
        dtypes = {v.dtype for v in state.values()}
        if len(dtypes) != 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_model_state_dict(self.model, options=options)
        plan: list[tuple[str, torch.Size, int]] = []  # (name, full shape, rows per rank)
        parts = []
        for name, value in state.items():
            local = local_tensor(value).detach()
            shape = value.shape
            rows = -(-shape[0] // world) if local is not value and len(shape) else 0  # 0: not sharded
            if rows:
                pad = torch.zeros((rows - local.shape[0], *shape[1:]), dtype=local.dtype, device=local.device)
                local = torch.cat([local, pad])
            plan.append((name, shape, rows))
            parts.append(local.reshape(-1))
        packed = torch.cat(parts).contiguous()
        gathered = [torch.empty_like(packed) for _ in range(world)] if self.ranks.is_main else None
        dist.gather(packed, gathered, dst=0)
        if not self.ranks.is_main:
            return {}
        per_rank = [g.cpu() for g in gathered]
        out, offset = {}, 0
        for name, shape, rows in plan:
            if rows:
                width = rows * (shape.numel() // shape[0])
                chunks = [g[offset : offset + width].reshape(rows, *shape[1:]) for g in per_rank]
                out[name] = torch.cat(chunks)[: shape[0]].clone()
            else:
                width = shape.numel()
                out[name] = per_rank[0][offset : offset + width].reshape(shape).clone()
            offset += width
        return out


def fsdp_options(reshard_after_forward: bool = True, param_dtype: str | None = None,
                 reduce_dtype: str | None = None) -> dict[str, Any]:
    """``trainer.fsdp`` as ``fully_shard`` keyword arguments: ``reshard_after_forward``, and a
    ``MixedPrecisionPolicy`` when a dtype is named (fp32 | bf16 | fp16; ``models.builtin.DTYPES``)."""
    options: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if param_dtype is not None or reduce_dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from rollcorr.models.builtin import DTYPES

        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=None if param_dtype is None else DTYPES[param_dtype],
            reduce_dtype=None if reduce_dtype is None else DTYPES[reduce_dtype],
        )
    return options


def _layout(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, full shape, dtype) of every state-dict entry and buffer: what every rank must build alike."""
    entries = list(model.state_dict().items()) + [(f"buffer:{n}", b) for n, b in model.named_buffers()]
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in entries]


def require_same_layout(layout: list, ranks: Ranks) -> None:
    """DistributedError unless every rank built the model ``layout`` describes as rank 0 did (every rank calls
    it; the weights then travel from rank 0 in that order)."""
    if not ranks.all_true(ranks.broadcast(layout) == layout):
        raise DistributedError("the ranks built different models (the names, shapes or dtypes of some rank's "
                               "weights and buffers differ from rank 0's): every rank must build the same model")


def load_from_rank0(model: nn.Module, full: dict[str, Tensor], ranks: Ranks) -> None:
    """Fill every rank's shards of the sharded ``model`` from rank 0's weights (``full``: rank 0's whole
    state dict taken before sharding; ``{}`` elsewhere), and its buffers (rotary frequencies and other
    non-persistent ones included) from rank 0's. A rank built as a skeleton (meta device) gets memory first.
    Every rank calls it. Each weight crosses whole, one at a time (``set_model_state_dict`` with
    ``broadcast_from_rank0``), so a rank > 0 holds its shards plus one full weight at most."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    require_same_layout(_layout(model), ranks)
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        model.to_empty(device=ranks.device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    with torch.no_grad():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def peak_parameter_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds at rest for parameters and optimizer state (local shards only)."""
    params = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in model.parameters())
    state = 0
    for entry in optimizer.state.values():
        for value in entry.values():
            if isinstance(value, Tensor):
                local = local_tensor(value)
                state += local.numel() * local.element_size()
    return {"parameters": params, "optimizer_state": state}
