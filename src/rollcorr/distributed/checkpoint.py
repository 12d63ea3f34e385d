"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), resumable at any number of ranks.

A data-parallel run's ``checkpoints/step_N/`` is today's layout (``train/checkpoint.py``) with the weights and
AdamW state moved into DCP's format:

    state.pt   everything else (step, version, executor, RNG, config, ...), written by rank 0; its "model" and
               "optimizer" entries are the string "dcp"
    dcp/       every rank writes its own shards of the weights and optimizer state (``dcp.save``), plus
               DCP's metadata; loading reshards to whatever N reads it (N=2 → N=1 → N=2)
    model/     the full weights as a Hugging Face directory (gathered once, written by rank 0)

Atomic like one process's: everything goes to ``.tmp-step_N``; rank 0 writes the checksum manifest over all of
it (``dcp/`` included, so ``load_checkpoint`` checks every shard file), fsyncs and renames it
(``train.checkpoint.commit_checkpoint``). A one-process run (no process group) reads ``dcp/`` too: DCP loads
without a group, and a data-parallel run reads a one-process checkpoint's full ``state.pt`` tensors and
shards them (``load_full``).
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
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp / DCP_DIR))
        full = learner.full_state_dict()  # rank 0: the HF export
        if ranks.is_main:
            torch.save({**state, "model": SHARDED, "optimizer": SHARDED}, tmp / STATE_FILE)
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


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Weights and optimizer state from ``path/dcp`` into ``model`` (sharded or not) and ``optimizer``, resharded
    to this run's ranks. Called on every rank; works without a process group (one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    target = {"model": model_state, "optimizer": optim_state}
    with warnings.catch_warnings():  # one process reading N ranks' shards is the intent, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, checkpoint_id=str(Path(path) / DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"])


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
