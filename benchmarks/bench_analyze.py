"""Peak memory and speed of ``rollcorr analyze`` on generated dumps of 10^5 … 10^8 tokens, JSONL and Parquet.

    python benchmarks/bench_analyze.py                      # 1e5 1e6 1e7 1e8 tokens → benchmarks/results/bench_analyze.txt
    python benchmarks/bench_analyze.py --sizes 1e5 1e6 --out -          # smaller, printed only
    python benchmarks/bench_analyze.py --read-vs HEAD~2 --sizes 1e5 1e6 1e7     # → benchmarks/results/bench_analyze_read_ab.txt

Each dump is generated streaming into a temporary folder (removed afterwards): rows of 1 … 1000 tokens (uniform),
a learner's log-probs log(U(0.05, 1)) and a sampler's 1 % (Gaussian, σ = 0.01 nat) apart, a mask; JSONL by
orjson, Parquet by pyarrow, a batch of rows at a time. Then, each in a fresh process:

- ``rollcorr analyze FILE`` (default preset): peak RSS (the child's ``ru_maxrss``, by ``/usr/bin/time``), wall time
  (process start to exit, imports included), tokens / s;
- reading only (``open_dump(FILE).chunks()``, timed inside the process, imports excluded): tokens per second of
  wall time and per second of the process's CPU time (the second hardly moves with the machine's load);
- for the JSONL of 10^6 tokens, ``orjson.loads`` of every line alone: the ceiling of JSONL reading here.

and the dump that used to fail: 10^5 one-token rows plus one 10^5-token row (``rollcorr analyze`` and
``rollcorr audit --from-log``). The ratio printed is peak RSS at the largest size over peak RSS at 10^6 tokens
(asked: ≤ 2). The machine (CPU, cores, load average before and after) heads the output; timings depend on it,
memory hardly. Needs about 6.5 GB free in the temporary folder for 10^8 tokens (checked first: the top size is
dropped, and said, when it does not fit).

"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from machine import load, machine  # benchmarks/machine.py (a benchmark runs as a script from its folder)

ROOT = Path(__file__).resolve().parents[1]
BYTES_PER_TOKEN = 65  # JSONL ~45, Parquet ~18, generous
READ_ONLY = """
import sys, time
from rollcorr.dumps import open_dump
t, cpu = time.perf_counter(), time.process_time()
n = sum(int(c.response_mask.numpy().sum()) for c in open_dump(sys.argv[1]).chunks())
print(n, time.perf_counter() - t, time.process_time() - cpu)
"""
ORJSON_ONLY = """
import sys, time, orjson
t = time.perf_counter()
with open(sys.argv[1], "rb") as f:
    for line in f:
        orjson.loads(line)
print(time.perf_counter() - t)
"""


def generate(folder: Path, tokens: int, seed: int = 0, with_jsonl: bool = True) -> tuple[Path, Path, int]:
    """(JSONL, Parquet, rows) of exactly ``tokens`` tokens, written a batch of rows at a time (no JSONL file
    when not ``with_jsonl``)."""
    import numpy as np
    import orjson
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    jsonl, parquet = folder / f"dump_{tokens}.jsonl", folder / f"dump_{tokens}.parquet"
    schema = pa.schema([("rollout_log_probs", pa.list_(pa.float64())), ("old_log_probs", pa.list_(pa.float64())),
                        ("response_mask", pa.list_(pa.int8()))])
    written = rows = 0
    with open(jsonl if with_jsonl else os.devnull, "wb") as f, pq.ParquetWriter(parquet, schema) as w:
        while written < tokens:
            lengths = rng.integers(1, 1001, size=2000)
            ends = written + np.cumsum(lengths)
            lengths = lengths[: int(np.searchsorted(ends, tokens)) + 1]
            lengths[-1] -= max(0, written + int(lengths.sum()) - tokens)
            total = int(lengths.sum())
            old = np.log(rng.uniform(0.05, 1.0, total))
            roll = np.minimum(old + rng.normal(0.0, 0.01, total), 0.0)
            mask = np.ones(total, np.int8)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            opt = orjson.OPT_SERIALIZE_NUMPY
            if with_jsonl:
                f.write(b"".join(orjson.dumps({"rollout_log_probs": roll[a:b], "old_log_probs": old[a:b],
                                               "response_mask": mask[a:b]}, option=opt) + b"\n"
                                 for a, b in zip(offsets[:-1], offsets[1:])))
            w.write_table(pa.table({
                "rollout_log_probs": pa.ListArray.from_arrays(pa.array(offsets), pa.array(roll)),
                "old_log_probs": pa.ListArray.from_arrays(pa.array(offsets), pa.array(old)),
                "response_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
            }, schema=schema))
            written += total
            rows += len(lengths)
    return jsonl, parquet, rows


def pathological(folder: Path) -> Path:
    """10^5 one-token rows and one 10^5-token row (in the middle): padded whole, 10^10 positions."""
    import orjson

    path = folder / "one_long_row.jsonl"
    short = orjson.dumps({"rollout_log_probs": [-0.5], "old_log_probs": [-0.51]}) + b"\n"
    long = orjson.dumps({"rollout_log_probs": [-0.25] * 100_000, "old_log_probs": [-0.2501] * 100_000}) + b"\n"
    with open(path, "wb") as f:
        f.write(short * 50_000 + long + short * 50_000)
    return path


def run_measured(argv: list[str]) -> tuple[float, float, int, str]:
    """(peak RSS in MB, wall seconds, exit status, output) of ``argv`` in a fresh process. The peak is the child's
    ``ru_maxrss`` as ``/usr/bin/time`` reads it (a child forked straight from this process would count this
    process's own memory at the fork: Linux keeps the high-water mark across exec)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report, tempfile.TemporaryFile() as out:
        started = time.perf_counter()
        code = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", report.name, *argv], stdout=out,
                              stderr=subprocess.STDOUT, cwd=ROOT).returncode
        wall = time.perf_counter() - started
        out.seek(0)
        text = out.read().decode(errors="replace")
        kib = int(Path(report.name).read_text().split()[-1])
    return kib / 1024, wall, code, text


def read_vs(rev: str, sizes: list[int], repeats: int, tmp: str | None) -> list[str]:
    """Reading alone (``READ_ONLY``), this checkout's ``src`` against git revision ``rev``'s (``git archive``), in
    fresh processes, ``repeats`` of each interleaved (the order alternating) per dump: median tokens / s and the
    ratio after / before."""
    lines = [f"# bench_analyze --read-vs {rev}: {machine()}; load before {load()}; reading only (open_dump(FILE).chunks(), "
             f"timed inside a fresh process, imports excluded), median of {repeats} per side, interleaved; dumps as "
             f"bench_analyze.py generates them",
             f"format | tokens | before ({rev}) M tokens/s | after (this checkout) M tokens/s | after / before"]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory(dir=tmp, prefix="bench-analyze-") as name:
        folder = Path(name)
        archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder / "before", filter="data")
        envs = {side: {**os.environ, "PYTHONPATH": str(src)}
                for side, src in (("before", folder / "before" / "src"), ("after", ROOT / "src"))}
        for size in sizes:
            jsonl, parquet, _ = generate(folder, size)
            for kind, path in (("jsonl", jsonl), ("parquet", parquet)):
                rates: dict[str, list[float]] = {"before": [], "after": []}
                for r in range(repeats):
                    for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                        done = subprocess.run([sys.executable, "-c", READ_ONLY, str(path)], cwd=folder, env=envs[side],
                                              capture_output=True, text=True, check=True)
                        n, seconds, _ = done.stdout.split()[-3:]
                        rates[side].append(int(n) / float(seconds) / 1e6)
                before, after = statistics.median(rates["before"]), statistics.median(rates["after"])
                lines.append(f"{kind} | {size:.0e} | {before:.2f} | {after:.2f} | {after / before:.2f}")
                print(lines[-1], flush=True)
            jsonl.unlink()
            parquet.unlink()
    lines.append(f"# load after {load()}")
    print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["1e5", "1e6", "1e7", "1e8"], help="dump sizes in tokens")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_analyze.txt"),
                        help="results file ('-': print only)")
    parser.add_argument("--tmp", default=None, help="folder for the generated dumps (default: the system's)")
    parser.add_argument("--no-pathological", action="store_true", help="skip the one-long-row dump")
    parser.add_argument("--repeats", type=int, default=3, help="--read-vs: fresh processes per size and side")
    parser.add_argument("--read-vs", metavar="REV", default=None,
                        help="reading alone, this checkout vs git revision REV, interleaved (default --out: "
                             "benchmarks/results/bench_analyze_read_ab.txt)")
    args = parser.parse_args(argv)
    sizes = sorted(int(float(s)) for s in args.sizes)
    if args.read_vs:
        out = args.out if "--out" in (argv or sys.argv) else str(ROOT / "benchmarks/results/bench_analyze_read_ab.txt")
        lines = read_vs(args.read_vs, sizes, args.repeats, args.tmp)
        if out != "-":
            Path(out).write_text("\n".join(lines) + "\n")
            print(f"wrote {out}")
        return 0
    rollcorr = [sys.executable, "-m", "rollcorr.cli"]
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    with tempfile.TemporaryDirectory(dir=args.tmp, prefix="bench-analyze-") as tmp:
        folder = Path(tmp)
        free = shutil.disk_usage(folder).free
        dropped = [s for s in sizes if s * BYTES_PER_TOKEN > free]
        sizes = [s for s in sizes if s * BYTES_PER_TOKEN <= free]
        say("rollcorr analyze: peak memory and speed (benchmarks/bench_analyze.py)")
        say(f"machine: {machine()}; Python {sys.version.split()[0]}")
        say(f"load average before: {load()}")
        say("dumps: rows of 1-1000 tokens (uniform), float64 log-probs 1 % apart, a mask; default preset "
            "(decoupled_geo_rs_token_tis)")
        if dropped:
            say(f"dropped for lack of disk space ({free / 1e9:.1f} GB free): {', '.join(f'{s:.0e}' for s in dropped)}")
        say()
        header = (f"{'format':<8}{'tokens':>12}{'rows':>9}{'file MB':>10}{'peak RSS MB':>13}{'wall s':>9}"
                  f"{'tokens/s':>11}{'read tokens/s':>15}{'read tokens/CPU s':>19}")
        say(header)
        peaks: dict[tuple[str, int], float] = {}
        reads: dict[tuple[str, int], tuple[float, float]] = {}  # M tokens / s of reading: wall, CPU
        ceiling = None
        for size in sizes:
            jsonl, parquet, rows = generate(folder, size)
            for kind, path in (("jsonl", jsonl), ("parquet", parquet)):
                rss, wall, code, text = run_measured([*rollcorr, "analyze", str(path)])
                if code != 0:
                    say(f"{kind} {size}: rollcorr analyze failed ({code}): {text[-500:]}")
                    continue
                _, _, code, text = run_measured([sys.executable, "-c", READ_ONLY, str(path)])
                n, seconds, cpu = text.split()[-3:]
                peaks[kind, size] = rss
                reads[kind, size] = (int(n) / float(seconds) / 1e6, int(n) / float(cpu) / 1e6)
                say(f"{kind:<8}{size:>12,}{rows:>9,}{path.stat().st_size / 1e6:>10.1f}{rss:>13.0f}{wall:>9.1f}"
                    f"{size / wall / 1e6:>9.2f} M{reads[kind, size][0]:>13.2f} M{reads[kind, size][1]:>17.2f} M")
            if size == 10**6:
                _, _, _, text = run_measured([sys.executable, "-c", ORJSON_ONLY, str(jsonl)])
                ceiling = size / float(text.split()[-1]) / 1e6
            jsonl.unlink()
            parquet.unlink()
        say()
        top = max(sizes)
        if 10**6 in sizes and top > 10**6:
            ratios = ", ".join(f"{kind} {peaks[kind, top] / peaks[kind, 10**6]:.2f}" for kind in ("jsonl", "parquet")
                               if (kind, top) in peaks and (kind, 10**6) in peaks)
            say(f"peak RSS at {top:.0e} tokens / at 1e+06 tokens: {ratios} (asked: <= 2)")
        for kind in ("jsonl", "parquet"):
            big = [size for size in sizes if size >= 10**6 and (kind, size) in reads]
            if big:
                wall, cpu = (min(reads[kind, size][i] for size in big) for i in (0, 1))
                say(f"{kind} reading at >= 1e+06 tokens, the slowest size: {wall:.2f} M tokens/s wall, {cpu:.2f} M "
                    f"per CPU second (asked: >= 5 M)")
        if ceiling is not None:
            say(f"orjson.loads alone on the 1e+06-token JSONL: {ceiling:.2f} M tokens/s (the JSONL ceiling here)")
        if not args.no_pathological:
            path = pathological(folder)
            for name, command in (("analyze", [*rollcorr, "analyze", str(path)]),
                                  ("audit --from-log", [*rollcorr, "audit", "--from-log", str(path), "--out",
                                                        str(folder / "audit")])):
                rss, wall, code, text = run_measured(command)
                status = "ok" if code == 0 else f"exit {code}: {text.strip().splitlines()[-1][:200]}"
                say(f"one long row (100,000 one-token rows + one 100,000-token row, {path.stat().st_size / 1e6:.1f} MB "
                    f"JSONL), {name}: peak RSS {rss:.0f} MB, wall {wall:.1f} s, {status}")
        say(f"load average after: {load()}")
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
