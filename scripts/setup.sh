#!/usr/bin/env bash
# Set up rollcorr on a fresh machine: a virtualenv in .venv with the CPU build of torch and the package.
# Extras can be added with ROLLCORR_EXTRAS (comma separated, e.g. ROLLCORR_EXTRAS=dev,parquet,llamacpp).
set -euo pipefail
cd "$(dirname "$0")/.."
python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first, pinned exactly: this is the CPU wheel on local disk (a looser pin pulls a CUDA build).
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[${ROLLCORR_EXTRAS:-dev,parquet}]"
echo "rollcorr is installed in .venv ($(.venv/bin/python -c 'import rollcorr; print(rollcorr.__version__)'))"
