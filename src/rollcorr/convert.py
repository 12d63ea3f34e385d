"""``rollcorr gguf-to-hf GGUF OUT_DIR``: save a GGUF model as a Hugging Face folder (to train or audit it).

    rollcorr gguf-to-hf SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2-135m
    rollcorr train model.path=models/smollm2-135m ...

The weights are dequantised to float32 (``rollcorr.engines.gguf.gguf_to_hf``, beside the GGUF writer; ``rollcorr
audit --gguf-file`` calls it too). Errors print one line and exit with status 2 before anything is written.
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "gguf", type=Path, help="the GGUF file (Qwen2 / Llama; Q4_0, Q4_1, Q8_0, K-quants, f16, f32)"
    )
    parser.add_argument("out_dir", type=Path, help="new folder for config.json, model.safetensors, tokenizer")


def run(args: argparse.Namespace) -> int:
    from rollcorr.engines.preflight import PreflightError, check_extra

    try:
        check_extra("gguf")
        if not args.gguf.is_file():
            raise FileNotFoundError(f"{str(args.gguf)!r} does not exist")
        if args.out_dir.exists() and (not args.out_dir.is_dir() or any(args.out_dir.iterdir())):
            raise FileExistsError(
                f"{str(args.out_dir)!r} exists and is not an empty folder; choose a new one"
            )
        from rollcorr.engines.gguf import gguf_to_hf

        out = gguf_to_hf(args.gguf, args.out_dir)
    except (PreflightError, ValueError, OSError) as err:
        print(f"rollcorr gguf-to-hf: error: {err}", file=sys.stderr)
        return 2
    except (IndexError, KeyError, EOFError, struct.error, MemoryError) as err:  # the gguf reader on a cut file
        print(f"rollcorr gguf-to-hf: error: {str(args.gguf)!r} is not a readable GGUF file (truncated or corrupt: "
              f"{type(err).__name__})", file=sys.stderr)
        return 2
    print(f"saved {out} (config.json, model.safetensors, tokenizer); use it as --model / model.path")
    return 0
