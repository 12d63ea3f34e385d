"""Checkpoints of a learner sharded over ranks: ``rollcorr.checkpoint`` with the tensors in DCP's format.

A data-parallel run's ``checkpoints/step_N/`` is the one-process layout (``rollcorr.checkpoint``) with the
weights and AdamW state moved into the format of ``torch.distributed.checkpoint`` (DCP):

    state.pt   everything else (step, version, executor, RNG, config, ...), written by rank 0; its "model" and
               "optimizer" entries are the string "dcp"
    dcp/       every rank writes its own shards of the weights and optimizer state (``dcp.save``), plus
               DCP's metadata; loading reshards to whatever N reads it (N=2 → N=1 → N=2). The π_old
               strategy's held weights (``DTensor`` shards in its state dict: snapshot versions, the EWMA
               average) go here too, under "proximal"; state.pt keeps a marker in their place
    model/     the full weights as a Hugging Face directory (gathered once, written by rank 0)

Atomic like one process's: everything goes to ``.tmp-step_N``; rank 0 writes the checksum manifest over all of
it (``dcp/`` included, so ``load_checkpoint`` checks every shard file), fsyncs and renames it
(``rollcorr.checkpoint.commit_checkpoint``). ``ShardedCheckpointer`` extends the one-process ``Checkpointer``:
it writes this layout, loads a sharded checkpoint into this run's shards, and a one-process checkpoint's full
tensors by keeping each rank's shards of them (``load_full``, ``shard_held``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollcorr.checkpoint import (
    DCP_DIR,
    HELD,
    SHARDED,
    STATE_FILE,
    Checkpointer,
    checkpoint_dir,
    checkpoints_root,
    commit_checkpoint,
    fsync_tree,
    write_manifest,
)
from rollcorr.distributed.ranks import Ranks
from rollcorr.shards import is_sharded


def split_held(obj: Any, path: str = "proximal", seen: dict | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """``obj`` (a strategy's state dict) with every ``DTensor`` replaced by a marker, and those tensors by key.
    A tensor met again (tied weights: embeddings and lm head) gets the first one's key, so it stays shared."""
    seen = {} if seen is None else seen
    if is_sharded(obj):
        local = obj.to_local()
        key = (local.untyped_storage().data_ptr(), local.storage_offset())
        first = seen.setdefault(key, path)
        marker = {HELD: first, "shape": list(obj.shape), "dtype": str(obj.dtype).removeprefix("torch.")}
        return marker, ({path: obj} if first == path else {})
    if isinstance(obj, dict):
        out, found = {}, {}
        for key, value in obj.items():
            out[key], more = split_held(value, f"{path}/{key}", seen)
            found.update(more)
        return out, found
    return obj, {}


def shard_held(held: dict[str, dict[str, torch.Tensor]], model: nn.Module) -> None:
    """Full weight copies (a one-process checkpoint's) laid out like ``model``'s sharded weights, in place:
    each rank keeps its shards (local chunking, no communication)."""
    from torch.distributed.tensor import distribute_tensor

    live = model.state_dict()
    for copy in held.values():
        done: dict[tuple[int, int], torch.Tensor] = {}  # tied tensors (embeddings / lm head) stay shared
        for name, value in copy.items():
            if is_sharded(live[name]) and not is_sharded(value):
                key = (value.untyped_storage().data_ptr(), value.storage_offset())
                if key not in done:
                    done[key] = distribute_tensor(value.to(live[name].device), live[name].device_mesh,
                                                  live[name].placements, src_data_rank=None)
                copy[name] = done[key]


def in_model_order(model: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` keyed and ordered as ``model.state_dict()``, a tied tensor saved once (the lm-head) under each
    of its names. ``set_model_state_dict`` scatters the tensors one by one in the dict's order, so every rank must
    walk the same order: a safetensors file read back gives its own (it differs between processes)."""
    names_of: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(parameter), []).append(name)
    tied = {name: names for names in names_of.values() for name in names}
    ordered = {}
    for name in model.state_dict():
        saved = next((alias for alias in tied.get(name, [name]) if alias in weights), None)
        if saved is not None:
            ordered[name] = weights[saved]
    return ordered


def load_full(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
              optim_state: dict[str, Any]) -> None:
    """A one-process checkpoint's full weights and ``optimizer.state_dict()`` into a sharded model: every rank
    keeps its shards. The optimizer's parameter ids are renamed to parameter names first (the form
    ``set_optimizer_state_dict`` reads)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, in_model_order(model, weights), options=options)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    named = {
        "state": {names[i]: value for i, value in optim_state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in optim_state["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, named, options=options)


class ShardedCheckpointer(Checkpointer):
    """``Checkpointer`` for a ``ShardedLearner``: ``save`` and ``load`` are collectives (every rank calls them)."""

    def __init__(self, learner, optimizer: torch.optim.Optimizer, ranks: Ranks) -> None:
        super().__init__(learner, optimizer)
        self.ranks = ranks

    def save(self, run_dir: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
        """Write checkpoint ``step`` from every rank; returns its final path."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        ranks, learner = self.ranks, self.learner
        final = checkpoint_dir(run_dir, step)
        tmp = final.parent / f".tmp-{final.name}"
        if ranks.is_main:
            checkpoints_root(run_dir, create=True)  # a real folder, never a link (rollcorr.safe_io)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        ranks.barrier()
        try:
            model_state, optim_state = get_state_dict(learner.model, self.optimizer)
            proximal, held = split_held(state.get("proximal"))
            shards = {"model": model_state, "optimizer": optim_state, **({"proximal": held} if held else {})}
            dcp.save(shards, checkpoint_id=str(tmp / DCP_DIR))
            full = learner.state_dict()  # rank 0: the HF export
            if ranks.is_main:
                torch.save({**state, "model": SHARDED, "optimizer": SHARDED, "proximal": proximal}, tmp / STATE_FILE)
                learner.inner.model.save_pretrained(tmp / "model", state_dict=full)
                learner.tokenizer.save_pretrained(tmp / "model")
                write_manifest(tmp)  # every rank's dcp/ files are written: dcp.save returned on rank 0
                fsync_tree(tmp)
            ranks.barrier()
        except BaseException:
            if ranks.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if ranks.is_main:
            commit_checkpoint(run_dir, step, tmp, keep)
        ranks.barrier()
        return final

    def load(self, path: Path, state: dict[str, Any], proximal) -> None:
        super().load(path, state, proximal)
        shard_held(proximal.held_weights(), self.learner.model)  # a one-process checkpoint's copies: our shards

    def load_whole(self, weights: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
        load_full(self.learner.model, self.optimizer, weights, optim_state)

    def held_target(self, marker: dict) -> torch.Tensor:
        """This run's shards of a held tensor (dim 0 over the ranks, as FSDP2 shards the weights it copies)."""
        from torch.distributed.tensor import Shard, empty

        dtype = getattr(torch, marker["dtype"])
        return empty(marker["shape"], dtype=dtype, device_mesh=self.ranks.mesh, placements=[Shard(0)])
