"""The correction's statistics in one read of (B, T): ``rollcorr::row_pass``, a C++ kernel built ahead of any run.

The plain-torch pass (statistics.py) walks a batch in ~25 tensor operations; each reads and writes (B, T)
float slices, so a large batch costs 15–40× one read of its inputs and a small one its operations' fixed costs.
``csrc/row_pass.cpp`` does the same arithmetic in one loop per row, vectorised with ATen's ``Vectorized`` (the
SLEEF vector functions torch's own kernels use for exp, expm1, log1p), and checks the inputs in that same read.

**Built, never compiled at call time.** ``python -m rollcorr.correction.build_kernel`` (run by scripts/setup.sh)
compiles it with the C++ compiler torch's extensions use, once per CPU capability this machine has (AVX2, AVX512),
into ``csrc/build/``, each file named by its capability, the torch version and a hash of the source. A process
loads the one for the capability torch runs with (``ATEN_CPU_CAPABILITY`` included) on its first batch; without
one (not built, a CPU without AVX2, ``ROLLCORR_NATIVE=0``) every batch takes the plain-torch pass, with the same
values to float rounding. It serves contiguous float32 CPU batches with a bool mask; others take plain torch.

Per position the formulas are the plain-torch pass's (statistics.py's docstring); the sums run in float32 lanes
over 256-position chunks, then per row, then in float64 across lanes and rows (the totals).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from torch import Tensor

from rollcorr.correction.metrics import is_band
from rollcorr.correction.ratios import positive_tolerance

SOURCE = Path(__file__).with_name("csrc") / "row_pass.cpp"
BUILD_DIR = SOURCE.parent / "build"
ENV = "ROLLCORR_NATIVE"  # "0": never load the kernel (every batch takes the plain-torch pass)
CAPABILITIES = ("AVX2", "AVX512")  # torch's CPU capabilities the kernel is built for

# The kernel's per-row outputs, in csrc/row_pass.cpp's ``Slot`` order: the sums, then the maxima / minima.
SLOTS = ("n", "bad_old", "bad_rollout", "lr", "lr_c", "k2", "k3", "old", "rollout", "k3_unclamped", "e", "e_sq",
         "e_lr", "js_a", "e_q", "e_abs", "abs", "p_old", "p_rollout", "p_old_sq", "p_rollout_sq", "p_cross", "d",
         "small", "ge0", "ge1", "ge2", "w", "w_sq", "raw", "high", "low", "max_k2", "max_k3", "d_max", "w_max",
         "w_min")
_FLAGS = {"diagnostics": 1, "token_is": 2, "mask_mode": 4, "verl": 8, "lr_c": 16, "k2": 32, "k3": 64}

_state: dict[str, object] = {}  # "loaded": whether the kernel is loaded in this process (decided once)


def library_path(capability: str) -> Path:
    """Where the kernel for ``capability`` ("AVX2", "AVX512") is built: named by the capability, torch's version
    and a hash of the source, so that an edited source or another torch never loads a stale build."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    return BUILD_DIR / f"row_pass-{capability.lower()}-{key}.so"


def loaded() -> bool:
    """Whether the kernel serves this process: loaded on first call, for torch's CPU capability, if built."""
    if "loaded" not in _state:
        _state["loaded"] = _load()
    return bool(_state["loaded"])


def _load() -> bool:
    if os.environ.get(ENV) == "0":
        return False
    capability = torch.backends.cpu.get_cpu_capability().upper()
    if capability not in CAPABILITIES:
        return False
    path = library_path(capability)
    if not path.exists():
        return False
    torch.ops.load_library(str(path))
    return True


def serves(anchor: Tensor, rollout: Tensor, mask_bool: Tensor) -> bool:
    """Whether the kernel takes this batch: built and loaded, contiguous float32 CPU tensors, a bool mask."""
    return (anchor.dtype == rollout.dtype == torch.float32 and mask_bool.dtype == torch.bool
            and anchor.device.type == "cpu" and rollout.device.type == "cpu" and anchor.dim() == 2
            and anchor.is_contiguous() and rollout.is_contiguous() and mask_bool.is_contiguous() and loaded())


def run(anchor: Tensor, rollout: Tensor, mask_bool: Tensor, plan) -> tuple[Tensor, Tensor, Tensor | None]:
    """The kernel on a batch for ``plan`` (``statistics.Plan``): ((slots, B) per-row values in ``SLOTS`` order,
    (slots,) float64 totals, the (B, T) token weights or None)."""
    flags = sum(_FLAGS[k] for k, wanted in _wanted(plan).items() if wanted)
    lower, upper = (plan.token_is[2], plan.token_is[1]) if plan.token_is else (None, None)
    lo, hi = is_band(upper, lower) if plan.token_is else (0.0, 0.0)
    rows, totals, weights = torch.ops.rollcorr.row_pass(
        anchor, rollout, mask_bool, plan.bound, positive_tolerance(anchor.dtype),
        positive_tolerance(rollout.dtype), flags, lower, upper, lo, hi)
    return rows, totals, weights if plan.token_is else None


def _wanted(plan) -> dict[str, bool]:
    """Which of the kernel's optional parts ``plan`` needs, by ``_FLAGS`` name."""
    reductions = plan.reductions
    return {
        "diagnostics": plan.diagnostics, "token_is": plan.token_is is not None,
        "mask_mode": plan.token_is is not None and plan.token_is[0] == "mask", "verl": plan.verl,
        "lr_c": "sum_k1" in reductions, "k2": bool(reductions & {"sum_k2", "max_k2"}),
        "k3": bool(reductions & {"sum_k3", "max_k3"}),
    }
