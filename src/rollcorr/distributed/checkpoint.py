"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), resumable at any number of ranks.

A data-parallel run's ``checkpoints/step_N/`` is today's layout (``train/checkpoint.py``) with the weights and
AdamW state moved into DCP's format:

    state.pt   everything else (step, version, executor, RNG, config, ...), written by rank 0; its "model" and
               "optimizer" entries are the string "dcp"
    dcp/       every rank writes its own shards of the weights and optimizer state (``dcp.save``), plus
               DCP's metadata; loading reshards to whatever N reads it (N=2 → N=1 → N=2). The π_old
               strategy's held weights (``DTensor`` shards in its state dict: snapshot versions, the EWMA
               average) go here too, under "proximal"; state.pt keeps a marker in their place
    model/     the full weights as a Hugging Face directory (gathered once, written by rank 0)

Atomic like one process's: everything goes to ``.tmp-step_N``; rank 0 writes the checksum manifest over all of
it (``dcp/`` included, so ``load_checkpoint`` checks every shard file), fsyncs and renames it
(``train.checkpoint.commit_checkpoint``). A one-process run (no process group) reads ``dcp/`` too: DCP loads
without a group, and a data-parallel run reads a one-process checkpoint's full ``state.pt`` tensors and
shards them (``load_full``, ``shard_held``).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DCP_DIR = "dcp"
SHARDED = "dcp"  # the value of state["model"] / state["optimizer"] when the tensors are in dcp/
HELD = "__dcp__"  # a marker dict {HELD: key, "shape", "dtype"} in state.pt where a held DTensor was


def is_sharded(x: Any) -> bool:
    """A ``DTensor`` (a sharded learner's weights, or a strategy's copy of them)."""
    return isinstance(x, torch.Tensor) and hasattr(x, "device_mesh")


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


def _markers(obj: Any) -> list[dict]:
    if isinstance(obj, dict):
        return [obj] if HELD in obj else [m for v in obj.values() for m in _markers(v)]
    return []


def _join_held(obj: Any, loaded: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        return loaded[obj[HELD]] if HELD in obj else {k: _join_held(v, loaded) for k, v in obj.items()}
    return obj


def _held_target(marker: dict, ranks) -> torch.Tensor:
    """Where DCP loads a held tensor: this run's shards of it (dim 0 over the ranks, as FSDP2 shards the
    weights it copies), or the whole tensor in one process."""
    shape, dtype = marker["shape"], getattr(torch, marker["dtype"])
    if ranks is None:
        return torch.empty(shape, dtype=dtype)
    from torch.distributed.tensor import Shard, empty

    return empty(shape, dtype=dtype, device_mesh=ranks.mesh, placements=[Shard(0)])


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
                                                  live[name].placements, src_data_rank=None)  # fmt: skip
                copy[name] = done[key]


def _barrier(ranks) -> None:
    if ranks is not None and ranks.world > 1:
        dist.barrier()


def save_sharded(run_dir: Path, step: int, state: dict[str, Any], learner, optimizer: torch.optim.Optimizer,
                 ranks, keep: int = 2) -> Path:  # fmt: skip
    """Write checkpoint ``step`` from every rank (a collective); returns its final path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from rollcorr.train.checkpoint import (
        STATE_FILE,
        checkpoint_dir,
        checkpoints_root,
        commit_checkpoint,
        fsync_tree,
        write_manifest,
    )

    final = checkpoint_dir(run_dir, step)
    tmp = final.parent / f".tmp-{final.name}"
    if ranks.is_main:
        checkpoints_root(run_dir, create=True)  # a real folder, never a link (rollcorr.safe_io)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(ranks)
    try:
        model_state, optim_state = get_state_dict(learner.model, optimizer)
        proximal, held = split_held(state.get("proximal"))
        shards = {"model": model_state, "optimizer": optim_state, **({"proximal": held} if held else {})}
        dcp.save(shards, checkpoint_id=str(tmp / DCP_DIR))
        full = learner.full_state_dict()  # rank 0: the HF export
        if ranks.is_main:
            torch.save({**state, "model": SHARDED, "optimizer": SHARDED, "proximal": proximal}, tmp / STATE_FILE)
            learner.inner.model.save_pretrained(tmp / "model", state_dict=full)
            learner.tokenizer.save_pretrained(tmp / "model")
            write_manifest(tmp)  # every rank's dcp/ files are written: dcp.save returned on rank 0
            fsync_tree(tmp)
        _barrier(ranks)
    except BaseException:
        if ranks.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if ranks.is_main:
        commit_checkpoint(run_dir, step, tmp, keep)
    _barrier(ranks)
    return final


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, proximal: Any = None,
                 ranks=None) -> Any:  # fmt: skip
    """Weights and optimizer state from ``path/dcp`` into ``model`` (sharded or not) and ``optimizer``, resharded
    to this run's ranks; returns ``proximal`` (the strategy's state from state.pt) with its held tensors loaded
    (this run's shards with ``ranks``, whole tensors without). Called on every rank; works without a process
    group (one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    target = {"model": model_state, "optimizer": optim_state}
    markers = _markers(proximal)
    if markers:
        target["proximal"] = {m[HELD]: _held_target(m, ranks) for m in markers}  # a tied tensor once
    with warnings.catch_warnings():  # one process reading N ranks' shards is the intent, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, checkpoint_id=str(Path(path) / DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"])
    return _join_held(proximal, target.get("proximal", {}))


def load_full(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
              optim_state: dict[str, Any]) -> None:  # fmt: skip
    """A one-process checkpoint's full weights and ``optimizer.state_dict()`` into a sharded model: every rank
    keeps its shards. The optimizer's parameter ids are renamed to parameter names first (the form
    ``set_optimizer_state_dict`` reads)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=options)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    named = {
        "state": {names[i]: value for i, value in optim_state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in optim_state["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, named, options=options)
