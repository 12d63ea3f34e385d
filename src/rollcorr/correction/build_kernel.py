"""Build the correction's statistics kernel (csrc/row_pass.cpp, loaded by native.py) ahead of any run:
``python -m rollcorr.correction.build_kernel`` compiles it once per CPU capability this machine has, with the C++
compiler (``$CXX``, else ``c++``) and torch's own headers, libraries and per-capability flags. scripts/setup.sh
runs it; it takes ~20 s a capability. Nothing in a training or correction call ever builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from rollcorr.correction.native import SOURCE, library_path

CAPABILITY_FLAGS = {  # torch's own flags for its kernels of each capability
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}
CPUINFO_FLAGS = {"AVX2": {"avx2", "fma"}, "AVX512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}


def machine_capabilities() -> list[str]:
    """The capabilities this CPU has (``/proc/cpuinfo``), the ones a build makes."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return [cap for cap, need in CPUINFO_FLAGS.items() if need <= flags]


def build(capability: str) -> Path:
    """Compile the kernel for ``capability`` with torch's headers and libraries (seconds to a minute); returns
    its path. Raises ``RuntimeError`` naming the compiler's first error when it fails."""
    from torch.utils import cpp_extension

    out = library_path(capability)
    out.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [
        os.environ.get("CXX", "c++"), "-O3", "-std=c++17", "-shared", "-fPIC", "-DNDEBUG",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}",
        *CAPABILITY_FLAGS[capability], *(f"-I{p}" for p in cpp_extension.include_paths()),
        str(SOURCE), "-o", str(out) + ".tmp",
        *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout or "no output").strip().splitlines() or ["no output"]
        first = next((line for line in lines if "error" in line), lines[-1])
        raise RuntimeError(f"building the {capability} correction kernel failed: {first.strip()}")
    os.replace(str(out) + ".tmp", out)  # a half-written library is never at the loaded name
    return out


def main(argv: list[str]) -> int:
    """``python -m rollcorr.correction.build_kernel``: build the kernel for every capability this CPU has."""
    if argv:
        print("usage: python -m rollcorr.correction.build_kernel", file=sys.stderr)
        return 2
    capabilities = machine_capabilities()
    if not capabilities:
        print("rollcorr: this CPU has neither AVX2 nor AVX512; the correction takes its plain-torch pass")
        return 0
    for capability in capabilities:
        if library_path(capability).exists():  # named by its source and torch: an existing file is this build
            print(f"rollcorr: the {capability} correction kernel is built: {library_path(capability)}")
            continue
        try:
            print(f"rollcorr: built the {capability} correction kernel: {build(capability)}")
        except (RuntimeError, OSError) as err:
            print(f"rollcorr: {err}; the correction takes its plain-torch pass", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
