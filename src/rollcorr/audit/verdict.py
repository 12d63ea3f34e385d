"""The audit's verdict in words: how far apart the engines are against reference levels, and what to do.

Reference levels, the one place their numbers live (the report, the terminal and docs/audit.md use them):

- the built-in model, bf16 and fp16 samplers vs an fp32 learner: pure numerics on a 1 M-parameter model,
  measured with ``rollcorr audit`` (commands and machine below); shown for audits of the built-in model;
- ABEJA's measurement of vLLM vs Hugging Face transformers on Qwen3-4B (both bf16, same weights): the
  published |Δp| shares of what "two engines, same model" looks like at production scale; shown always.

Levels: "same" (float noise), "fp16" (what fp16 numerics leave), "bf16" (up to the bf16 references), "beyond"
(different weights), decided by shares of tokens with bootstrap intervals (``rollcorr.audit.levels``: the
same engines get the same level at 64 or 2,048 responses). The suggested correction per level lives in ``SUGGESTIONS``,
each with the evidence it rests on (the project's own studies, docs/results.md).
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Any

from rollcorr.audit.levels import level_of
from rollcorr.moe import routing_sentence

# |Δp| shares and max, the keys of ``summary["probability"]``
SHARE_KEYS = (
    "prob_diff_frac_lt_1e-3",
    "prob_diff_frac_ge_0.01",
    "prob_diff_frac_ge_0.05",
    "prob_diff_frac_ge_0.1",
)
REFERENCES: dict[str, dict[str, Any]] = {
    "builtin_bf16": {
        "model": "builtin",
        "label": "built-in model, hf:bf16 vs hf:fp32",
        "source": "rollcorr audit --out runs/audit-builtin  (64 responses, 294 tokens; 2-core x86_64, AVX2)",
        "prob_diff_frac_lt_1e-3": 0.548,
        "prob_diff_frac_ge_0.01": 0.095,
        "prob_diff_frac_ge_0.05": 0.0,
        "prob_diff_frac_ge_0.1": 0.0,
        "prob_diff_max": 0.0397,
        "tokens": 294,  # the max is over this many tokens (a max grows with the sample: compared at this count)
    },
    "builtin_fp16": {
        "model": "builtin",
        "label": "built-in model, hf:fp16 vs hf:fp32",
        "source": "rollcorr audit --sampler hf:fp16 --out runs/audit-builtin-fp16  (64 responses, 294 tokens; "
        "2-core x86_64, AVX2)",
        "prob_diff_frac_lt_1e-3": 0.895,
        "prob_diff_frac_ge_0.01": 0.0,
        "prob_diff_frac_ge_0.05": 0.0,
        "prob_diff_frac_ge_0.1": 0.0,
        "prob_diff_max": 0.00408,
        "tokens": 294,
    },
    "abeja_vllm_hf": {
        "model": None,  # a published production-scale level, shown for every model
        "label": "ABEJA: vLLM vs transformers, Qwen3-4B bf16",
        "source": "ABEJA Tech Blog, measurement of vLLM vs Hugging Face token probabilities on Qwen3-4B",
        "prob_diff_frac_lt_1e-3": 0.811,
        "prob_diff_frac_ge_0.01": 0.109,
        "prob_diff_frac_ge_0.05": 0.020,
        "prob_diff_frac_ge_0.1": 0.003,
        "prob_diff_max": 0.215,
        "tokens": None,  # not given by the post: its max is compared with nothing
    },
}
SEQ_ESS_GUARD = 0.9  # sequence ESS below this: long responses' weights spread; guard at sequence level
SEQ_ESS_BROKEN = 0.1  # sequence ESS below this: no reweighting recovers the learner's expectation


# The correction to suggest at each level and the evidence it rests on: one table, updated when a study lands,
# as the project's studies stand (docs/results.md):
# each study named, with its seeds and its test's p-value. At the levels of real engines (bf16, a q4_0 sampler)
# no study has shown a correction to change the final score, so there token TIS is a guard — it keeps every
# token and caps each weight at 2; study 9 showed it score above uncorrected at mismatch several times a q4_0
# sampler's without recovering fp32's score, and study 11 found no alternative above it there (two sequence-level
# rules below it): the evidence says which is which rather than borrowing a repair across levels.
SUGGESTIONS: dict[str, dict[str, str]] = {
    "same": {
        "preset": "disabled",
        "evidence": "the engines agree to float noise: there is nothing to correct",
    },
    "fp16": {
        "preset": "tis",
        "evidence": "almost no token moves by 0.01; token TIS (w = min(ρ, 2)) keeps every token, so as a guard it "
        "costs nothing here",
    },
    "bf16": {
        "preset": "tis",
        "evidence": "study 7 (10 seeds an arm, docs/results.md): uncorrected GRPO with a bf16 sampler ended level "
        "with fp16's (0.631 vs 0.626, Holm p 1) and not below fp32's (0.612) — at this level no correction has a "
        "gap to close there; token TIS is a guard, not a shown repair. Study 6 (3 seeds): token TIS ended above "
        "TRL-style sequence MIS (int8: 0.693 vs 0.665, exact permutation p 0.10)",
    },
    "beyond": {
        "preset": "tis",
        "evidence": "study 7 (10 seeds an arm, q4_0 sampler): uncorrected GRPO ended 0.037 below fp32 at 150 steps "
        "and 0.050 at 300 (Holm p 0.411, 0.124), token TIS 0.016 and 0.025 above uncorrected (Holm p 1, 0.354): "
        "neither harm nor repair reproduced; study 8 (MoE, int8 sampler, 10 seeds): token TIS ended 0.042 below "
        "uncorrected (a secondary comparison, 95 % interval −0.177 to +0.056); study 6 (3 seeds): token TIS above "
        "TRL-style sequence MIS (q4_0: 0.661 vs 0.565, exact permutation p 0.20). Study 9 (samplers with weights "
        "rounded to 4, 3 and 2 bits, 10 seeds an arm): uncorrected GRPO ended 0.028 (not separated), 0.152 and "
        "0.381 below fp32 — below it from 3 bits on (Holm p 2e-05 for the trend) — and token TIS scored 0.064 "
        "above uncorrected over the doses (95 % interval 0.027 to 0.100, Holm p 0.002): 0.619 vs 0.507 at 3 bits "
        "(4.5× q4_0's k3), 0.327 vs 0.278 at 2 bits, 0.661 vs 0.631 at 4 bits. At 2 bits TIS still ended 0.332 "
        "below fp32, with 8 of 10 runs in sustained collapse, as many as uncorrected. So at a q4_0-sized gap TIS "
        "is a guard with no shown benefit; well beyond it, it scores above uncorrected without recovering fp32's "
        "score. Study 11 (2 bits, 15 seeds an arm, exact permutation tests with Holm, docs/correction-study.md): "
        "sequence-level MIS and sequence-level IS + rejection ended below token TIS (0.016 and 0.039 against 0.295, "
        "Holm p 5.2e-08 each); IcePop and removing the mismatch (an hf:rtn2 learner) were not separated from it "
        "(−0.047 and +0.045, 95 % intervals −0.128 to +0.030 and −0.031 to +0.118, Holm p 0.517 each; the tests had "
        "an 80 % chance to detect a difference of 0.148, a smaller one could easily go unseen). There token TIS recovered 5 % of the fp32 − uncorrected gap (95 % "
        "interval −16 % to 25 %), with 12 of 15 runs in sustained collapse. At 3 bits (its secondary block, 10 "
        "seeds an arm, reported, not decided): sequence-level MIS and sequence-level IS + rejection again ended below "
        "token TIS (0.168 and 0.220 against 0.519, permutation p 7.6e-05 and 6.5e-05, 9 and 10 of 10 runs in "
        "sustained collapse against 2); uncorrected GRPO, IcePop and removing the mismatch were not separated from "
        "it (+0.051, −0.024 and +0.079, permutation p 0.29, 0.62 and 0.083)",
    },
}


def references_for(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The reference levels that apply to the audited model: the built-in model's own only for the built-in
    model (``summary["source"]["model"]``), the published ones always."""
    model = str(summary.get("source", {}).get("model", ""))
    return {
        key: ref
        for key, ref in REFERENCES.items()
        if ref["model"] is None or model == ref["model"]
    }


def _shell(parts: list[str]) -> str:
    """One command line from its words, each quoted for a POSIX shell only where it needs it."""
    return " ".join(shlex.quote(str(part)) for part in parts)


def _hf_folder(source: dict[str, Any]) -> str | None:
    """The Hugging Face folder the audited model trains from: ``--model``, or for a ``--gguf-file`` the folder
    ``gguf_command`` converts it into; None for the built-in model or a dump."""
    from rollcorr.models.builtin import BUILTIN_MODELS

    model = source.get("model")
    if not model or model in BUILTIN_MODELS:  # "builtin", "builtin:chain", ...: model.path as it is
        return None
    gguf = source.get("gguf_file")
    return f"models/{Path(gguf).stem}" if gguf else str(model)


def gguf_command(source: dict[str, Any]) -> str | None:
    """``rollcorr gguf-to-hf`` of the audited ``--gguf-file`` into the folder ``override`` trains (``_hf_folder``);
    None when the audit read no GGUF file (training loads a Hugging Face folder, not a GGUF)."""
    if not source.get("gguf_file") or not source.get("model"):
        return None
    return _shell(["rollcorr", "gguf-to-hf", str(Path(source["model"]) / source["gguf_file"]), _hf_folder(source)])


def override(preset_name: str, summary: dict[str, Any] | None = None) -> str:
    """The command line that trains what was audited with a preset, ready to paste (each word shell-quoted):

    - ``--from-run RUN``: the run's own config again (its model, task, chat setting and sampling) into a new
      folder ``RUN-<preset>``, with the audited sampler and learner;
    - a live audit: its model (``--config instruct`` for a model of the user's: its learning rate and reward,
      docs/tasks.md), sampler, learner, prompts file as the task (or the task, environment and reward an audit
      through an environment played), chat setting and sampling temperature, top-k, top-p;
    - a dump (``--from-log``), which names none of these: the preset alone.
    """
    source = (summary or {}).get("source", {})
    engines = [f"model.{key}={source[key]}" for key in ("sampler", "learner") if source.get(key)]
    preset_key = f"algorithm.correction.preset={preset_name}"
    if source.get("run"):
        run = str(source["run"]).rstrip("/")
        return _shell(["rollcorr", "train", "--config", f"{run}/config.yaml", "--out", f"{run}-{preset_name}",
                       *engines, preset_key])
    parts = ["rollcorr", "train"]
    folder = _hf_folder(source)
    if folder:
        parts += ["--config", "instruct", f"model.path={folder}"]
    elif source.get("model") not in (None, "builtin"):  # another built-in model (builtin:chain, builtin:moe)
        parts.append(f"model.path={source['model']}")
    parts += engines
    if source.get("routing_replay"):
        parts.append(f"model.routing_replay={source['routing_replay']}")
    if source.get("prompts_file"):
        parts.append(f"task.name={source['prompts_file']}")
    parts += _played(source, "train")
    if folder or source.get("prompts_file") or source.get("task"):  # the chat template as audited (null would mean: when there is one)
        parts.append(f"task.chat={'true' if source.get('chat_template') else 'false'}")
    temperature = source.get("temperature")  # a greedy audit (0) says nothing the trainer can sample with: its default
    if temperature and (folder or temperature != 1.0):  # instruct's own default is 0.7
        parts.append(f"rollout.temperature={temperature:g}")
    if source.get("top_k"):
        parts.append(f"rollout.top_k={source['top_k']}")
    if source.get("top_p") is not None and source["top_p"] < 1:
        parts.append(f"rollout.top_p={source['top_p']:g}")
    return _shell([*parts, preset_key])


def audit_command(summary: dict[str, Any], *extra: str) -> str | None:
    """The audit as it ran (``summary["source"]``), with ``extra`` words appended — e.g. ``--whatif fp16`` to
    measure a change on the same model, prompts, chat setting, sampling and seed; None for a dump."""
    s = summary.get("source", {})
    if s.get("run"):
        words = ["--from-run", s["run"], *(["--step", str(s["step"])] if s.get("step") is not None else [])]
        words += [word for key in ("sampler", "learner") if s.get(key) for word in (f"--{key}", s[key])]
    elif s.get("sampler"):
        model = s.get("model")
        words = [*(["--model", model] if model and model != "builtin" else []),
                 *(["--gguf-file", s["gguf_file"]] if s.get("gguf_file") else []),
                 "--sampler", s["sampler"], *(["--learner", s["learner"]] if s.get("learner") else []),
                 *(["--prompts", s["prompts_file"]] if s.get("prompts_file") else []), *_played(s, "audit"),
                 *(["--chat"] if s.get("chat_template") else []),
                 *(["--routing-replay", s["routing_replay"]] if s.get("routing_replay") else [])]
    else:
        return None
    for flag, key, default in (("-n", "responses", None), ("--max-new-tokens", "max_new_tokens", None),
                               ("--temperature", "temperature", None), ("--top-k", "top_k", 0),
                               ("--top-p", "top_p", 1.0), ("--seed", "seed", 0),
                               ("--sampler-dist", "sampler_dist", "full")):
        if s.get(key) is not None and s[key] != default:
            words += [flag, f"{s[key]:g}" if isinstance(s[key], float) else str(s[key])]
    return _shell(["rollcorr", "audit", *words, *extra])


def _played(source: dict[str, Any], command: str) -> list[str]:
    """What an audit through an environment played (``--task``, ``--env``, ``--reward``), as ``command`` ("audit"
    or "train") names it; nothing for prompts."""
    if not source.get("task"):
        return []
    env = source.get("environment") or {}
    env = json.dumps(env) if env.get("name") != "(one turn)" else None  # JSON: a YAML mapping both read
    if command == "audit":
        return ["--task", source["task"], *(["--env", env] if env else []),
                *(["--reward", source["reward"]] if source.get("reward") else [])]
    return [f"task.name={source['task']}", *([f"task.env={env}"] if env else []),
            *([f"task.reward={source['reward']}"] if source.get("reward") else []),
            *([f"rollout.max_new_tokens={source['max_new_tokens']}"] if source.get("max_new_tokens") else [])]


def commands(summary: dict[str, Any]) -> list[dict[str, str]]:
    """The commands the verdict points to, each {"label", "command"} — printed whole on a line of its own in the
    terminal and as a code block with a copy button in report.html: the conversion a GGUF model needs before
    training, the one that applies the suggested preset, the one that measures what precision would remove, and,
    after a --localize whose shares were partly estimated, the one that measures every component exactly."""
    out = []
    preset_name = suggestion(summary)
    if preset_name is not None:
        convert = gguf_command(summary.get("source", {}))
        if convert:
            out.append({"label": "Convert the GGUF model for training (once)", "command": convert})
        out.append({"label": "Apply it", "command": override(preset_name, summary)})
    measure = _measure_command(summary)
    if measure:
        out.append({"label": "Measure what an fp16 sampler would leave on this model", "command": measure})
    loc = summary.get("localization", {})
    estimated = any(c.get("method") == "estimate" for c in loc.get("components", []))
    exact = estimated and audit_command(summary, "--localize", str(loc["responses"]), "--localize-exact")
    if exact:
        out.append({"label": "Measure every component's share exactly (each a forward from its layer on)",
                    "command": exact})
    return out


def same_presets(preset_name: str) -> str:
    """" (preset tis is field for field decoupled_token_is — the trainer's default —, skyrl_token_tis)", or ""."""
    from rollcorr.config.presets import PRESETS, preset

    same = [name for name in PRESETS if name != preset_name and preset(name) == preset(preset_name)]
    if not same:
        return ""
    default = "decoupled_token_is"  # train/configs/default.yaml's
    names = ", ".join(f"{n} — the trainer's default —" if n == default else n for n in same)
    return f" (preset {preset_name} is field for field {names})"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def level(summary: dict[str, Any]) -> str:
    """ "same" | "fp16" | "bf16" | "beyond": ``summary["verdict_level"]`` (``rollcorr.audit.levels``), or for a
    summary written before it existed, the same rule on its ``probability`` shares."""
    if "verdict_level" in summary:
        return summary["verdict_level"]["level"]
    p = summary["probability"]
    return level_of({"ge_1e-3": 1.0 - p["prob_diff_frac_lt_1e-3"], "ge_0.01": p["prob_diff_frac_ge_0.01"],
                     "ge_0.05": p["prob_diff_frac_ge_0.05"]})


def _straddle(summary: dict[str, Any]) -> list[str]:
    """A sentence when a share's 95 % interval reaches another level's side of a boundary."""
    vl = summary.get("verdict_level")
    if not vl or not vl["straddles"]:
        return []
    others = " or ".join(f'"{name}"' for name in vl["straddles"])
    return [
        f'The level is "{vl["level"]}", but the 95 % intervals of its shares reach {others} '
        f"({summary['n_responses']} responses): audit more responses (-n) to settle it."
    ]


def _pct(x: float) -> str:
    return f"{100 * x:.2g} %" if x < 0.1 else f"{100 * x:.1f} %"


def reference_token_counts() -> list[int]:
    """The token counts the references' maxima are over (those known), ascending."""
    return sorted({r["tokens"] for r in REFERENCES.values() if r.get("tokens")})


def max_over(summary: dict[str, Any], tokens: int) -> float | None:
    """This audit's median max |Δp| over ``tokens`` tokens (``summary["max_over_tokens"]``, written for each
    reference's token count when the audit's tokens were at hand), or None."""
    value = (summary.get("max_over_tokens") or {}).get(str(tokens))
    return None if value is None else float(value)


def _compare(summary: dict[str, Any], refs_shown: dict[str, dict[str, Any]]) -> str:
    """The audit's shares against the references'; a maximum only where it can be compared — a reference's max
    over its N tokens against this audit's median max over N (``max_over``): a max grows with the sample."""
    p = summary["probability"]
    refs = []
    for r in refs_shown.values():
        text = f"{r['label']}: {_pct(r['prob_diff_frac_ge_0.01'])} and {_pct(r['prob_diff_frac_ge_0.05'])}"
        ours = max_over(summary, r["tokens"]) if r.get("tokens") else None
        if ours is not None:
            text += f", max {r['prob_diff_max']:.3g} over its {r['tokens']} tokens where this audit's is {ours:.3g}"
        refs.append(text)
    return (
        f"{_pct(p['prob_diff_frac_ge_0.01'])} of the sampled tokens move by |Δp| ≥ 0.01 and "
        f"{_pct(p['prob_diff_frac_ge_0.05'])} by ≥ 0.05, max {p['prob_diff_max']:.3g} over "
        f"{_plural(summary['n_tokens'], 'token')} (references — {'; '.join(refs)})."
    )


def suggestion(summary: dict[str, Any]) -> str | None:
    """The preset the verdict suggests (``SUGGESTIONS``), or None when it says to fix the sampler first."""
    where = level(summary)
    if where == "beyond" and summary["divergence"]["ess_seq"] < SEQ_ESS_BROKEN:
        return None
    return SUGGESTIONS[where]["preset"]


def _suggest(where: str, why: str, summary: dict[str, Any]) -> str:
    entry = SUGGESTIONS[where]
    return (
        f"Suggested correction: preset {entry['preset']} ({why}). Evidence: {entry['evidence']}. "
        f"Apply it with the command below{same_presets(entry['preset'])}."
    )


def _sampler_dtype(summary: dict[str, Any]) -> str | None:
    spec = str(summary.get("source", {}).get("sampler", ""))
    return next((d for d in ("bf16", "fp16", "fp32") if f":{d}" in spec), None)


def _precision_sentence(summary: dict[str, Any]) -> str:
    """What an fp16 sampler would leave, for a bf16 sampler: the built-in model's measurement, said to be of
    the built-in model when another one is audited, pointing to the command that measures it on this one."""
    fp16, bf16 = REFERENCES["builtin_fp16"], REFERENCES["builtin_bf16"]
    measured = (
        f"an fp16 sampler left {_pct(fp16['prob_diff_frac_ge_0.01'])} of tokens at |Δp| ≥ 0.01 (max "
        f"{fp16['prob_diff_max']:.3g}) where bf16 left {_pct(bf16['prob_diff_frac_ge_0.01'])} (max "
        f"{bf16['prob_diff_max']:.3g}); fp16 keeps 10 mantissa bits to bf16's 7"
    )
    if summary.get("source", {}).get("model") == "builtin":
        return f"Precision alone would remove most of this gap: on this model (the built-in one) {measured}."
    return (
        f"Precision may remove most of this gap — measured on the project's built-in model, not on this one: "
        f"{measured}. Measure it on this model with the command below (this audit with --whatif fp16)."
    )


def _says_precision(summary: dict[str, Any]) -> bool:
    """Whether the verdict quotes what an fp16 sampler would leave: a bf16-level audit of a bf16 sampler that
    did not measure it itself (--whatif)."""
    return level(summary) == "bf16" and _sampler_dtype(summary) == "bf16" and not summary.get("whatif")


def _measure_command(summary: dict[str, Any]) -> str | None:
    """This audit with ``--whatif fp16`` when the verdict quotes the built-in model's fp16 numbers for another
    model (``_precision_sentence``)."""
    if not _says_precision(summary) or summary.get("source", {}).get("model") == "builtin":
        return None
    return audit_command(summary, "--whatif", "fp16")


WHATIF_WORDS = {"fp16": "an fp16 sampler", "bf16": "a bf16 sampler", "fp32": "the same engine in fp32",
                "lm_head_fp32": "an fp32 lm-head", "batch": "the batch's composition alone"}


def whatif_sentences(summary: dict[str, Any]) -> list[str]:
    """What each ``--whatif`` change left on this model, against the audit's own numbers (measured, not quoted)."""
    rows = summary.get("whatif") or []
    if not rows:
        return []
    p = summary["probability"]
    parts = [f"{WHATIF_WORDS[r['change']]} {'makes' if r['change'] == 'batch' else 'leaves'} "
             f"{_pct(r['prob_diff_frac_ge_0.01'])} of tokens at |Δp| ≥ 0.01 (k3 {r['k3_kl']:.2g}, level "
             f"\"{r['verdict_level']}\")" for r in rows]
    return [f"Measured on this model (--whatif): as audited, {_pct(p['prob_diff_frac_ge_0.01'])} of tokens are at "
            f"|Δp| ≥ 0.01 (k3 {summary['divergence']['k3_kl']:.2g}); " + "; ".join(parts) + "."]


SIZE_AND_CAUSE = {
    "fp16": "as close as fp16 numerics put two engines holding the same model — precision alone keeps the mismatch "
    "this small",
    "bf16": "as far apart as bf16 numerics usually put two engines holding the same model",
    "beyond": "further apart than bf16 numerics put two engines holding the same model — the two sides most likely "
    "hold different weights (quantisation, another checkpoint or tokenizer, a temperature applied on one side only)",
}
SIZE_ONLY = {"fp16": "the size fp16 numerics leave", "bf16": "the size bf16 numerics leave",
             "beyond": "larger than bf16 numerics leave"}


def _size(where: str, summary: dict[str, Any]) -> str:
    """The verdict's first words: the mismatch's size against what numerics leave between two engines holding one
    model, with the usual cause of that size (``SIZE_AND_CAUSE``) — or, when --localize ran, the size alone: the
    cause is what the localisation found (one perturbed tensor in an fp32 sampler is not "bf16 numerics")."""
    if "localization" in summary:
        return (f'The mismatch is {SIZE_ONLY[where]} between two engines holding one model (level "{where}"); '
                "where it comes from is the localisation's finding below, not read from its size: ")
    return f"The engines are {SIZE_AND_CAUSE[where]}: "


def verdict(summary: dict[str, Any]) -> list[str]:
    """A few sentences: how far apart the engines are, the correction the numbers suggest and why (with the
    override that applies it), whether precision alone would remove the gap, and what a negative
    Monte-Carlo estimate means when one appears."""
    p, d = summary["probability"], summary["divergence"]
    ess_tok, ess_seq = d["ess_token"], d["ess_seq"]
    where = level(summary)
    refs = references_for(summary)
    n_tokens = _plural(summary["n_tokens"], "token")
    out = []
    if summary.get("tokens_differing") == 0 and summary["n_tokens"] > 0:
        out.append(
            f"Bit for bit: {'the one token has' if summary['n_tokens'] == 1 else f'all {n_tokens} have'} the same "
            "log-prob in the sampler and the learner (an exact pair), so "
            "every importance weight is exactly 1 and no correction is needed (preset disabled)."
        )
    elif where == "same":
        out.append(
            f"The engines agree to float noise: max |Δp| {p['prob_diff_max']:.2g} over {n_tokens}. No correction "
            "is needed (preset disabled); any mismatch during training comes from staleness, not from the engines."
        )
    elif where == "fp16":
        out.append(_size(where, summary) + _compare(summary, refs))
        out.append(
            _suggest(
                where, f"token ESS/N {ess_tok:.3g}, sequence ESS/N {ess_seq:.3g}: the weights barely spread", summary
            )
        )
    elif where == "bf16":
        out.append(_size(where, summary) + _compare(summary, refs))
        out.append(_suggest(where, f"token ESS/N {ess_tok:.3g}, sequence ESS/N {ess_seq:.3g}; per-token "
                                   "weights capped at 2 keep the variance low even where sequence products spread", summary))
        if _says_precision(summary):
            out.append(_precision_sentence(summary))
    else:
        out.append(_size(where, summary) + _compare(summary, refs))
        if ess_seq < SEQ_ESS_BROKEN:
            out.append(
                f"Fix the sampler before training (a finer quantisation, the same checkpoint): sequence ESS/N "
                f"is {ess_seq:.3g}, so a handful of responses would carry all the weight and no IS or rejection "
                "recovers the learner's expectation from this sample."
            )
        else:
            out.append(_suggest(where, f"token ESS/N {ess_tok:.3g}, sequence ESS/N {ess_seq:.3g}; capping each "
                                       "token's weight keeps rare large ratios from dominating the gradient", summary))
    out += _straddle(summary)
    out += whatif_sentences(summary)
    if "localization" in summary:
        out.append(summary["localization"]["entry"])
    out += routing_sentences(summary)
    negative = [
        name
        for name, key in (
            ("KL k1", "kl"),
            ("reverse KL k1", "policy_kl_k1"),
            ("χ² token", "chi2_token"),
            ("χ² sequence", "chi2_seq"),
        )
        if isinstance(d.get(key), float) and math.isfinite(d[key]) and d[key] < 0
    ]
    if negative:
        out.append(
            f"Some estimates came out negative ({', '.join(negative)}): they are Monte-Carlo estimates over the "
            f"{_plural(summary['n_tokens'], 'sampled token')} (the engines give one log-prob per token, not the whole "
            "vocabulary), unbiased but noisy, so a true value near 0 can be estimated below 0. Read it as "
            '"about zero"; k3 and JS are non-negative by construction.'
        )
    return out


def routing_sentences(summary: dict[str, Any]) -> list[str]:
    """Mixture of experts: the routing finding (``moe.routing_sentence`` of ``summary["routing"]``), or why the
    dump's routing could not be compared (``summary["routing_note"]``)."""
    if summary.get("routing_note"):
        return [f"Mixture of experts: {summary['routing_note']}."]
    text = routing_sentence(summary["routing"]) if summary.get("routing") else None
    return [text] if text else []


def conclude(summary: dict[str, Any]) -> None:
    """Add the verdict to ``summary``: "verdict" (sentences), "commands" (``commands``), "suggested_preset" and
    "suggested_override" (the command that applies it, or None when the verdict says to fix the sampler first)."""
    summary["verdict"] = verdict(summary)
    summary["commands"] = commands(summary)
    preset_name = suggestion(summary)
    summary["suggested_preset"] = preset_name
    summary["suggested_override"] = None if preset_name is None else override(preset_name, summary)
