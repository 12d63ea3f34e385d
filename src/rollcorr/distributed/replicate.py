"""The learner replicated on every rank, its gradients averaged by one all-reduce per optimizer step (DDP's
scheme, written out: no wrapper module, so the model, its parameter names and the learner's fast scoring path
stay those of one process).

    build      rank 0 loads the weights; ranks > 0 build a skeleton on the meta device, allocate it, and receive
               rank 0's parameters and buffers in one broadcast per dtype (``broadcast_from_rank0``)
    forward    each rank scores its own rows with the whole model: no collective in any forward or backward
    gradients  after a mini-batch's backward, every gradient is packed into one buffer per dtype and
               all-reduced once (``GradientAverager``): the mean over ranks, as FSDP2's reduce-scatter gives,
               so ``train/step.py`` scales each rank's loss by N alike for both layouts
    optimizer  AdamW on the whole parameters, on every rank, from the same gradients: the ranks stay equal

Against FSDP2's sharding (``shard.py``): per optimizer step one collective instead of an all-gather per layer
per forward and backward plus a reduce-scatter per layer, and plain tensors instead of ``DTensor`` s in the
optimizer — but every rank holds the whole model, its gradients and AdamW's two moments (4× the parameters'
bytes in fp32). ``fits_replicated`` is ``trainer.data_parallel=auto``'s rule: replicate when that training
state takes at most ``REPLICATE_SHARE`` of a rank's memory, else shard.

Checkpoints are one process's (``ReplicatedCheckpointer``: rank 0 writes ``rollcorr.checkpoint``'s layout, every
rank reads it), so they resume at any N and in either layout.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rollcorr.checkpoint import Checkpointer
from rollcorr.distributed.ranks import Ranks
from rollcorr.distributed.shard import require_same_layout

REPLICATE_SHARE = 0.25  # auto: replicate while parameters + gradients + AdamW state take ≤ this share of a rank's memory
TRAINING_COPIES = 4  # parameters, gradients, AdamW's exp_avg and exp_avg_sq


def training_state_bytes(model: nn.Module) -> int:
    """Bytes one rank holds to train ``model`` whole: its parameters, their gradients and AdamW's two moments
    (each the parameters' size; a skeleton on the meta device counts as built)."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()  # tied weights once
    return TRAINING_COPIES * sum(p.numel() * p.element_size() for p in params)


def rank_memory_bytes(ranks: Ranks) -> int:
    """The memory one rank may count on: its GPU's (CUDA ranks), else the host's physical memory shared by the
    ranks on this host (``LOCAL_WORLD_SIZE``, torchrun's; the world size when unset)."""
    if ranks.device.type == "cuda":
        return int(torch.cuda.get_device_properties(ranks.device).total_memory)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world)), 1)


def fits_replicated(state_bytes: int, memory_bytes: int) -> bool:
    """``trainer.data_parallel=auto``: whole training state ≤ ``REPLICATE_SHARE`` of the rank's memory."""
    return state_bytes <= REPLICATE_SHARE * memory_bytes


def _by_dtype(tensors: Iterable[Tensor]) -> dict[torch.dtype, list[Tensor]]:
    groups: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


@torch.no_grad()
def broadcast_from_rank0(tensors: list[Tensor], ranks: Ranks) -> None:
    """Every rank's ``tensors`` (the same names, shapes and dtypes on every rank, in the same order) set to rank
    0's, in place: one packed broadcast per dtype."""
    import torch.distributed as dist

    for group in _by_dtype(tensors).values():
        packed = torch.cat([t.reshape(-1) for t in group]).to(ranks.device) if ranks.is_main else torch.empty(
            sum(t.numel() for t in group), dtype=group[0].dtype, device=ranks.device)
        dist.broadcast(packed, src=0)
        if not ranks.is_main:
            offset = 0
            for t in group:
                t.copy_(packed[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


class GradientAverager:
    """A replicated learner's gradients averaged over the ranks, one all-reduce per dtype, in buffers kept from one
    optimizer step to the next (a fresh buffer of the gradients' size each step costs its page faults again:
    about as much as the reduction itself on a CPU).

    A parameter no rank gave a gradient keeps ``grad = None`` (AdamW then leaves it alone, as in one
    process); one that some ranks did not reach (a rank with no rows) counts as zero there. Each group's
    buffer carries one extra slot per parameter, 1 where this rank has its gradient, so the ranks learn which
    is which in the same collective; the first group one more, 1 where this rank's loss was not finite (no
    collective of its own: a replicated learner's backward has none, so the ranks need not agree before it)."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, Tensor] = {}

    @torch.no_grad()
    def __call__(self, params: list[Tensor], ranks: Ranks, finite: bool = True) -> bool:
        """Each gradient in ``params`` replaced by its mean over ``ranks``; whether ``finite`` (this rank's loss
        was finite) held on every rank."""
        groups = list(_by_dtype(params).values())
        if not groups:
            return ranks.all_true(finite)
        every_rank_finite = finite
        for index, group in enumerate(groups):
            dtype, device = group[0].dtype, group[0].device
            have = [p.grad is not None for p in group] + ([not finite] if index == 0 else [])
            size = sum(p.numel() for p in group) + len(have)
            packed = self._buffers.get(dtype)
            if packed is None or packed.numel() != size or packed.device != device:
                packed = self._buffers[dtype] = torch.empty(size, dtype=dtype, device=device)
            offset = 0
            for p in group:
                values = packed[offset : offset + p.numel()]
                if p.grad is None:
                    values.zero_()
                else:
                    values.copy_(p.grad.reshape(-1))
                offset += p.numel()
            packed[offset:] = torch.tensor(have, dtype=dtype)
            ranks.all_reduce(packed, out=packed)
            slots = packed[offset:].tolist()
            if index == 0:
                every_rank_finite = slots.pop() == 0  # a count of ranks, > 0 even where the dtype rounds it
            packed[:offset].div_(ranks.world)
            offset = 0
            for p, reached in zip(group, slots):
                values = packed[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if reached == 0:
                    p.grad = None
                elif p.grad is None:
                    p.grad = values.clone()
                else:
                    p.grad.copy_(values)
        return every_rank_finite


def _layout(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every parameter (tied ones once) and buffer, in the order they are broadcast."""
    entries = list(model.named_parameters()) + [(f"buffer:{n}", b) for n, b in model.named_buffers()]
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in entries]


class ReplicatedLearner:
    """An ``HFLearner`` held whole on every rank of ``ranks``; same ``log_prob`` contract, scoring this rank's
    rows alone (no collective: ``collective = False``). ``state_dict()`` is the Learner protocol's weights a
    sampler takes, whole on every rank."""

    collective = False  # proximal.scoring.scores_together: each rank scores on its own

    def __init__(self, learner, ranks: Ranks) -> None:
        self.ranks, self.inner = ranks, learner
        model = learner.model
        skeleton = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        if skeleton and ranks.is_main:
            raise ValueError("rank 0 must load the model's weights (skeleton=False): the other ranks' come from it")
        if skeleton:  # memory for the weights rank 0 sends; allocating unties tied weights: tie them again
            model.to_empty(device=ranks.device)
            model.tie_weights()
        else:
            model.to(ranks.device)
        require_same_layout(_layout(model), ranks)  # parameters deduplicated: a tie lost on a rank shows
        broadcast_from_rank0([*dict(model.named_parameters()).values(), *dict(model.named_buffers()).values()], ranks)
        learner.device = ranks.device
        self.model, self.tokenizer = model, learner.tokenizer
        self.device, self.dtype, self.model_path = ranks.device, learner.dtype, learner.model_path

    def __repr__(self) -> str:
        return f"ReplicatedLearner({self.inner!r}, rank {self.ranks.rank} of {self.ranks.world})"

    def parameters(self):
        return self.model.parameters()

    def named_parameters(self):
        return self.model.named_parameters()

    def log_prob(self, rollout_or_input, *, temperature: float = 1.0, with_entropy: bool = False,
                 grad: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """``HFLearner.log_prob`` on this rank's rows, with ``self.model`` (a π_old strategy may hand another
        module, ``proximal.scoring.with_model``)."""
        if self.model is not self.inner.model:
            from rollcorr.proximal.scoring import with_model

            return with_model(self.inner, self.model).log_prob(
                rollout_or_input, temperature=temperature, with_entropy=with_entropy, grad=grad)
        return self.inner.log_prob(rollout_or_input, temperature=temperature, with_entropy=with_entropy, grad=grad)

    def state_dict(self) -> dict[str, Tensor]:
        """The full weights, on every rank (each rank's sampler takes them: ``distributed.roles.ShareExecutor``)."""
        return self.inner.state_dict()


class ReplicatedCheckpointer(Checkpointer):
    """``Checkpointer`` for a ``ReplicatedLearner``: rank 0 writes one process's checkpoint (every rank holds the
    same weights and AdamW state), the others wait for it and hear whether it was written; every rank reads
    a checkpoint itself (either layout: ``Checkpointer.load`` reshards a sharded one to whole tensors)."""

    def __init__(self, learner, optimizer: torch.optim.Optimizer, ranks: Ranks) -> None:
        super().__init__(learner, optimizer)
        self.ranks = ranks

    def save(self, run_dir: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
        error: BaseException | None = None
        path = None
        if self.ranks.is_main:
            try:
                path = super().save(run_dir, step, state, keep)
            except Exception as err:  # said on every rank below; rank 0 raises its own
                error = err
        said = self.ranks.broadcast(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if said is not None:
            raise OSError(f"rank 0 could not write checkpoint {step}: {said}")
        return self.ranks.broadcast(path)
