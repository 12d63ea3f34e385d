"""Validated rows stored flat (one numpy array per field, offsets per row) and their padding into a ``Dump``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from rollcorr.dumps.format import ROUTED, Dump


# ---- validated rows, stored flat ------------------------------------------------------------------------
@dataclass
class _Rows:
    """Valid rows of one block, flat: row i holds tokens ``starts[i] : starts[i] + n[i]`` of each array.

    Per-token arrays are aligned with ``rollout`` (0 where a row lacks the field, ``has[role]`` says which
    rows have it); ``token_text``, ``text``, ``routed[role]``, ``extras[key]`` and ``correction`` hold one
    Python value per row (None where absent)."""

    lines: np.ndarray  # (R,) int64
    n: np.ndarray  # (R,) int64 list length (valid tokens and mask-0 positions)
    rollout: np.ndarray  # float64, 0 at mask-0 positions
    learner: np.ndarray  # float64, 0 at mask-0 positions
    mask: np.ndarray  # bool
    numeric: dict[str, np.ndarray]  # "advantages" float64 (0 at mask-0), "tokens" / "version" / "turn" int64
    has: dict[str, np.ndarray]  # role -> (R,) bool
    token_text: list
    text: list
    routed: dict[str, list]
    extras: dict[str, list]
    correction: list

    def __len__(self) -> int:
        return len(self.lines)

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.n) - self.n


def _segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Flat indices of the segments ``starts[i] : starts[i] + lengths[i]``, concatenated."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    first = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) + np.repeat(starts - first, lengths)


def _concat_rows(parts: list[_Rows], extra_fields: Sequence[str]) -> _Rows:
    """One ``_Rows`` of several (in the order given)."""
    if len(parts) == 1:
        return parts[0]
    sizes = [int(p.n.sum()) for p in parts]

    def numeric(role: str, dtype) -> np.ndarray:
        return np.concatenate([p.numeric[role] if role in p.numeric else np.zeros(s, dtype)
                               for p, s in zip(parts, sizes)])

    roles = {role for p in parts for role in p.numeric}
    return _Rows(
        lines=np.concatenate([p.lines for p in parts]),
        n=np.concatenate([p.n for p in parts]),
        rollout=np.concatenate([p.rollout for p in parts]),
        learner=np.concatenate([p.learner for p in parts]),
        mask=np.concatenate([p.mask for p in parts]),
        numeric={role: numeric(role, np.float64 if role == "advantages" else np.int64) for role in roles},
        has={role: np.concatenate([p.has[role] for p in parts]) for role in parts[0].has},
        token_text=[x for p in parts for x in p.token_text],
        text=[x for p in parts for x in p.text],
        routed={role: [x for p in parts for x in p.routed[role]] for role in ROUTED},
        extras={key: [x for p in parts for x in p.extras[key]] for key in extra_fields},
        correction=[x for p in parts for x in p.correction],
    )


def _take_rows(rows: _Rows, sel: np.ndarray) -> _Rows:
    """The rows ``sel`` (indices) of ``rows``, flat again."""
    idx = _segments(rows.starts[sel], rows.n[sel])
    pick = sel.tolist()
    return _Rows(
        lines=rows.lines[sel], n=rows.n[sel], rollout=rows.rollout[idx], learner=rows.learner[idx],
        mask=rows.mask[idx], numeric={k: v[idx] for k, v in rows.numeric.items()},
        has={k: v[sel] for k, v in rows.has.items()}, token_text=[rows.token_text[i] for i in pick],
        text=[rows.text[i] for i in pick], routed={k: [v[i] for i in pick] for k, v in rows.routed.items()},
        extras={k: [v[i] for i in pick] for k, v in rows.extras.items()}, correction=[rows.correction[i] for i in pick],
    )


def _pad_index(rows: _Rows, sel: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices into a (len(sel), t) array, flat indices into the rows' arrays) placing rows ``sel``'s
    segments right-padded."""
    lengths = rows.n[sel]
    within = _segments(np.zeros(len(sel), np.int64), lengths)  # the position within each row
    return np.repeat(np.arange(len(sel), dtype=np.int64) * t, lengths) + within, _segments(rows.starts[sel], lengths)


def _as_dump(rows: _Rows, sel: np.ndarray, path: Path, fields: dict[str, str], extra_fields: Sequence[str],
             row_index: np.ndarray | None = None) -> Dump:
    """The rows ``sel`` of ``rows`` as a ``Dump`` padded to their longest row (per-token fields, texts and
    routing kept only when every one of these rows has them)."""
    t = int(rows.n[sel].max())
    pick = sel.tolist()
    dst, src = _pad_index(rows, sel, t)

    def tensor(flat: np.ndarray) -> Tensor:
        out = np.zeros(len(sel) * t, dtype=flat.dtype)
        out[dst] = flat[src]
        return torch.from_numpy(out.reshape(len(sel), t))

    def numeric(role: str) -> Tensor | None:
        if role not in rows.numeric or not rows.has[role][sel].all():
            return None
        return tensor(rows.numeric[role])

    def every(values: list) -> list | None:
        chosen = [values[i] for i in pick]
        return chosen if all(v is not None for v in chosen) else None

    return Dump(
        path=path,
        rollout_log_prob=tensor(rows.rollout),
        learner_log_prob=tensor(rows.learner),
        response_mask=tensor(rows.mask),
        line_numbers=rows.lines[sel].tolist(),
        fields=fields,
        advantages=numeric("advantages"),
        tokens=numeric("tokens"),
        token_text=every(rows.token_text),
        text=every(rows.text),
        version=numeric("version"),
        turn=numeric("turn"),
        routed_experts=_routing_tensor([rows.routed["routed_experts"][i] for i in pick], t),
        learner_routed_experts=_routing_tensor([rows.routed["learner_routed_experts"][i] for i in pick], t),
        extras={key: [rows.extras[key][i] for i in pick] for key in extra_fields},
        row_index=None if row_index is None else torch.from_numpy(np.ascontiguousarray(row_index)),
    )


def _routing_tensor(rows: list, t: int) -> Tensor | None:
    """(B, T, L, k) int64 routed experts when every row has them with one shape, else None."""
    if not rows or any(r is None for r in rows):
        return None
    shapes = {tuple(torch.as_tensor(r).shape[1:]) for r in rows}
    if len(shapes) != 1:
        return None
    out = torch.zeros(len(rows), t, *shapes.pop(), dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r)
    return out


