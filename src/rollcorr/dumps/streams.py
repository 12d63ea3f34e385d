"""Where a dump's bytes come from: a file (plain or gzip), standard input, a FIFO; JSONL lines in blocks."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - a declared dependency; without it the standard library decodes the rows
    orjson = None

from rollcorr.dumps.format import STDIN, _BadRow

READ_BYTES = 1 << 22  # JSONL bytes decoded at a time


# ---- sources: files, standard input, FIFOs -----------------------------------------------------------------
def _open_source(path: str | Path) -> tuple[Path, str, Any, bool]:
    """(the path as reported, "jsonl" | "parquet", a binary stream, gzip?). ``-`` is standard input; a FIFO or
    character device (``<(cat f)``, ``/dev/stdin``) is read as a stream. Parquet (by suffix, or the ``PAR1``
    magic bytes) that is not seekable is copied to a temporary file first (its index sits at the end)."""
    if str(path) == STDIN:
        label, stream = Path(STDIN), _stdin()
        if stream is None:
            raise ValueError("-: standard input is closed, so there is no dump to read; give the dump's path")
    else:
        label = Path(path)
        if label.is_dir():
            raise ValueError(f"{label}: is a directory, not a rollout dump")
        if not label.exists():
            raise FileNotFoundError(f"rollout dump not found: {label}")
        try:
            stream = label.open("rb")
        except OSError as err:
            raise ValueError(f"{label}: cannot read ({err.strerror or err})") from None
    suffix = label.suffix.lower()
    try:
        head = stream.peek(4)[:4]
    except OSError as err:
        raise ValueError(f"{label}: cannot read ({err.strerror or err})") from None
    parquet = suffix in (".parquet", ".pq") or head == b"PAR1"
    if parquet:
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError as err:
            raise ImportError(
                f"reading the Parquet dump {label} needs pyarrow: pip install 'rollcorr[parquet]'"
            ) from err
        if not stream.seekable():
            spool = tempfile.TemporaryFile()
            shutil.copyfileobj(stream, spool, 1 << 20)
            spool.seek(0)
            stream = spool
        return label, "parquet", stream, False
    gz = "".join(label.suffixes[-2:]).lower().endswith(".gz") or head[:2] == b"\x1f\x8b"
    return label, "jsonl", stream, gz


def _stdin() -> Any:
    """Standard input's binary stream; None when the process was started with it closed (``0<&-``)."""
    return getattr(sys.stdin, "buffer", None)


def _jsonl_blocks(stream, gz: bool, path: Path) -> Iterator[list[tuple[int, bytes | _BadRow]]]:
    """Blocks of (1-based line number, raw line or a ``_BadRow`` where a .gz broke); blank lines skipped, a
    leading UTF-8 byte-order mark dropped."""
    line = 0
    for lines in _line_blocks(stream, gz, path):
        if isinstance(lines, _BadRow):
            yield [(line + 1, lines)]
            return
        out = []
        for raw in lines:
            line += 1
            if line == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            if raw and not raw.isspace():
                out.append((line, raw))
        if out:
            yield out


def _line_blocks(stream, gz: bool, path: Path) -> Iterator[list[bytes] | _BadRow]:
    """The stream's lines (without ``\\n``), ``READ_BYTES`` at a time; a gzip stream is inflated chunk by chunk
    so every line before a truncation or corruption is still read (then one ``_BadRow`` says where it broke)."""
    with contextlib.nullcontext(stream) if stream is _stdin() else stream:
        pending: list[bytes] = []

        def split(data: bytes) -> list[bytes]:
            if b"\n" not in data:
                pending.append(data)
                return []
            lines = data.split(b"\n")
            if pending:
                lines[0] = b"".join([*pending, lines[0]])
            pending[:] = [lines.pop()]
            return lines

        try:
            if not gz:
                held: list[bytes] = []  # one block held back, so the last line (no \n) joins the block before it
                while data := stream.read(READ_BYTES):
                    if lines := split(data):
                        if held:
                            yield held
                        held = lines
                if rest := b"".join(pending):
                    held.append(rest)
                if held:
                    yield held
                return
            inflate, started = zlib.decompressobj(16 + zlib.MAX_WBITS), False
            while True:
                chunk = stream.read(max(READ_BYTES // 8, 1 << 12))  # compressed: ~READ_BYTES once inflated
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
                    if lines := split(b""):
                        yield lines
                    yield _BadRow(f"the compressed data is corrupt from here ({err}); the rows before it are read")
                    return
                started = True
                if lines := split(data):
                    yield lines
                if not chunk:
                    break
            if not inflate.eof:
                yield _BadRow("the compressed file ends early (truncated); the rows before it are read")
            elif rest := b"".join(pending):
                yield [rest]
        except OSError as err:
            raise ValueError(f"{path}: cannot read ({err.strerror or err})") from None


def _decode(raw: bytes) -> Any:
    """One JSONL line → a dict or a ``_BadRow`` (orjson; what it refuses, the standard library decides)."""
    if orjson is None:
        obj = _decode_exact(raw)
    else:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = _decode_exact(raw)
    if isinstance(obj, dict | _BadRow):
        return obj
    return _BadRow(f"expected a JSON object, got {type(obj).__name__}")


def _decode_exact(raw: bytes) -> Any:
    """One JSONL line as the standard library reads it (NaN, integers of any size), or a ``_BadRow``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return _BadRow(f"invalid UTF-8 at byte {err.start}")
    try:
        return json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as err:
        return _BadRow(f"bad JSON: {err.msg} (column {err.colno})")
    except (ValueError, RecursionError) as err:  # e.g. an integer literal with > 4300 digits
        return _BadRow(f"bad JSON: {str(err).splitlines()[0]}")


