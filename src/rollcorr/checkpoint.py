"""Atomic checkpoints: everything a killed run needs to continue exactly where it stopped.

``checkpoints/step_000050/`` holds ``state.pt`` (learner weights, optimizer, weight version, executor state —
lagged weight history or async queue —, π_old strategy state, RNG states, loop counters) and ``model/`` (the
learner weights as a Hugging Face directory, loadable on its own). It is written to ``.tmp-step_000050``,
every file and the directory are fsynced, and only then renamed into place (a step saved twice goes through
``.old-step_000050``), so a checkpoint directory either exists complete or not at all. ``recover_checkpoints``
tidies what a kill between those renames leaves behind.

Each checkpoint carries ``manifest.json``: the size and SHA-256 of every file in it, written into the
temporary directory before the rename (so it is as atomic as the checkpoint). ``load_checkpoint`` checks it
(and that every weight is finite) before ``state.pt`` is unpickled; a flipped bit in the newest checkpoint
makes ``load_latest_intact`` fall back to the one before it, with a line saying so. ``checkpoints/`` and its
entries are never followed when they are links (``rollcorr.safe_io``): a planted link is refused, so a run
folder cannot make a save or a prune touch a folder elsewhere.

A run folder is untrusted input (it may come from a colleague or a bucket): ``state.pt`` is read with
``torch.load(weights_only=True)``, which builds tensors, numbers, strings and containers only — plus the one
rollcorr type a checkpoint holds (``Rollout``, the async executor's queued batches). The RNG states are stored
as plain tensors and lists for that reason. A sharded checkpoint's ``dcp/.metadata`` (a pickle that torch's
reader would load with plain ``pickle.load``) goes through ``read_dcp_index``, an unpickler that builds only
DCP's metadata classes, and its non-tensor values (``DataOnlyPlanner``) through ``weights_only`` loads: a
checksum written beside the files would prove nothing, since whoever crafts the folder rewrites it too
(docs/security.md).

The learner's part — its weights and the optimizer's state — is a ``Checkpointer``'s: this module's writes them
into ``state.pt`` (a learner one process holds whole); ``distributed.checkpoint.ShardedCheckpointer`` extends it
for a learner sharded over ranks, whose every rank writes its shards into ``dcp/`` in the format of
``torch.distributed.checkpoint`` (DCP). Either reads both kinds: a checkpoint of N ranks resumes in one process
(``load_sharded``: DCP reads without a process group) and a one-process checkpoint on N ranks. The trainer gets
its checkpointer from its ranks (``Ranks.checkpointer``); this module imports neither the trainer nor the
distributed package.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import stat
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollcorr.engines.lora import is_lora, load_trainable_state_dict, save_adapters, trainable_state_dict
from rollcorr.rollout import Rollout
from rollcorr.safe_io import UnsafePathError, check_inside_dir, describe_os_error, read_bytes_inside

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
STATE_KEYS = ("step", "version", "model", "optimizer", "executor", "proximal", "rng", "loop", "config")
SAFE_TYPES = [Rollout]  # the only non-builtin type a state.pt may contain (queued async batches)
DCP_DIR = "dcp"  # a sharded checkpoint's weights, optimizer state and held π_old tensors (DCP's format)
SHARDED = "dcp"  # the value of state["model"] / state["optimizer"] when the tensors are in dcp/
EXPORT_DIR = "model"  # the learner's weights as a Hugging Face folder (a LoRA learner's: its adapters, PEFT's files)
EXPORTED = "model/"  # the value of state["model"] when the weights are model/'s (a full learner's: saved once)
WEIGHTS_FILE = "model.safetensors"
HELD = "__dcp__"  # a marker dict {HELD: key, "shape", "dtype"} in state.pt where a held DTensor was
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read (truncated, corrupt, or holding code) or written (a full disk)."""


def rng_state() -> dict[str, Any]:
    """torch, Python and NumPy global RNG states as tensors, tuples and lists (safe to load)."""
    name, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [name, key.tolist(), int(pos), int(has_gauss), float(gauss)],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def fsync_path(path: Path) -> None:
    """Flush a file or a directory entry to disk (directories: so a rename survives a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """``folder/manifest.json``: {relative path: {"bytes": n, "sha256": hex}} of every file under it."""
    files = {}
    for dirpath, _dirs, names in os.walk(folder):
        for name in sorted(names):
            path = Path(dirpath) / name
            if path.name != MANIFEST_FILE or path.parent != folder:
                files[path.relative_to(folder).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    (folder / MANIFEST_FILE).write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=1) + "\n")


def checkpoints_root(run_dir: Path, create: bool = False) -> Path | None:
    """``run_dir/checkpoints`` if it is a real folder (``create``: made if missing), else None; a link or a
    file there, or a link among its ``step_*`` entries, is refused (``UnsafePathError``)."""
    root = Path(run_dir) / "checkpoints"
    if not check_inside_dir(root):
        if not create:
            return None
        try:
            root.mkdir()  # never with parents: a run folder removed mid-run is not silently recreated
        except FileNotFoundError:
            raise UnsafePathError(f"{run_dir}: the run folder is gone (removed while the run was going)") from None
    for entry in os.scandir(root):
        if entry.is_symlink():
            raise UnsafePathError(f"{root / entry.name}: is a symbolic link; refused (a run folder's files are "
                                  "never followed out of it); remove it to use this run")
    return root


def save_checkpoint(
    run_dir: Path, step: int, state: dict[str, Any], model=None, tokenizer=None, keep: int = 2,
    export: dict[str, Any] | None = None, write_model: Callable[[Path], Any] | None = None,
) -> Path:
    """Write ``state`` (and the model as an HF directory, with ``export`` as its weights when given; or whatever
    ``write_model(folder)`` writes there) atomically, with its checksum manifest; keep the newest ``keep``.

    On any error the temporary directory is removed again and the older checkpoints stay as they were; a
    write error (a full disk, a file-size limit) is a one-line ``CheckpointError``.
    """
    root = checkpoints_root(run_dir, create=True)
    final = checkpoint_dir(run_dir, step)
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        torch.save(state, tmp / STATE_FILE)
        if write_model is not None:
            write_model(tmp / EXPORT_DIR)
        elif model is not None:
            model.save_pretrained(tmp / EXPORT_DIR, state_dict=export)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / EXPORT_DIR)
        write_manifest(tmp)
        fsync_tree(tmp)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = _write_failure(err)
        if reason is None:
            raise
        kept = [p.name for p in list_checkpoints(run_dir)]
        raise CheckpointError(f"{final}: cannot write the checkpoint ({reason}); nothing was lost: "
                              f"{', '.join(kept) if kept else 'no older checkpoint'} kept as it was, the "
                              "temporary copy removed") from None
    return commit_checkpoint(run_dir, step, tmp, keep)


def commit_checkpoint(run_dir: Path, step: int, tmp: Path, keep: int = 2) -> Path:
    """Rename the complete, fsynced ``tmp`` (manifest included) into ``step_N`` (through ``.old-step_N`` when it
    exists) and keep the newest ``keep`` checkpoints. Shared by one-process and sharded
    (``distributed.checkpoint``) saves."""
    final = checkpoint_dir(run_dir, step)
    if final.exists():
        old = final.parent / f".old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        fsync_path(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
        fsync_path(final.parent)
    for stale in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _write_failure(err: BaseException) -> str | None:
    """A short reason for a failed write (OSError, or torch's "enforce fail at inline_container.cc ... file
    write failed"); None for anything else (a bug: keep its traceback)."""
    if isinstance(err, OSError):
        return describe_os_error(err)
    text = str(err)
    if isinstance(err, RuntimeError) and ("inline_container" in text or "file write failed" in text):
        return "the write failed: no space left on device or a file-size limit?"
    return None


def recover_checkpoints(run_dir: Path) -> list[str]:
    """Tidy ``checkpoints/`` after a kill; returns one message per thing done.

    ``.old-step_N`` is a complete checkpoint renamed aside while step N was saved again: it becomes
    ``step_N`` again when that one is missing, and is removed otherwise. ``.tmp-step_N`` is a save that did
    not finish (or finished after ``.old-step_N`` was made: the older complete copy is kept) and is removed.
    """
    root = checkpoints_root(run_dir)
    if root is None:
        return []
    done = []
    for old in sorted(root.glob(".old-step_*")):
        final = root / old.name.removeprefix(".old-")
        if (final / STATE_FILE).is_file():
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old.name} (superseded by {final.name})")
        else:
            shutil.rmtree(final, ignore_errors=True)
            old.rename(final)
            done.append(f"restored {final.name} from {old.name} (the run was killed while re-saving it)")
    for tmp in sorted(root.glob(".tmp-step_*")):
        shutil.rmtree(tmp, ignore_errors=True)
        done.append(f"removed the unfinished save {tmp.name}")
    if done:
        fsync_path(root)
    return done


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete-looking checkpoints of a run (``step_N/state.pt`` exists), oldest first."""
    root = checkpoints_root(run_dir)
    if root is None:
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def checkpoint_step(path: Path) -> int:
    return int(_STEP_DIR.match(Path(path).name).group(1))


def latest_checkpoint(run_dir: Path) -> Path:
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(
            f"no checkpoint in {str(run_dir)!r} (expected checkpoints/step_*/{STATE_FILE})"
        )
    return found[-1]


def check_manifest(path: Path) -> bool:
    """Check every file in ``path/manifest.json`` (size and SHA-256; links refused); ``CheckpointError``
    naming the first that differs. False when there is no manifest (a checkpoint of an older rollcorr)."""
    manifest_path = Path(path) / MANIFEST_FILE
    if not os.path.lexists(manifest_path):
        return False
    try:
        manifest = json.loads(read_bytes_inside(manifest_path, limit=1 << 20))
        files = manifest["files"]
        assert isinstance(files, dict) and STATE_FILE in files
    except (UnsafePathError, ValueError, KeyError, TypeError, AssertionError):
        raise CheckpointError(f"{manifest_path}: unreadable checksum manifest") from None
    for name, entry in files.items():
        file = Path(path) / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise CheckpointError(f"{manifest_path}: names a file outside the checkpoint ({name!r})")
        try:
            info = os.lstat(file)
        except OSError:
            raise CheckpointError(f"{file}: missing (listed in {MANIFEST_FILE})") from None
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{file}: not a regular file (a link?); refused")
        if info.st_size != entry.get("bytes") or _sha256(file) != entry.get("sha256"):
            raise CheckpointError(f"{file}: checksum mismatch (the file changed or is corrupt since it was "
                                  "saved)")
    return True


def _non_finite_weights(model: Any) -> str | None:
    if not isinstance(model, dict):
        return None
    for name, value in model.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            bad = int((~torch.isfinite(value)).sum())
            if bad:
                return f"{bad} non-finite value(s) in weight {name!r}"
    return None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read ``path/state.pt`` without running code from it, after checking its manifest; ``CheckpointError``
    (one line) if unreadable, corrupt or holding non-finite weights."""
    file = Path(path) / STATE_FILE
    check_manifest(path)
    try:
        data = read_bytes_inside(file)
        with torch.serialization.safe_globals(SAFE_TYPES):
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, bad pickle, a forbidden global, a read error, a link
        text = str(err).strip()
        reason = text.splitlines()[0][:200] if text else type(err).__name__
        if "Weights only load failed" in text:  # torch's safe unpickler met something that is not data
            found = re.search(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)", text)
            detail = text.partition("WeightsUnpickler error:")[2].strip().splitlines()
            reason = (
                f"it calls {found.group(1)!r}" if found else detail[0][:200] if detail else "unsupported content"
            )
            reason = f"refused to load: {reason} (a checkpoint holds only tensors, numbers and strings)"
        raise CheckpointError(f"{file}: {reason}") from None
    missing = [key for key in STATE_KEYS if key not in state] if isinstance(state, dict) else ["step"]
    if missing:
        raise CheckpointError(f"{file}: not a rollcorr checkpoint (no {missing[0]!r} entry)")
    where = file
    if isinstance(state["model"], str) and state["model"] == EXPORTED:  # the weights are model/'s, saved once
        where = Path(path) / EXPORT_DIR
        state["model"] = read_exported(where)
    bad = _non_finite_weights(state["model"])
    if bad:
        raise CheckpointError(f"{where}: {bad}")
    if state["model"] == "dcp":
        check_shard_files(path)
    return state


def read_exported(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint's ``model/`` folder: its safetensors file (or the shards its index names), read
    as data (safetensors holds tensors only); a tied tensor appears once, under the name the model saved it by.
    ``CheckpointError`` naming the file that cannot be read."""
    from safetensors.torch import load as load_safetensors

    index = folder / f"{WEIGHTS_FILE}.index.json"
    try:
        names = sorted(set(json.loads(read_bytes_inside(index, limit=1 << 24))["weight_map"].values())) \
            if os.path.lexists(index) else [WEIGHTS_FILE]
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as err:
        raise CheckpointError(f"{index}: not a safetensors index ({type(err).__name__})") from None
    weights: dict[str, torch.Tensor] = {}
    for name in names:
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise CheckpointError(f"{index}: names a file outside the folder ({name!r})")
        try:
            weights.update(load_safetensors(read_bytes_inside(folder / name)))
        except Exception as err:  # missing, cut short, a link, not safetensors
            raise CheckpointError(f"{folder / name}: unreadable weights ({str(err).strip()[:200] or type(err).__name__})") from None
    return weights


def check_shard_files(path: Path) -> None:
    """A sharded checkpoint's ``dcp/`` is whole by its own index: every file ``dcp/.metadata`` names exists, is a
    regular file and holds the bytes the index points into; ``CheckpointError`` naming the first that is not.
    The manifest checks every byte; this still holds when the manifest is gone (so a missing or cut shard falls
    back to an older checkpoint instead of failing inside ``torch.distributed.checkpoint``)."""
    folder = Path(path) / DCP_DIR
    index = folder / DCP_INDEX
    if not os.path.lexists(index):
        raise CheckpointError(f"{index}: missing (the index of the checkpoint's shards)")
    metadata = read_dcp_index(index)
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = folder / name
        try:
            info = os.lstat(file)
        except OSError:
            raise CheckpointError(f"{file}: missing (a shard named by {DCP_DIR}/.metadata)") from None
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{file}: not a regular file (a link?); refused")
        if info.st_size < end:
            raise CheckpointError(f"{file}: cut short ({info.st_size} bytes; its index reads up to byte {end})")
    for key, info in metadata.storage_data.items():  # the non-tensor values, data only (torch would unpickle them)
        if type(metadata.state_dict_metadata.get(key.fqn)).__name__ == "BytesStorageMetadata":
            with open(folder / info.relative_path, "rb") as f:
                f.seek(info.offset)
                load_dcp_value(f.read(info.length), f"{folder / info.relative_path}: the value of {key.fqn!r}")


# ---------------------------------------------------------------- DCP's files, read without running code

DCP_INDEX = ".metadata"  # DCP's index of a checkpoint's shards: a pickle of its Metadata dataclasses
_DCP = "torch.distributed.checkpoint"
# every global a DCP index of torch 2.13 names (docs/security.md): plain dataclasses, an Enum, torch.Size, a
# layout looked up by name, a path; torch's dtypes (``torch.float32``, ...) are allowed by their type
DCP_INDEX_GLOBALS = frozenset({
    *((f"{_DCP}.metadata", name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
      "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    (f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
})


class _IndexUnpickler(pickle.Unpickler):
    """Python's "restricting globals" unpickler: a global outside ``DCP_INDEX_GLOBALS`` (and not a torch dtype) is
    refused before it is looked up, so nothing but those classes can be built or called."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in DCP_INDEX_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def read_dcp_index(index: Path) -> Any:
    """``dcp/.metadata`` as DCP's ``Metadata``, built by ``_IndexUnpickler`` (no code runs), every shard it points
    into a plain file name of the folder; ``CheckpointError`` naming the file and what is wrong."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _IndexUnpickler(io.BytesIO(read_bytes_inside(index))).load()
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{index}: refused: {err} (a shard index holds only DCP's metadata classes; "
                              "nothing in it was run)") from None
    except Exception as err:  # a cut or foreign index, a link, a read error
        raise CheckpointError(f"{index}: unreadable shard index ({type(err).__name__})") from None
    storage = getattr(metadata, "storage_data", None) if isinstance(metadata, Metadata) else None
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{index}: not a shard index (no storage table)")
    for key, info in storage.items():
        if not isinstance(getattr(key, "fqn", None), str):
            raise CheckpointError(f"{index}: not a shard index (an entry without a name)")
        name = getattr(info, "relative_path", None)
        where = (getattr(info, "offset", None), getattr(info, "length", None))
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise CheckpointError(f"{index}: names a file outside the checkpoint ({name!r})")
        if not all(type(n) is int and n >= 0 for n in where) or getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{index}: a shard entry of {name!r} is not a plain (offset, length)")
    return metadata


def load_dcp_value(data: bytes, where: str) -> Any:
    """A DCP "bytes" item (a value that is not a tensor: an optimizer's lr, betas) by ``torch.load(weights_only=True)``;
    ``CheckpointError`` naming ``where`` when it holds anything but data."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        why = f"it calls {found.group(1)!r}" if found else first
        raise CheckpointError(f"{where}: refused to load: {why} (a checkpoint holds only tensors, numbers and "
                              "strings)") from None


@cache
def _safe_dcp() -> tuple[type, type]:
    """(reader, planner) for ``dcp.load``: torch's own, except that the index is read by ``read_dcp_index`` and a
    non-tensor value (an optimizer's lr, betas: DCP's "bytes" items, which torch loads with ``weights_only=False``)
    is decoded by ``torch.load(weights_only=True)`` first and handed on re-serialised from that data."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class IndexCheckedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_index(Path(self.path) / DCP_INDEX)
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class DataOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            clean = io.BytesIO()
            torch.save(load_dcp_value(value.read(), f"{DCP_DIR}/: the value of {read_item.dest_index.fqn!r}"), clean)
            clean.seek(0)
            super().load_bytes(read_item, clean)

    return IndexCheckedReader, DataOnlyPlanner


def load_latest_intact(run_dir: Path) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """The newest checkpoint that loads: (path, state, one message per newer one skipped and why).

    (None, None, messages) when the run has no readable checkpoint.
    """
    skipped = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            state = load_checkpoint(path)
        except CheckpointError as err:
            skipped.append(f"skipped checkpoint {path.name}: {err}")
            continue
        if not (path / MANIFEST_FILE).is_file():
            skipped.append(f"{path.name}: has no {MANIFEST_FILE} (saved by an older rollcorr): loaded unchecked")
        return path, state, skipped
    return None, None, skipped


# ---------------------------------------------------------------- the learner's part


def _markers(obj: Any) -> list[dict]:
    if isinstance(obj, dict):
        return [obj] if HELD in obj else [m for v in obj.values() for m in _markers(v)]
    return []


def _join_held(obj: Any, loaded: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        return loaded[obj[HELD]] if HELD in obj else {k: _join_held(v, loaded) for k, v in obj.items()}
    return obj


def whole_tensor(marker: dict) -> torch.Tensor:
    """Where DCP loads a held tensor in one process: an empty tensor of its whole shape and dtype."""
    return torch.empty(marker["shape"], dtype=getattr(torch, marker["dtype"]))


def load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, proximal: Any = None,
                 held_target=whole_tensor) -> Any:
    """Weights and optimizer state from ``path/dcp`` (a checkpoint N ranks wrote) into ``model`` (sharded or not)
    and ``optimizer``, resharded to this run's layout; returns ``proximal`` (the π_old strategy's state from
    state.pt) with its held tensors loaded into ``held_target(marker)`` (whole tensors by default; a sharded run's
    shards, ``ShardedCheckpointer.held_target``). Works without a process group (one process)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    target = {"model": model_state, "optimizer": optim_state}
    markers = _markers(proximal)
    if markers:
        target["proximal"] = {m[HELD]: held_target(m) for m in markers}  # a tied tensor once
    with warnings.catch_warnings():  # one process reading N ranks' shards is the intent, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        reader, planner = _safe_dcp()
        dcp.load(target, storage_reader=reader(str(Path(path) / DCP_DIR)), planner=planner())
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"])
    return _join_held(proximal, target.get("proximal", {}))


class Checkpointer:
    """The learner's weights and optimizer state in a run's checkpoints, for a learner this process holds whole:
    both go into ``state.pt`` (a LoRA learner's: its adapters), the weights a sampler takes into ``model/``.

    ``save(run_dir, step, state)`` writes checkpoint ``step`` from the run's ``state`` (everything but the
    learner's tensors); ``load(path, state, proximal)`` puts a loaded checkpoint's weights and optimizer state
    back, and the π_old strategy's state into ``proximal`` (its held weights as this run lays them out).
    """

    def __init__(self, learner, optimizer: torch.optim.Optimizer) -> None:
        self.learner, self.optimizer = learner, optimizer

    def save(self, run_dir: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
        """A full learner's weights go into ``model/`` alone (``state["model"]`` says ``EXPORTED``); a LoRA
        learner's adapters into state.pt and, in PEFT's files, into ``model/`` (the base is the run's model.path)."""
        model, tokenizer = self.learner.model, self.learner.tokenizer
        state = {**state, "optimizer": self.optimizer.state_dict()}
        if is_lora(model):
            state["model"] = trainable_state_dict(model)
            return save_checkpoint(run_dir, step, state, keep=keep,
                                   write_model=lambda folder: save_adapters(model, folder, tokenizer))
        state["model"] = EXPORTED
        return save_checkpoint(run_dir, step, state, model, tokenizer, keep=keep, export=self.learner.state_dict())

    def load(self, path: Path, state: dict[str, Any], proximal) -> None:
        if isinstance(state["model"], str) and state["model"] == SHARDED:  # written by N ranks: resharded to ours
            held = load_sharded(path, self.learner.model, self.optimizer, state["proximal"], self.held_target)
        else:
            weights = state["model"]
            if isinstance(weights, str) and weights == EXPORTED:  # a state.pt read on its own: model/ holds them
                weights = read_exported(Path(path) / EXPORT_DIR)
            self.load_whole(weights, state["optimizer"])
            held = state["proximal"]
        proximal.load_state_dict(held)

    # ---- what a sharded learner's checkpointer changes ---------------------------------------------------
    def load_whole(self, weights: dict[str, torch.Tensor], optim_state: dict[str, Any]) -> None:
        """A one-process checkpoint's weights and ``optimizer.state_dict()``."""
        load_trainable_state_dict(self.learner.model, weights)
        self.optimizer.load_state_dict(optim_state)

    def held_target(self, marker: dict) -> torch.Tensor:
        """Where DCP loads a held tensor of a sharded checkpoint (``load_sharded``)."""
        return whole_tensor(marker)
