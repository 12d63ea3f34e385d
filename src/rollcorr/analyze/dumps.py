"""Read rollout dumps (JSONL or Parquet, one response per row) into padded (B, T) tensors.

A dump row holds per-token lists for one response: the sampler's log-probs (log μ), the learner's log-probs
(log π_old) and optionally a mask, advantages, token ids, token texts and per-token weight versions::

    {"rollout_log_probs": [-0.1, -2.3], "old_log_probs": [-0.12, -2.1], "response_mask": [1, 1], ...}

Rows that cannot be used (bad JSON, a missing field, lists of different lengths, NaN/inf or positive
log-probs on valid tokens, no valid token) are skipped and reported with their line number; the rest of the
file still counts. When the configured field name is the default and absent from the file, the reader looks
for the names other frameworks use (``FIELD_ALIASES``) and records what it picked in ``Dump.fields``.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# Log-probs in (0, POSITIVE_TOL] are rounding noise of a probability ~1 and are clamped to 0; larger
# positive values are a broken row (a probability above 1).
POSITIVE_TOL = 1e-3

# role -> names tried in order when the default name is absent from the file (first is rollcorr's default).
FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    "rollout": (
        "rollout_log_probs",  # verl, slime, SkyRL
        "rollout_log_prob",  # rollcorr
        "generation_logprobs",  # NeMo-RL
        "sampling_per_token_logps",  # TRL
        "inference_logprobs",  # prime-rl
        "infer_logprobs",
        "rollout_logprobs",
        "logprobs",  # AReaL (the inference engine's log-probs, beside prox_logp)
    ),
    "learner": (
        "old_log_probs",  # verl, slime, SkyRL, OpenRLHF
        "old_log_prob",  # rollcorr
        "prev_logprobs",  # NeMo-RL
        "old_per_token_logps",  # TRL
        "prox_logp",  # AReaL
        "trainer_logprobs",  # prime-rl
    ),
    "mask": ("response_mask", "token_mask", "loss_mask", "completion_mask", "mask"),
    "advantages": ("advantages", "advantage"),
    "tokens": ("responses", "response_ids", "completion_ids", "token_ids"),
    "token_text": ("token_text", "token_texts", "response_tokens_text"),
    "text": ("response_text", "response", "completion"),
    "version": ("version", "versions", "token_versions"),
}

DEFAULT_FIELDS = {role: names[0] for role, names in FIELD_ALIASES.items()}
CORRECTION_FIELD = "correction"  # the CorrectionConfig that produced the row (keys differing from the default)


@dataclass(frozen=True)
class MalformedRow:
    """A skipped row: its 1-based line (JSONL) or row (Parquet) number and why it was skipped."""

    line: int
    reason: str


@dataclass
class Dump:
    """Valid rows of a dump, right-padded to (B, T).

    rollout_log_prob  (B, T) float64, log μ of each response token, 0 on padding
    old_log_prob      (B, T) float64, log π_old (learner) of each response token, 0 on padding
    response_mask     (B, T) bool, True on valid tokens (from the mask field, else from list lengths)
    advantages        (B, T) float64 or None (a scalar per row is broadcast over its tokens)
    tokens            (B, T) int64 response token ids or None
    token_text        per-row lists of per-token strings, or None
    text              per-row response strings, or None
    version           (B, T) int64 weight version per token, or None
    line_numbers      source line (JSONL) / row (Parquet) of each of the B rows, 1-based
    extras            extra field name -> per-row values (None where a row lacks it)
    malformed         skipped rows with line numbers and reasons
    fields            role -> field name actually read ("rollout", "learner", "mask", ...)
    partial           role -> lines lacking a per-token field other rows have (that field is then None)
    correction        the CorrectionConfig keys the writer recorded (``CORRECTION_FIELD``; the keys that differ
                      from ``CorrectionConfig()``), when every row that records one records the same; else None
    corrections_seen  how many different correction configs the rows record (0: none recorded)
    """

    path: Path
    rollout_log_prob: Tensor
    old_log_prob: Tensor
    response_mask: Tensor
    line_numbers: list[int]
    fields: dict[str, str]
    malformed: list[MalformedRow] = field(default_factory=list)
    advantages: Tensor | None = None
    tokens: Tensor | None = None
    token_text: list[list[str]] | None = None
    text: list[str] | None = None
    version: Tensor | None = None
    extras: dict[str, list[Any]] = field(default_factory=dict)
    total_rows: int = 0
    partial: dict[str, list[int]] = field(default_factory=dict)
    correction: dict[str, Any] | None = None
    corrections_seen: int = 0

    def __len__(self) -> int:
        return self.rollout_log_prob.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())

    def to_rollout(self):
        """The dump as a :class:`rollcorr.rollout.Rollout` (float32 log-probs; no prompts, one group per row)."""
        from rollcorr.rollout import Rollout

        b, t = self.rollout_log_prob.shape
        tokens = self.tokens if self.tokens is not None else torch.zeros(b, t, dtype=torch.long)
        version = self.version if self.version is not None else torch.zeros(b, t, dtype=torch.long)
        meta = [{"line": line} for line in self.line_numbers]
        if self.text is not None:
            for m, text in zip(meta, self.text):
                m["response_text"] = text
        return Rollout(
            prompt_ids=torch.zeros(b, 0, dtype=torch.long),
            prompt_mask=torch.zeros(b, 0, dtype=torch.bool),
            response_ids=tokens,
            response_mask=self.response_mask,
            rollout_log_prob=self.rollout_log_prob.float(),
            version=version,
            group_ids=torch.arange(b),
            meta=meta,
            old_log_prob=self.old_log_prob.float(),
            advantages=None if self.advantages is None else self.advantages.float(),
        )


class _BadRow(Exception):
    """Raised while parsing one row; the message is the reason reported to the user."""


def read_dump(
    path: str | Path,
    *,
    rollout_field: str = DEFAULT_FIELDS["rollout"],
    learner_field: str = DEFAULT_FIELDS["learner"],
    mask_field: str = DEFAULT_FIELDS["mask"],
    advantages_field: str = DEFAULT_FIELDS["advantages"],
    tokens_field: str = DEFAULT_FIELDS["tokens"],
    token_text_field: str = DEFAULT_FIELDS["token_text"],
    text_field: str = DEFAULT_FIELDS["text"],
    version_field: str = DEFAULT_FIELDS["version"],
    extra_fields: Sequence[str] = ("prompt", "reward"),
    fields: dict[str, str] | None = None,
) -> Dump:
    """Read a JSONL (``.jsonl``, ``.jsonl.gz``, anything else) or Parquet (``.parquet``/``.pq``) rollout dump.

    ``fields`` maps roles ("rollout", "learner", "mask", "advantages", "tokens", "token_text", "text",
    "version") to names and overrides the keyword arguments. Raises ``FileNotFoundError`` for a missing
    file and ``ValueError`` when no row is usable or a required field is in no row.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a rollout dump")
    if not path.is_file():
        raise FileNotFoundError(f"rollout dump not found: {path}")
    wanted = {
        "rollout": rollout_field,
        "learner": learner_field,
        "mask": mask_field,
        "advantages": advantages_field,
        "tokens": tokens_field,
        "token_text": token_text_field,
        "text": text_field,
        "version": version_field,
    }
    if fields:
        unknown = set(fields) - set(wanted)
        if unknown:
            raise ValueError(f"unknown field role(s) {sorted(unknown)}; roles are {sorted(wanted)}")
        wanted.update(fields)

    rows = list(_iter_rows(path))  # (line, dict or _BadRow)
    if not rows:
        raise ValueError(f"{path}: the dump is empty")

    if all(isinstance(obj, _BadRow) for _, obj in rows):
        raise _all_malformed(path, [MalformedRow(line, str(obj)) for line, obj in rows])
    keys_seen: set[str] = set()
    for _, obj in rows:
        if isinstance(obj, dict):
            keys_seen.update(obj)
    names = {role: _resolve(role, name, keys_seen) for role, name in wanted.items()}
    for role, name in wanted.items():
        if names[role] is None and role not in ("rollout", "learner") and name != DEFAULT_FIELDS[role]:
            raise ValueError(
                f"{path}: no row has the {role} field {name!r}; fields present: {sorted(keys_seen)}"
            )
    for role in ("rollout", "learner"):
        if names[role] is None:
            also = ""
            if wanted[role] == DEFAULT_FIELDS[role]:
                also = f" (nor {', '.join(FIELD_ALIASES[role][1:])})"
            raise ValueError(
                f"{path}: no row has the {role} log-prob field {wanted[role]!r}{also}; fields present: "
                f"{sorted(keys_seen)}. Name it with --{role}-field / {role}_field=."
            )

    parsed: list[dict[str, Any]] = []
    lines: list[int] = []
    malformed: list[MalformedRow] = []
    for line, obj in rows:
        try:
            if isinstance(obj, _BadRow):
                raise obj
            parsed.append(_parse_row(obj, names, extra_fields))
        except _BadRow as err:
            malformed.append(MalformedRow(line, str(err)))
        else:
            lines.append(line)
    if not parsed:
        raise _all_malformed(path, malformed)

    return _assemble(path, parsed, lines, malformed, names, extra_fields, total_rows=len(rows))


def _all_malformed(path: Path, malformed: list[MalformedRow]) -> ValueError:
    shown = "; ".join(f"line {m.line}: {m.reason}" for m in malformed[:5])
    more = " ..." if len(malformed) > 5 else ""
    return ValueError(f"{path}: all {len(malformed)} rows are malformed ({shown}{more})")


def _resolve(role: str, name: str, keys_seen: set[str]) -> str | None:
    """The field name to read for ``role``: ``name`` if present, else (for a default name) a known alias."""
    if name in keys_seen:
        return name
    if name == DEFAULT_FIELDS[role]:
        for alias in FIELD_ALIASES[role]:
            if alias in keys_seen:
                return alias
    return None


def _iter_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield (1-based line or row number, dict or _BadRow). Blank JSONL lines are skipped."""
    suffixes = "".join(path.suffixes[-2:]).lower()
    if path.suffix.lower() in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError(
                f"reading the Parquet dump {path} needs pyarrow: pip install 'rollcorr[parquet]'"
            ) from err
        try:
            table = pq.read_table(path)
        except Exception as err:  # pyarrow's own errors (not a Parquet file, truncated) and OSError
            raise ValueError(f"{path}: cannot read as Parquet ({str(err).splitlines()[0]})") from None
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row
        return
    i = 0
    for raw in _raw_lines(path, gz=suffixes.endswith(".gz")):
        if isinstance(raw, _BadRow):
            yield i + 1, raw
            return
        i += 1
        if i == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
            raw = raw[3:]
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            yield i, _BadRow(f"invalid UTF-8 at byte {err.start}")
            continue
        try:
            obj = json.loads(text.rstrip("\r\n"))
        except json.JSONDecodeError as err:
            yield i, _BadRow(f"bad JSON: {err.msg} (column {err.colno})")
            continue
        except (ValueError, RecursionError) as err:  # e.g. an integer literal with > 4300 digits
            yield i, _BadRow(f"bad JSON: {str(err).splitlines()[0]}")
            continue
        yield (
            i,
            obj if isinstance(obj, dict) else _BadRow(f"expected a JSON object, got {type(obj).__name__}"),
        )


def _raw_lines(path: Path, gz: bool) -> Iterator[bytes | _BadRow]:
    """The file's lines as bytes; a gzip file is inflated chunk by chunk so every line before a truncation or
    corruption is still read (then one ``_BadRow`` says where it broke). Unreadable: one-line ``ValueError``."""
    try:
        f = path.open("rb")
    except OSError as err:
        raise ValueError(f"{path}: cannot read ({err.strerror or err})") from None
    with f:
        if not gz:
            yield from f
            return
        inflate, pending, started = zlib.decompressobj(16 + zlib.MAX_WBITS), b"", False
        while True:
            chunk = f.read(1 << 16)
            try:
                data = inflate.decompress(chunk) if chunk else inflate.flush()
                while inflate.eof and inflate.unused_data:  # a multi-member gzip file (cat a.gz b.gz)
                    rest = inflate.unused_data
                    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    data += inflate.decompress(rest)
            except zlib.error as err:
                if not started:
                    raise ValueError(
                        f"{path}: not a gzip file ({err}); if it is plain JSONL, drop the .gz"
                    ) from None
                yield _BadRow(
                    f"the compressed data is corrupt from here ({err}); the rows before it are read"
                )
                return
            started = True
            pending += data
            *complete, pending = pending.split(b"\n")
            yield from (line + b"\n" for line in complete)
            if not chunk:
                break
        if not inflate.eof:
            yield _BadRow("the compressed file ends early (truncated); the rows before it are read")
        elif pending:
            yield pending


def _number_list(obj: dict[str, Any], name: str) -> list[float]:
    """The field as floats (JSON null → NaN); a non-list or a non-number entry is a bad row."""
    value = obj[name]
    if not isinstance(value, list | tuple) or any(
        not (x is None or isinstance(x, int | float)) or isinstance(x, bool) for x in value
    ):
        raise _BadRow(f"field {name!r} is not a list of numbers")
    try:
        return [math.nan if x is None else float(x) for x in value]
    except OverflowError:
        t = next(t for t, x in enumerate(value) if isinstance(x, int) and abs(x) > 1e308)
        raise _BadRow(f"field {name!r} has a number too large for a float at token {t}") from None


def _typed_list(obj: dict[str, Any], name: str, kind: type, what: str) -> list[Any]:
    value = obj[name]
    if not isinstance(value, list | tuple) or any(
        not isinstance(x, kind) or isinstance(x, bool) for x in value
    ):
        raise _BadRow(f"field {name!r} is not a list of {what}")
    if kind is int:
        for t, x in enumerate(value):
            if not -(2**63) <= x < 2**63:
                raise _BadRow(f"field {name!r} has an integer outside the int64 range at token {t}")
    return list(value)


def _parse_row(
    obj: dict[str, Any], names: dict[str, str | None], extra_fields: Sequence[str]
) -> dict[str, Any]:
    """Validate one row; return its per-token lists (full length, 0 at mask-0 positions) and extras."""
    rollout_name, learner_name, mask_name = names["rollout"], names["learner"], names["mask"]
    for name in (rollout_name, learner_name):
        if name not in obj:
            raise _BadRow(f"missing field {name!r}")
    rollout = _number_list(obj, rollout_name)
    n = len(rollout)

    def same_length(name: str, values: list[Any]) -> list[Any]:
        if len(values) != n:
            raise _BadRow(f"ragged: {rollout_name!r} has {n} tokens but {name!r} has {len(values)}")
        return values

    learner = same_length(learner_name, _number_list(obj, learner_name))
    mask = [True] * n
    if mask_name is not None and obj.get(mask_name) is not None:  # the mask is optional, row by row
        raw = obj[mask_name]
        if not isinstance(raw, list | tuple) or any(x not in (0, 1) for x in raw):
            raise _BadRow(f"field {mask_name!r} must be a list of 0/1 values")
        mask = [bool(x) for x in same_length(mask_name, list(raw))]
    if not any(mask):
        raise _BadRow("empty response (no valid tokens)")

    for name, values in ((rollout_name, rollout), (learner_name, learner)):
        for t, (x, valid) in enumerate(zip(values, mask)):
            if valid and not math.isfinite(x):
                raise _BadRow(f"non-finite {name!r} at token {t} ({x})")
            if valid and x > POSITIVE_TOL:
                raise _BadRow(f"positive log-prob in {name!r} at token {t} ({x:.4g})")
        # padding may hold anything; tiny positives on valid tokens are rounding noise of p ≈ 1
        values[:] = [x if valid and x <= 0 else 0.0 for x, valid in zip(values, mask)]
    row: dict[str, Any] = {"rollout": rollout, "learner": learner, "mask": mask}

    present = {role: names[role] for role in ("advantages", "tokens", "version", "token_text", "text")}
    present = {role: name for role, name in present.items() if name is not None and obj.get(name) is not None}
    if "advantages" in present:  # per token, or one number per row
        name = present["advantages"]
        adv = obj[name]
        try:
            adv = (
                [float(adv)] * n
                if isinstance(adv, int | float) and not isinstance(adv, bool)
                else _number_list(obj, name)
            )
        except OverflowError:  # an integer past float range (JSON allows 10⁴⁰⁰)
            raise _BadRow(f"field {name!r} holds a number too large for a float") from None
        if any(not math.isfinite(a) for a, valid in zip(same_length(name, adv), mask) if valid):
            raise _BadRow(f"non-finite {name!r} on a valid token")
        row["advantages"] = [a if valid else 0.0 for a, valid in zip(adv, mask)]
    for role in ("tokens", "version"):
        if role in present:
            row[role] = same_length(present[role], _typed_list(obj, present[role], int, "integers"))
    if "token_text" in present:
        row["token_text"] = same_length(
            present["token_text"], _typed_list(obj, present["token_text"], str, "strings")
        )
    if "text" in present and isinstance(obj[present["text"]], str):
        row["text"] = obj[present["text"]]
    row["extras"] = {key: obj.get(key) for key in extra_fields}
    if isinstance(obj.get(CORRECTION_FIELD), dict):
        row["correction"] = obj[CORRECTION_FIELD]
    return row


def _assemble(
    path: Path,
    parsed: list[dict[str, Any]],
    lines: list[int],
    malformed: list[MalformedRow],
    names: dict[str, str | None],
    extra_fields: Sequence[str],
    total_rows: int,
) -> Dump:
    b = len(parsed)
    t = max(len(r["rollout"]) for r in parsed)

    def pad(key: str, dtype: torch.dtype) -> Tensor:
        out = torch.zeros(b, t, dtype=dtype)
        for i, r in enumerate(parsed):
            out[i, : len(r[key])] = torch.tensor(r[key], dtype=dtype)
        return out

    def optional(key: str, dtype: torch.dtype) -> Tensor | None:
        # A per-token field is kept only when every valid row has it (otherwise padding would look like data).
        return pad(key, dtype) if all(key in r for r in parsed) else None

    recorded = [r["correction"] for r in parsed if "correction" in r]
    distinct = {json.dumps(c, sort_keys=True) for c in recorded}
    return Dump(
        correction=recorded[0] if len(distinct) == 1 else None,
        corrections_seen=len(distinct),
        path=path,
        rollout_log_prob=pad("rollout", torch.float64),
        old_log_prob=pad("learner", torch.float64),
        response_mask=pad("mask", torch.bool),
        line_numbers=lines,
        fields={role: name for role, name in names.items() if name is not None},
        malformed=malformed,
        advantages=optional("advantages", torch.float64),
        tokens=optional("tokens", torch.long),
        token_text=[r["token_text"] for r in parsed] if all("token_text" in r for r in parsed) else None,
        text=[r["text"] for r in parsed] if all("text" in r for r in parsed) else None,
        version=optional("version", torch.long),
        extras={key: [r["extras"][key] for r in parsed] for key in extra_fields},
        total_rows=total_rows,
        partial={role: [line for line, r in zip(lines, parsed) if role not in r]
                 for role in ("advantages", "tokens", "version") if 0 < sum(role in r for r in parsed) < b},
    )  # fmt: skip


# ---- writing ----------------------------------------------------------------------------------------
def write_dump(
    path: str | Path,
    rollout_log_prob: Tensor,
    old_log_prob: Tensor,
    response_mask: Tensor,
    *,
    advantages: Tensor | None = None,
    tokens: Tensor | None = None,
    version: Tensor | None = None,
    extras: dict[str, Sequence[Any]] | None = None,
    tokenizer: Any = None,
    correction: Any = None,
    append: bool = True,
) -> int:
    """Write a (B, T) right-padded batch as JSONL rows that ``read_dump`` / ``rollcorr analyze`` read.

    One row per response, under rollcorr's default field names (``rollout_log_probs``, ``old_log_probs``,
    ``response_mask`` and, when given, ``advantages`` ((B,) or (B, T)), ``responses`` (token ids),
    ``version``), each list cut after the row's last valid token; ``extras`` maps a field name to one value
    per row (e.g. ``{"step": [3] * B, "reward": rewards}``). With ``tokenizer`` (and ``tokens``) each row also
    gets ``token_text`` (every token decoded alone) and ``response_text`` (the row decoded), so a reader needs
    no tokenizer; with ``correction`` (a ``CorrectionConfig``) each row records under ``correction`` the keys
    that differ from ``CorrectionConfig()``, which ``rollcorr analyze`` applies by default. ``.gz`` paths are
    gzip-compressed. With
    ``append`` the rows are added to an existing file (one file per run), else the file is replaced. The
    rows are encoded first and written in one call, so a bad input leaves the file untouched. Returns the
    number of rows written."""
    path = Path(path)
    shape = tuple(rollout_log_prob.shape)
    if len(shape) != 2:
        raise ValueError(f"rollout_log_prob must be (B, T), got shape {shape}")
    named = {"old_log_prob": old_log_prob, "response_mask": response_mask, "tokens": tokens, "version": version}
    for name, value in named.items():
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")
    if advantages is not None and tuple(advantages.shape) not in (shape, shape[:1]):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected {shape[:1]} or {shape}")
    for name, values in (extras or {}).items():
        if len(values) != shape[0]:
            raise ValueError(f"extras[{name!r}] has {len(values)} values, expected one per row ({shape[0]})")
    if tokenizer is not None and tokens is None:
        raise ValueError("write_dump: tokenizer= decodes the token ids, so tokens= must be given too")
    recorded = None if correction is None else correction_record(correction)
    mask = response_mask.detach().bool().cpu()
    lengths = torch.where(mask.any(-1), shape[1] - mask.flip(-1).int().argmax(-1), 0).tolist()

    def cut(x: Tensor | None, b: int) -> list | None:
        return None if x is None else x[b, : lengths[b]].tolist()

    cpu = {k: None if v is None else v.detach().cpu() for k, v in named.items()}
    roll, adv = rollout_log_prob.detach().double().cpu(), None if advantages is None else advantages.detach().cpu()
    old = cpu["old_log_prob"].double()
    lines = []
    for b in range(shape[0]):
        row: dict[str, Any] = {
            "rollout_log_probs": cut(roll, b),
            "old_log_probs": cut(old, b),
            "response_mask": [int(v) for v in mask[b, : lengths[b]].tolist()],
        }
        if adv is not None:
            row["advantages"] = float(adv[b]) if adv.dim() == 1 else cut(adv.double(), b)
        if cpu["tokens"] is not None:
            row["responses"] = cut(cpu["tokens"], b)
            if tokenizer is not None:
                ids = row["responses"]
                row["token_text"] = list(tokenizer.batch_decode([[i] for i in ids])) if ids else []
                row["response_text"] = tokenizer.decode(ids)
        if recorded is not None:
            row[CORRECTION_FIELD] = recorded
        if cpu["version"] is not None:
            row["version"] = cut(cpu["version"], b)
        for name, values in (extras or {}).items():
            value = values[b]
            row[name] = value.item() if isinstance(value, Tensor) else value
        lines.append(json.dumps(row, allow_nan=False))
    text = "".join(line + "\n" for line in lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    with opener(path, "at" if append else "wt", encoding="utf-8") as f:
        f.write(text)
    return len(lines)



def correction_record(config: Any) -> dict[str, Any]:
    """The keys of a ``CorrectionConfig`` that differ from ``CorrectionConfig()`` (plain JSON data);
    ``CorrectionConfig.from_dict`` of it rebuilds the config."""
    from rollcorr.config.correction import CorrectionConfig

    if not isinstance(config, CorrectionConfig):
        raise ValueError(f"correction must be a CorrectionConfig, got {type(config).__name__}")
    default = CorrectionConfig().to_dict()
    return {k: v for k, v in config.to_dict().items() if v != default[k]}
