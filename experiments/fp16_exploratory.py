"""Study 10, exploratory (decided after seeing part A's results, so not a verdict): how much of the MoE model's
fp16-pair k3 one prompt carries, and the bf16/fp16 ratio without it.

Part A's MoE verdict is "not reproduced" (R = 1.5, interval [0.5, 51.9]) while the share of tokens at
|Δp| ≥ 0.01 fell from 20 % to 1.3 %. This reads the per-prompt k3 sums the audits store and asks whether a
single prompt explains the gap; it changes no verdict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments.common import RESULTS

AUDITS = RESULTS / "fp16_study" / "audits"


def largest_prompt(model: str = "builtin-moe", audits: Path = AUDITS) -> dict[str, Any] | None:
    """The fp16 pair's largest per-prompt k3 sum: its index, its share of the pair's k3, and R = k3(bf16) /
    k3(fp16) over all prompts and over the others (that prompt dropped from both pairs). None before the audits."""
    files = {pair: audits / f"{model}_{pair}.json" for pair in ("bf16", "fp16")}
    if not all(f.is_file() for f in files.values()):
        return None
    bf16, fp16 = (json.loads(files[p].read_text()) for p in ("bf16", "fp16"))
    top = max(range(len(fp16["k3_sum"])), key=fp16["k3_sum"].__getitem__)

    def k3(audit: dict, drop: int | None) -> float:
        keep = [i for i in range(len(audit["k3_sum"])) if i != drop]
        return sum(audit["k3_sum"][i] for i in keep) / sum(audit["tokens"][i] for i in keep)

    return {"prompt": top, "prompts": len(fp16["k3_sum"]), "share": fp16["k3_sum"][top] / sum(fp16["k3_sum"]),
            "ratio": k3(bf16, None) / k3(fp16, None), "ratio_without": k3(bf16, top) / k3(fp16, top)}


def paragraph(audits: Path = AUDITS) -> str:
    found = largest_prompt(audits=audits)
    if found is None:
        return "*Exploratory, pending: the MoE audits of part A are not in yet.*"
    return (f"*Exploratory (after seeing part A; no verdict).* On the MoE model one prompt of {found['prompts']} "
            f"carries {found['share']:.0%} of the fp16 pair's k3; without it (dropped from both pairs) "
            f"k3(bf16) / k3(fp16) is {found['ratio_without']:.1f} instead of {found['ratio']:.1f}. The audit stores "
            "per-prompt sums only, so whether that prompt's gap comes from a routed expert that differs between "
            "the two sides is not recorded here.")
