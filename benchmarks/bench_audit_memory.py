"""Peak memory of ``rollcorr audit`` on a GGUF model, against the budget 3 × fp32 weights + the engine's model.

    python benchmarks/bench_audit_memory.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/bench_audit_memory.py --gguf F.gguf --samplers llamacpp:file llamacpp:f32 -n 32

Each sampler spec runs ``rollcorr audit --sampler SPEC --model DIR --gguf-file F -n N --max-new-tokens M``
(the learner is the default hf:fp32) in its own process under ``/usr/bin/time -v`` and reads "Maximum
resident set size" — the peak RSS of the whole audit: dequantising the GGUF into a float32 folder, loading
the learner, the sampler's model, sampling and scoring. ``PYTHONPATH`` decides which rollcorr runs, so the
same script measures a checkout before and after a change.

fp32 weights = Σ numel × 4 B over the GGUF's tensors (tied embeddings once). The engine's own model is
what llama.cpp holds: the GGUF file itself for ``llamacpp:file``, the fp32 size for ``llamacpp:f32``, 8.5 /
32 of it for q8_0 and 4.5 / 32 for q4_0; hf samplers hold another float copy (fp32 size, half for bf16/fp16).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BITS = {"f32": 32, "fp32": 32, "f16": 16, "bf16": 16, "fp16": 16, "q8_0": 8.5, "q4_0": 4.5, "int8": 8}


def fp32_bytes(gguf_file: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_elements) * 4 for t in GGUFReader(gguf_file).tensors)


def engine_bytes(spec: str, gguf_file: Path, fp32: int) -> int:
    backend, _, option = spec.partition(":")
    if backend == "llamacpp" and option == "file":
        return gguf_file.stat().st_size
    return int(fp32 * BITS.get(option or ("q8_0" if backend == "llamacpp" else "fp32"), 32) / 32)


def max_rss(argv: list[str]) -> tuple[int, float, int]:
    """(peak RSS in bytes, wall seconds, exit status) of ``argv`` under /usr/bin/time -v."""
    started = time.perf_counter()
    run = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    kib = re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr)
    if kib is None:
        raise RuntimeError(f"no max RSS in /usr/bin/time output:\n{run.stderr[-2000:]}")
    if run.returncode != 0:
        print(run.stderr[-2000:], file=sys.stderr)
    return int(kib.group(1)) * 1024, seconds, run.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, required=True, help="the GGUF file (its folder is --model)")
    parser.add_argument("--samplers", nargs="+", default=["llamacpp:file", "llamacpp:f32"])
    parser.add_argument("-n", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    gb = 1e9
    fp32 = fp32_bytes(args.gguf)
    print(f"{args.gguf.name}: fp32 weights {fp32 / gb:.2f} GB, file {args.gguf.stat().st_size / gb:.3f} GB")
    print(f"rollcorr from {os.environ.get('PYTHONPATH') or 'the installed package'}; -n {args.n} "
          f"--max-new-tokens {args.max_new_tokens}, {os.cpu_count()} CPUs")
    print("sampler          peak RSS   budget (3×fp32 + engine)   within   wall    status")
    for spec in args.samplers:
        with tempfile.TemporaryDirectory() as out:
            argv = [sys.executable, "-m", "rollcorr.cli", "audit", "--sampler", spec,
                    "--model", str(args.gguf.parent), "--gguf-file", args.gguf.name, "-n", str(args.n),
                    "--max-new-tokens", str(args.max_new_tokens), "--out", out]
            rss, seconds, status = max_rss(argv)
        budget = 3 * fp32 + engine_bytes(spec, args.gguf, fp32)
        print(f"{spec:15s}  {rss / gb:6.2f} GB  {budget / gb:8.2f} GB               "
              f"{'yes' if rss <= budget else 'NO':6s}  {seconds:5.0f} s  {status}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
