"""Apply a correction config to a dump and explain it: what is rejected and why (no rendering here:
``rollcorr.analyze.render`` prints and writes an ``Analysis``).

The dump is processed chunk by chunk (``DumpReader.chunks``: at most ``CHUNK_POSITIONS`` padded positions each;
``analyze(dump)`` takes an in-memory ``Dump`` as one chunk). For each chunk, ``compute_correction`` gives the
weights and the mask, and the config's rules are taken one by one from the list ``compute_correction`` ANDs
(``rollcorr.correction.rejection.rejection_rules``) to say which rule removed which sequence or token, with the
statistic and the threshold; the union of the findings is checked against the mask ``compute_correction``
returned. Nothing of a chunk is kept but what the report needs:

- per row (about 100 bytes): the reductions the metrics read (valid tokens, Σ log π_old, Σ log μ, Σ ℓ, max and
  Σ |Δp|, the IS weight sums) and each sequence rule's statistic and decision;
- per token, only for token-level rules: the statistic shown in the observed p5/p50/p95 (8 bytes a token and
  rule, so those quantiles are exact);
- per finding (a removed or zeroed sequence or token, ~120 bytes); the ``top`` most mismatched tokens.

The metrics are the library's own formulas (``metrics.*_from_sums``, ``rejection.Rule.metrics``,
``metrics.diagnostics_from_sums``) applied once to the per-row values of the whole dump and to
token totals summed chunk by chunk. Batch-level normalisation (``batch_normalize``) divides by the mean weight of
the whole dump: the chunks are corrected without it, the divisor is formed from the whole dump's sums at the
end and the applied weights reported are divided by it then, so nothing depends on the chunking.

What is exact across chunkings: every per-token value (ρ_t, token weights, token rules, veto, the most
mismatched tokens), counts, maxima and minima, quantiles, and the decisions derived from them. Per-row sums
(Π ρ_t, geometric means, k-statistic sums) are torch reductions over a chunk's padded rows, whose summation
order depends on the padded width (as the whole-batch result does on the dump's longest row): they agree to a
few ulps, and a sequence rule's decision can only differ for a statistic that close to its threshold. Token
totals are summed chunk by chunk in float64 (equal to float rounding).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from rollcorr.chunked import one_thread, quantiles, release_memory
from rollcorr.config.correction import CorrectionConfig
from rollcorr.correction import metrics as metric_fns
from rollcorr.correction.ratios import Rows, any_per_row, kl_stats, make_tokens
from rollcorr.correction.rejection import RULES, RSOutcome, RuleOutcome, rejection_rules
from rollcorr.correction.weights import apply_threshold, norm_factor, raw_weights, row_log_weight
from rollcorr.dumps import CHUNK_POSITIONS, Dump, DumpInfo, DumpReader
from rollcorr.moe import routing_add, routing_result, routing_sentence
from rollcorr.turns import TurnStats

# statistic shown for each RS option; K1 statistics are shown as ratios (ρ = exp(−k1)), k3 = ρ − 1 − ℓ
STATISTICS = {
    "token_k1": "ρ_t",
    "seq_sum_k1": "Π ρ_t",
    "seq_mean_k1": "geo-mean ρ",
    "token_k2": "½ℓ_t²",
    "token_k3": "k3_t",
    "seq_sum_k2": "Σ ½ℓ²",
    "seq_sum_k3": "Σ k3",
    "seq_mean_k2": "mean ½ℓ²",
    "seq_mean_k3": "mean k3",
    "seq_max_k2": "max ½ℓ²",
    "seq_max_k3": "max k3",
    "token_binary_kl": "bkl_t",
    "seq_sum_binary_kl": "Σ bkl",
    "seq_mean_binary_kl": "mean bkl",
    "seq_max_binary_kl": "max bkl",
}
TOP_TOKENS = 8  # most mismatched tokens kept by default (``analyze(..., top=)``)
SNIPPET = 25  # characters of a response kept per sequence finding (the report shows 24)
PREFIX = "rollout_corr/"


@dataclass(frozen=True)
class Finding:
    """One sequence or token that a rule removes (rejection) or zeroes (IcePop / Seq-MIS weight mask).

    ``position`` is the token for token rules, and the most mismatched token (largest |ℓ|) of the row for
    sequence rules. ``excess`` ≥ 1 says how far outside the threshold the statistic is (ratio), for ranking.
    ``row`` is the row's place among the dump's valid rows (file order).
    """

    row: int
    line: int
    rule: str
    level: str  # "sequence" | "token"
    position: int
    token: str | None
    statistic: str
    value: float
    threshold: str  # the kept range, e.g. "[0.999, 1.001]" or "≤ 0.01"
    lower: float | None  # its bounds, in the statistic's units (None = unbounded)
    upper: float | None
    excess: float
    tokens: int  # valid tokens removed by this finding
    effect: str  # "rejected" (mask) | "zero weight" (IS mask)


@dataclass(frozen=True)
class RuleSummary:
    """One rule on its own: the range it keeps, what it removes, and the statistic's observed spread
    (5th / 50th / 95th percentile over valid sequences or tokens) to compare the range with."""

    rule: str
    statistic: str
    threshold: str
    level: str
    effect: str
    sequences: int
    tokens: int
    observed: tuple[float, float, float]


@dataclass(frozen=True)
class TokenRow:
    """One of the most mismatched tokens: where it is (its text when every row has token texts, else its id
    when every row has ids), the two log-probs, and what the config does with it."""

    line: int
    position: int
    token_text: str | None
    token_id: int | None
    rollout_log_prob: float
    learner_log_prob: float
    fate: str


class FindingTable(Sequence):
    """Every finding, stored column by column (a ``Sequence`` of ``Finding``): rule order, then file order."""

    def __init__(self, meta: list[dict], cols: dict[str, np.ndarray], labels: list, snippets: list) -> None:
        self._meta, self._cols, self._labels, self._snippets = meta, cols, labels, snippets

    def __len__(self) -> int:
        return len(self._cols["row"])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        c, m = self._cols, self._meta[int(self._cols["rule"][i])]
        return Finding(row=int(c["row"][i]), line=int(c["line"][i]), rule=m["rule"], level=m["level"],
                       position=int(c["position"][i]), token=self._labels[i], statistic=m["statistic"],
                       value=float(c["value"][i]), threshold=m["threshold"], lower=m["lower"], upper=m["upper"],
                       excess=float(c["excess"][i]), tokens=int(c["tokens"][i]), effect=m["effect"])

    def levels(self) -> np.ndarray:
        """(N,) the level of each finding: True for sequence findings."""
        return np.array([m["level"] == "sequence" for m in self._meta], bool)[self._cols["rule"]]

    def ranked(self, level: str, top: int) -> tuple[list[Finding], list[str | None], int]:
        """The ``top`` findings of a level furthest outside their range (ties: by line), their response snippets
        (sequence findings), and how many findings that level has."""
        sel = np.flatnonzero(self.levels() == (level == "sequence"))
        order = sel[np.lexsort((self._cols["line"][sel], -self._cols["excess"][sel]))][:top]
        return [self[int(i)] for i in order], [self._snippets[int(i)] for i in order], len(sel)

    def by_excess(self) -> Iterator[Finding]:
        """Every finding, furthest outside its range first (ties in rule then file order)."""
        for i in np.argsort(-self._cols["excess"], kind="stable"):
            yield self[int(i)]


@dataclass
class Analysis:
    """A dump with a config applied: the metrics (floats), the findings and per-rule summaries that explain
    them, the most mismatched tokens, counts, the applied weights' mean / min / max, and notes (stand-ins used,
    warnings). ``dump`` is the ``Dump`` given to ``analyze`` or the ``DumpInfo`` of a dump read chunk by chunk;
    ``is_weights`` / ``kept_mask`` ((B, T), the applied weights and the mask after rejection) only for the former."""

    dump: Dump | DumpInfo
    config: CorrectionConfig
    source: str
    metrics: dict[str, float]
    is_weights: Tensor | None
    kept_mask: Tensor | None
    findings: FindingTable
    rules: list[RuleSummary]
    notes: list[str] = field(default_factory=list)
    responses: int = 0
    tokens: int = 0
    rejected_tokens: int = 0
    rejected_sequences: int = 0
    weights: tuple[float, float, float] | None = None  # applied weights over valid tokens: mean, min, max
    top_tokens: list[TokenRow] = field(default_factory=list)
    # multi-turn dumps: the mismatch and the correction per turn and by place in the turn (rollcorr.turns; the
    # share of each turn's tokens rejected, its mean applied weight), None when no row has a second turn
    turns: dict | None = None


ALL_REJECTED = (
    "the correction rejects every token of this dump ({tokens} tokens in {seqs} sequences): a training step "
    "on it would have a zero loss and an exactly-zero gradient. Its thresholds are tighter than this "
    "mismatch; widen them or choose a looser preset (docs/configuration.md, Presets)."
)


def analyze(dump: Dump, config: CorrectionConfig, source: str = "", *, top: int = TOP_TOKENS) -> Analysis:
    """Run the correction on an in-memory dump (one chunk) and explain every rejection and zeroed weight;
    ``top``: how many of the most mismatched tokens to keep. The result also holds the (B, T) applied weights
    and mask."""
    engine = _Engine(config, source, _info_of(dump), top=top, keep_tensors=True)
    engine.check_start()
    with one_thread():
        engine.feed(dump)
        return engine.finish(dump)


def analyze_reader(reader: DumpReader, config: CorrectionConfig, source: str = "", *, top: int = TOP_TOKENS,
                   positions: int | None = None) -> Analysis:
    """Run the correction on a dump read chunk by chunk (``open_dump``): memory is one chunk plus the
    per-row, per-finding (and, for token rules, per-token) values listed in the module docstring. Raises
    ``ValueError`` for what only the whole dump can say (OPSM rows without advantages, rows recording
    different corrections when the config is the recorded one is checked by the caller with ``info()``)."""
    engine = _Engine(config, source, None, top=top)
    engine.check_start(reader.fields)
    with one_thread():
        for i, chunk in enumerate(reader.chunks(positions or CHUNK_POSITIONS)):
            engine.feed(chunk)
            if i % 16 == 15:
                release_memory()
        info = reader.info()
        engine.info = info
        return engine.finish(info)


def explain(dump: Dump, config: CorrectionConfig, weights: Tensor | None = None):
    """(findings, per-rule summaries) of ``analyze(dump, config)``."""
    analysis = analyze(dump, config)
    return analysis.findings, analysis.rules


def _info_of(dump: Dump) -> DumpInfo:
    """The ``DumpInfo`` of an in-memory dump."""
    complete = {
        "advantages": dump.advantages is not None, "tokens": dump.tokens is not None,
        "version": dump.version is not None, "token_text": dump.token_text is not None,
        "text": dump.text is not None, "routed_experts": dump.routed_experts is not None,
        "learner_routed_experts": dump.learner_routed_experts is not None, "turn": dump.turn is not None,
    }
    return DumpInfo(path=dump.path, fields=dump.fields, malformed=dump.malformed, total_rows=dump.total_rows,
                    rows=len(dump), num_tokens=dump.num_tokens, partial=dump.partial, correction=dump.correction,
                    corrections_seen=dump.corrections_seen, complete=complete)


def fmt(x: float) -> str:
    """A number as shown in reports: 4 significant digits (ints as they are)."""
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def exp_or_inf(x: float) -> float:
    """math.exp that gives inf instead of raising for x > 709 (vLLM writes -9999.0 for a -inf log-prob)."""
    return math.exp(x) if x < 709.0 else math.inf


def kept_range(lo: float | None, hi: float | None) -> str:
    """The range a rule keeps, as text: "≤ hi", "≥ lo" or "[lo, hi]"."""
    if lo is None or lo == 0:
        return f"≤ {fmt(hi)}"
    if hi is None or math.isinf(hi):
        return f"≥ {fmt(lo)}"
    return f"[{fmt(lo)}, {fmt(hi)}]"


def _outside(value: np.ndarray, lo: float | None, hi: float | None) -> np.ndarray:
    """How far each ``value`` lies outside [lo, hi] as a ratio (≥ 1 when outside; inf for a zero value)."""
    value = np.asarray(value, np.float64)
    out = np.ones_like(value)
    with np.errstate(divide="ignore", invalid="ignore"):
        if hi is not None and hi > 0:
            out = np.where(value > hi, value / hi, out)
        if lo is not None and lo > 0:
            out = np.where(value < lo, np.where(value > 0, lo / value, math.inf), out)
    return out


# ---- the engine -----------------------------------------------------------------------------------------
TOTALS = ("sum_k3", "rho2", "policy_kl", "js", "e_abs", "abs", "p_old_sum", "p_rollout_sum", "p_old_sq_sum",
          "p_rollout_sq_sum", "p_cross_sum", "small_diff_count", "ge0", "ge1", "ge2")
PER_ROW = ("n", "old", "rollout", "lr", "d_max", "d_sum")  # the reductions kept per row
TOKEN_IS_TOTALS = ("w_sq", "high", "low", "oob")


class _Engine:
    """Consumes chunks (``feed``) and sums up the analysis (``finish``); see the module docstring."""

    def __init__(self, config: CorrectionConfig, source: str, info: DumpInfo | None, *, top: int,
                 keep_tensors: bool = False) -> None:
        self.config, self.source, self.info, self.top = config, source, info, max(int(top), 0)
        self.run_config = dataclasses.replace(config, batch_normalize=False)  # normalised once, at the end
        self.keep_tensors = keep_tensors
        self.next_row = 0
        self.rows: dict[str, list[np.ndarray]] = {k: [] for k in ("index", *PER_ROW, "w_sum", "raw")}
        self.tot: dict[str, float] = {k: 0.0 for k in (*TOTALS, *TOKEN_IS_TOTALS, "k3_unclamped")}
        self.w_max, self.w_min = -math.inf, math.inf
        self.rule_state: list[dict] = []  # per rule outcome (config order): metrics accumulators
        self.summaries: list[dict] = []  # per explained rule: RuleSummary fields and observed values
        self.finds: list[dict] = []  # per chunk and rule: finding columns
        self.labels: list = []
        self.snippets: list = []
        self.any_rule = False
        self.kept_tokens = self.rejected_tokens = self.kept_rows = self.rejected_rows = 0
        self.explained_tokens = self.mask_rejected = 0
        self.explained_ok = True
        self.applied = [0.0, math.inf, -math.inf]  # Σ w, min w, max w over valid tokens (before normalisation)
        self.version = [0, None, None]  # Σ version, min, max over valid tokens
        self.routing: dict | None = None
        self.candidates: list[tuple] = []  # the most mismatched tokens so far
        self.missing_advantages = False
        self.chunks = 0
        self.tensors: tuple[Tensor, Tensor | None] | None = None
        self.turns = TurnStats(extra={"rejected_share": "rejected", "weight_mean": "weight"})

    def check_start(self, fields: dict[str, str] | None = None) -> None:
        """What can be said before any row: OPSM on a dump without an advantages field."""
        fields = fields if fields is not None else (self.info.fields if self.info else {})
        if self.config.opsm_delta is not None and "advantages" not in fields:
            raise ValueError(
                "the config uses OPSM (opsm_delta), which needs advantages, but the dump has no "
                f"{fields.get('advantages', 'advantages')!r} field (name it with --advantages-field)"
            )

    # -- one chunk -----------------------------------------------------------------------------------------
    def feed(self, chunk: Dump) -> None:
        """Correct one chunk (weights and mask as ``compute_correction`` forms them: the same functions, rule
        list and statistics), explain it, and add what the report needs to the running sums."""
        config = self.config
        b, t = chunk.response_mask.shape
        index = (chunk.row_index.numpy() if chunk.row_index is not None
                 else np.arange(self.next_row, self.next_row + b, dtype=np.int64))
        self.next_row += b
        self.chunks += 1
        if config.opsm_delta is not None and chunk.advantages is None:
            self.missing_advantages = True  # said at the end, with every row lacking them
        if self.missing_advantages:
            return
        if config.sampler_distribution == "full":
            raise ValueError("sampler_distribution='full' needs log_kept_mass (log of the top-k/top-p kept mass), "
                             "which a dump does not hold")
        mask = chunk.response_mask
        learner, rollout = chunk.learner_log_prob, chunk.rollout_log_prob
        tok = make_tokens(learner, rollout, mask, bound=config.safety_bound, verl=config.verl_compat)
        k3 = kl_stats(tok, "k3")
        raw = w = row_log = None
        if config.is_level is not None:
            raw, row_log = raw_weights(tok, config.is_level, config.safety_bound)
            w = apply_threshold(raw, tok.mask_f, config.is_mode, config.is_upper, config.is_lower)
        applied = w if config.applies_weights else None
        outcomes = rejection_rules(config, tok, k3=k3, log_prob=learner if config.mode == "bypass" else None,
                                   advantages=chunk.advantages)
        keep = torch.ones_like(tok.mask)
        for o in outcomes:  # compute_correction's AND of every rule's keep
            keep &= o.token_keep if o.token_keep is not None else o.row_keep[:, None]
        kept = tok.mask & keep
        self._sums(chunk, index, tok, k3, raw, w)
        self._rule_sums(outcomes, tok)
        findings = self._explain(chunk, index, tok, outcomes, w)
        valid = tok.mask
        lost = valid & ~kept
        n_kept = int(torch.count_nonzero(kept))
        self.any_rule = self.any_rule or bool(outcomes)
        self.kept_tokens += n_kept
        self.kept_rows += int(torch.count_nonzero(any_per_row(kept)))
        self.rejected_tokens += int(tok.num_tokens) - n_kept
        self.rejected_rows += int(torch.count_nonzero(any_per_row(lost)))
        explained = torch.zeros_like(lost)  # the union of the findings against the mask
        for f in findings:
            if f["effect"] != "rejected" or not len(f["local"]):
                continue
            if f["level"] == "token":
                explained[torch.from_numpy(f["local"]), torch.from_numpy(f["position"])] = True
            else:
                explained[torch.from_numpy(f["local"])] = valid[torch.from_numpy(f["local"])]
        self.explained_tokens += int(explained.sum())
        self.mask_rejected += int(lost.sum())
        self.explained_ok = self.explained_ok and torch.equal(explained, lost)
        if applied is not None:
            self.applied[0] += float(applied.sum())  # 0 on padding
            self.applied[1] = min(self.applied[1], float(tok.valid_min(applied)))
            self.applied[2] = max(self.applied[2], float(tok.valid_max(applied)))
        if chunk.version is not None:
            v = chunk.version[valid]
            self.version[0] += int(v.sum())
            lo, hi = int(v.min()), int(v.max())
            self.version[1] = lo if self.version[1] is None else min(self.version[1], lo)
            self.version[2] = hi if self.version[2] is None else max(self.version[2], hi)
        if chunk.routed_experts is not None and chunk.learner_routed_experts is not None:
            self._routing_sums(chunk)
        self._top_tokens(chunk, index, tok, findings, applied)
        per_token = {"rejected": lost.double(), **({"weight": applied} if applied is not None else {})}
        self.turns.feed(rollout, learner, valid, chunk.turn, per_token)
        if self.keep_tensors:
            out_mask = mask & keep if mask.dtype == torch.bool else (mask * keep).to(mask.dtype)
            self.tensors = (out_mask, applied)

    def _sums(self, chunk: Dump, index: np.ndarray, tok, k3: Tensor, raw: Tensor | None, w: Tensor | None) -> None:
        """The reductions the diagnostics and IS metrics read, as the eager ``offpolicy_metrics``,
        ``divergence_metrics``, ``prob_mismatch`` and ``is_metrics`` form them: per row what they read per row,
        totals of the rest (padding's known contribution removed)."""
        c = self.config
        pad = float(tok.num_pad)
        lr, lrs, rho = tok.log_ratio, tok.log_ratio_safe, tok.ratio
        self.rows["index"].append(index)
        row = {"n": tok.n, "old": tok.anchor.sum(dim=-1), "rollout": tok.rollout.sum(dim=-1), "lr": lr.sum(dim=-1)}
        tot = self.tot
        tot["sum_k3"] += float(k3.sum())
        if c.verl_compat:
            tot["k3_unclamped"] += float(lr.exp().sub_(lr).sub_(1.0).sum())
            tot["rho2"] += float(torch.where(tok.mask, rho.square(), 0.0).sum())
        else:
            tot["rho2"] += float(torch.dot(rho.reshape(-1), rho.reshape(-1))) - pad
        rho_lr = rho * lrs
        tot["policy_kl"] += float(torch.sub(rho_lr, rho).add_(1.0).sum())
        js = torch.nn.functional.softplus(lrs).sub_(math.log(2.0)).mul_(rho + 1.0)
        tot["js"] += float(torch.sub(rho_lr, js, out=js).mul_(0.5).sum())
        tot["e_abs"] += float(torch.maximum(rho, torch.reciprocal(rho)).sub_(1.0).sum())
        tot["abs"] += float(lrs.abs().sum())
        a, bb = tok.anchor.exp(), tok.rollout.exp()  # 1 on padding
        dot = lambda x, y: float(torch.dot(x.reshape(-1), y.reshape(-1)))  # noqa: E731
        tot["p_old_sum"] += float(a.sum()) - pad
        tot["p_rollout_sum"] += float(bb.sum()) - pad
        tot["p_old_sq_sum"] += dot(a, a) - pad
        tot["p_rollout_sq_sum"] += dot(bb, bb) - pad
        tot["p_cross_sum"] += dot(a, bb) - pad
        d = a.sub_(bb).abs_()  # |Δp|, 0 on padding
        row["d_max"], row["d_sum"] = d.amax(dim=-1), d.sum(dim=-1)
        tot["small_diff_count"] += float(torch.count_nonzero(d < 1e-3)) - pad
        for i, threshold in enumerate(metric_fns.PROB_SHARES):
            tot[f"ge{i}"] += float(torch.count_nonzero(d >= threshold))
        for k in PER_ROW:
            self.rows[k].append(row[k].numpy())
        if raw is not None:
            lo, hi = metric_fns.is_band(c.is_upper, c.is_lower)
            self.rows["w_sum"].append(w.sum(dim=-1).numpy())
            self.rows["raw"].append(raw.sum(dim=-1).numpy())
            self.tot["w_sq"] += float(w.square().sum()) if c.verl_compat else float(torch.dot(w.reshape(-1), w.reshape(-1)))
            if c.is_level == "token":
                self.tot["high"] += float(torch.count_nonzero(raw > hi))
                self.tot["low"] += float(torch.count_nonzero(raw < lo)) - pad if lo > 0 else 0.0
                self.w_max = max(self.w_max, float(w.max()))
                self.w_min = min(self.w_min, float(tok.valid_min(w)))
            elif c.is_mode == "mask":
                self.tot["oob"] += float(torch.count_nonzero(((raw > hi) | (raw < (c.is_lower or 0.0))) & tok.mask))

    def _rule_sums(self, outcomes: list[RuleOutcome], tok) -> None:
        """What each rule's metrics read: per-row values for sequence rules, token totals for token rules."""
        if not self.rule_state:
            self.rule_state = [{"outcome": o, "rows": {}, "tot": {}} for o in outcomes]
        vetoes = [o.flags for o in outcomes if o.kind == "veto"]
        if vetoes:  # the floor and the ceiling count their tokens together
            union = torch.stack(vetoes).any(0)
            first = next(s for s in self.rule_state if s["outcome"].kind == "veto")
            first["tot"]["flags"] = first["tot"].get("flags", 0) + int(torch.count_nonzero(union))
        for state, o in zip(self.rule_state, outcomes):
            _rule_sum(state, o, tok)

    def _explain(self, chunk: Dump, index: np.ndarray, tok, outcomes: list[RuleOutcome],
                 w: Tensor | None) -> list[dict]:
        """The chunk's findings (one dict of columns per rule) and the rules' summaries; each rule runs alone
        through the correction library's rule functions on ℓ = log π_old − log μ (in bypass mode the dump's
        learner log-probs are π_θ, so the same ℓ)."""
        config = self.config
        k2 = kl_stats(tok, "k2")
        worst = tok.log_ratio.abs().masked_fill(~tok.mask, -1.0).argmax(dim=-1).numpy()
        lengths = tok.mask.sum(dim=-1).numpy()
        valid_rows = tok.valid.numpy()
        out: list[dict] = []
        j = 0

        def record(rule, level, statistic, threshold, lo, hi, effect, local, position, values, removed, observed):
            nonlocal j
            if len(self.summaries) <= j:
                self.summaries.append({"rule": rule, "statistic": statistic, "threshold": threshold, "level": level,
                                       "effect": effect, "lower": lo, "upper": hi, "sequences": 0, "tokens": 0,
                                       "observed": []})
            s = self.summaries[j]
            s["sequences"] += len(np.unique(local)) if level == "token" else len(local)
            s["tokens"] += int(removed)
            s["observed"].append(observed)
            f = {"rule": j, "level": level, "effect": effect, "local": local, "position": position, "values": values,
                 "tokens": lengths[local] if level == "sequence" else np.ones(len(local), np.int64)}
            out.append(f)
            self._store(chunk, index, f, lo, hi)
            j += 1

        def add_rows(rule, statistic, threshold, drop, values, lo, hi, *, positions=None, effect="rejected"):
            """One finding per valid row in ``drop`` (B,) bool; ``values`` (B,) is the statistic shown;
            ``positions`` (B,) the token to name (default: the row's largest |ℓ|)."""
            local = np.flatnonzero((drop & tok.valid).numpy())
            shown = values.double().numpy()
            pos = (worst if positions is None else np.asarray(positions))[local]
            record(rule, "sequence", statistic, threshold, lo, hi, effect, local, pos, shown[local],
                   lengths[local].sum(), shown[valid_rows])

        def add_tokens(rule, statistic, threshold, drop, values, lo, hi, *, effect="rejected"):
            """One finding per valid token in ``drop`` (B, T) bool; ``values`` (B, T) is the statistic shown."""
            idx = (drop & tok.mask).nonzero().numpy()
            shown = values.double()
            record(rule, "token", statistic, threshold, lo, hi, effect, idx[:, 0], idx[:, 1],
                   shown[drop & tok.mask].numpy(), len(idx), shown[tok.mask].numpy())

        for rule in outcomes:
            _explain_rule(rule, tok, k2, add_rows, add_tokens)
        if config.is_level is not None and config.is_mode == "mask" and config.applies_weights:
            _explain_masked_weights(config, tok, w, add_rows, add_tokens)
        return out

    def _store(self, chunk: Dump, index: np.ndarray, f: dict, lo, hi) -> None:
        """Keep a rule's findings of a chunk: columns, token labels (text and id) and response snippets."""
        local, position = f["local"], f["position"]
        text = chunk.token_text
        ids = chunk.tokens.numpy() if chunk.tokens is not None else None
        lines = np.asarray(chunk.line_numbers, np.int64)
        self.finds.append({
            "rule": np.full(len(local), f["rule"], np.int64), "row": index[local], "line": lines[local],
            "position": np.asarray(position, np.int64), "value": np.asarray(f["values"], np.float64),
            "excess": _outside(f["values"], lo, hi), "tokens": np.asarray(f["tokens"], np.int64),
        })
        for b, p in zip(local.tolist(), np.asarray(position).tolist()):
            self.labels.append((text[b][p] if text is not None else None,
                                int(ids[b, p]) if ids is not None else None))
            if f["level"] == "sequence":
                self.snippets.append(_snippet_of(chunk, b))
            else:
                self.snippets.append(None)

    def _routing_sums(self, chunk: Dump) -> None:
        self.routing = routing_add(self.routing, chunk.routed_experts, chunk.learner_routed_experts,
                                   chunk.rollout_log_prob, chunk.learner_log_prob, chunk.response_mask)

    def _top_tokens(self, chunk: Dump, index: np.ndarray, tok, findings: list[dict], weights: Tensor | None) -> None:
        """Keep the ``top`` valid tokens with the largest |ℓ| so far (ties: file order), with their fate; padding
        never competes (ℓ is 0 there, as on a token the two engines agree on)."""
        k = self.top
        if not k:
            return
        a = tok.log_ratio.abs()  # |log π_old − log μ|, unclamped as the report shows ρ
        kk = min(k, int(tok.num_tokens))
        threshold = torch.topk(a[tok.mask], kk).values.min()
        hit = torch.nonzero((a >= threshold) & tok.mask).numpy()  # every tie at the threshold competes
        bb, tt = hit[:, 0], hit[:, 1]
        vals = a[torch.from_numpy(bb), torch.from_numpy(tt)].numpy()
        order = np.lexsort((tt, index[bb], -vals))[:kk]
        text, ids = chunk.token_text, chunk.tokens
        for i in order.tolist():
            b, t = int(bb[i]), int(tt[i])
            self.candidates.append((
                -float(vals[i]), int(index[b]), t, int(chunk.line_numbers[b]),
                text[b][t] if text is not None else None, int(ids[b, t]) if ids is not None else None,
                float(chunk.rollout_log_prob[b, t]), float(chunk.learner_log_prob[b, t]),
                _fate_hits(findings, self.summaries, b, t),
                None if weights is None else float(weights[b, t]),
            ))
        self.candidates.sort(key=lambda c: c[:3])
        del self.candidates[k:]

    # -- the whole dump -----------------------------------------------------------------------------------------
    def finish(self, dump: Dump | DumpInfo) -> Analysis:
        info = self.info
        config = self.config
        if self.missing_advantages:
            missing = info.partial.get("advantages", [])
            if missing:
                raise ValueError(
                    f"the config uses OPSM (opsm_delta), which needs advantages in every row, but {len(missing)} of "
                    f"{info.rows} rows have no {info.fields.get('advantages', 'advantages')!r} (line "
                    f"{', '.join(map(str, missing[:5]))}{' ...' if len(missing) > 5 else ''})"
                )
            self.check_start({})
        notes: list[str] = []
        if config.mode == "bypass":
            notes.append(f"bypass mode: the dump's learner log-probs ({info.fields['learner']}) stand in for π_θ")
        order = np.argsort(np.concatenate(self.rows["index"]), kind="stable")
        per_row = {k: torch.from_numpy(np.concatenate(v)[order]) for k, v in self.rows.items() if v and k != "index"}
        n = per_row["n"]
        rows = Rows(n=n, valid=n > 0, num_tokens=n.sum(), num_rows=(n > 0).sum().to(n.dtype),
                    num_pad=torch.zeros((), dtype=n.dtype), verl=config.verl_compat,
                    count_dtype=torch.get_default_dtype())
        metrics: dict[str, Tensor] = {}
        factor = None
        if config.is_level is not None:
            w_rows, is_m = self._is_metrics(rows, per_row)
            metrics.update(is_m)
            if config.batch_normalize:
                factor = norm_factor(w_rows[:, None], rows.n, rows.valid, config.is_level,
                                     den=rows.den if rows.verl else None)
                metrics["rollout_is_batch_norm_factor"] = factor
        metrics.update(self._rule_metrics(rows, order))
        num_tokens = rows.num_tokens
        dtype = n.dtype
        metrics.update(self._count_metrics(rows))
        total = {k: torch.tensor(v, dtype=dtype) for k, v in self.tot.items()}
        metrics.update(metric_fns.diagnostics_from_sums({k: per_row[k] for k in PER_ROW}, total, rows))
        if info.complete.get("version") and self.version[1] is not None:
            current = self.version[2]
            lag_sum = float(current * int(num_tokens) - self.version[0])
            metrics["staleness_mean"] = torch.tensor(lag_sum, dtype=dtype) / rows.den(num_tokens)
            metrics["staleness_max"] = torch.tensor(float(current - self.version[1]), dtype=dtype)
            if self.version[1] != current:
                notes.append(f"staleness is measured against the newest version in the dump ({current})")
        out = metric_fns.metrics_to_floats({PREFIX + k: v for k, v in metrics.items()})
        responses, tokens = len(n), int(num_tokens)
        if self.any_rule and tokens > 0 and self.kept_tokens == 0:
            notes.insert(0, f"warning: {ALL_REJECTED.format(tokens=tokens, seqs=responses)}")
        if not self.explained_ok:
            notes.append(
                "warning: the per-rule explanation does not match the correction's mask "
                f"({self.explained_tokens} vs {self.mask_rejected} rejected tokens)"
            )
        self._routing(info, out, notes)
        f = float(factor) if factor is not None else 1.0
        weights = None
        if self.applied[1] != math.inf:
            weights = (self.applied[0] / tokens / f, self.applied[1] / f, self.applied[2] / f)
        kept_mask = is_weights = None
        if self.tensors is not None:
            kept_mask, is_weights = self.tensors
            if is_weights is not None and factor is not None:
                is_weights = is_weights / factor.to(is_weights.dtype)
        return Analysis(
            dump=dump, config=config, source=self.source, metrics=out, is_weights=is_weights, kept_mask=kept_mask,
            findings=self._finding_table(info), rules=self._summaries(), notes=notes, responses=responses,
            tokens=tokens, rejected_tokens=self.rejected_tokens, rejected_sequences=self.rejected_rows,
            weights=weights, top_tokens=self._token_rows(info, f),
            turns=self.turns.result(scale={"weight_mean": f}) if self.turns.multi_turn else None,
        )

    def _count_metrics(self, rows: Rows) -> dict[str, Tensor]:
        """Tokens and sequences of the dump: all, valid, kept; with a rule, the shares it masked (verl's names)."""
        n, num_tokens, dtype = rows.n, rows.num_tokens, rows.n.dtype
        metrics: dict[str, Tensor] = {}
        if self.any_rule:
            rejected_rows = torch.tensor(float(self.rejected_rows), dtype=dtype)
            metrics["rollout_rs_masked_fraction"] = (num_tokens - self.kept_tokens) / rows.den(num_tokens)
            metrics["rollout_rs_seq_masked_fraction"] = (
                rejected_rows / len(n) if rows.verl else rejected_rows / rows.num_rows
            )
        kept_tokens = torch.tensor(float(self.kept_tokens), dtype=dtype)
        metrics["num_tokens"] = num_tokens
        metrics["num_kept_tokens"] = kept_tokens
        metrics["num_seqs"] = torch.tensor(float(len(n)), dtype=dtype)
        metrics["num_valid_seqs"] = rows.num_rows
        metrics["num_kept_seqs"] = torch.tensor(float(self.kept_rows), dtype=dtype)
        metrics["all_rejected"] = (kept_tokens == 0).to(dtype)
        return metrics

    def _routing(self, info: DumpInfo, out: dict[str, float], notes: list[str]) -> None:
        """The routing flips into ``out`` and a sentence into ``notes`` when the dump holds both sides' experts;
        routing that cannot be compared is said, as the audit says it."""
        r = self.routing
        if info.complete.get("routed_experts") and info.complete.get("learner_routed_experts") and r and not r.get("mismatch"):
            routing = routing_result(r)
            out.update({f"routing/{k}": float(v) for k, v in routing.items() if isinstance(v, int | float)})
            notes.append(routing_sentence(routing) or "routing: the sampler and the learner chose the same experts "
                         "on every token")
        elif info.routing_note:
            notes.append(info.routing_note)

    def _is_metrics(self, rows: Rows, per_row: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """(per-row Σ_t w, the IS metrics) from the whole dump's sums (``metrics.is_metrics``' reductions)."""
        c = self.config
        dtype = rows.dtype

        def tensor(x: float) -> Tensor:
            return torch.tensor(x, dtype=dtype)

        row_log = None if c.is_level == "token" else row_log_weight(per_row["lr"], rows.n, c.is_level)
        extra: dict[str, Tensor] = {}
        if row_log is None:
            extra = {"high": tensor(self.tot["high"]), "low": tensor(self.tot["low"]), "w_max": tensor(self.w_max),
                     "w_min": tensor(self.w_min)}
        elif c.is_mode == "mask":
            extra["oob"] = tensor(self.tot["oob"])
        m = metric_fns.is_metrics_from_sums(
            rows, c.is_upper, c.is_lower, c.is_mode, row_log=row_log, w_sum=per_row["w_sum"].sum(),
            w_sq=tensor(self.tot["w_sq"]), w_row_sum=per_row["w_sum"], raw_row_sum=per_row["raw"], **extra,
        )
        return per_row["w_sum"], m

    def _rule_metrics(self, rows: Rows, order: np.ndarray) -> dict[str, Tensor]:
        """Each rule kind's metrics, in ``rule_metrics``' order, from the whole dump's per-row values."""
        out: dict[str, Tensor] = {}
        dtype = rows.dtype

        def per_row(state: dict, name: str) -> Tensor:
            return torch.from_numpy(np.concatenate(state["rows"][name])[order])

        for rule in RULES:
            mine = [s for s in self.rule_state if s["outcome"].kind == rule.kind]
            if not mine:
                continue
            if rule.kind == "rs":
                for s in mine:
                    r = s["outcome"].rs
                    seq = RSOutcome(r.option, None, per_row(s, "row_keep"), None, per_row(s, "row_stat"), r.lower,
                                    r.upper)
                    m = metric_fns.rs_option_metrics(seq, rows)
                    if r.token_keep is not None:
                        m = _token_option(m, s["tot"], r, rows)
                    out.update(m)
            elif rule.kind == "veto":
                keep = torch.stack([per_row(s, "row_keep") for s in mine]).all(0)
                flags = torch.tensor(float(mine[0]["tot"].get("flags", 0)), dtype=dtype)
                out["veto_token_fraction"] = flags / rows.den(rows.num_tokens)
                out["veto_seq_fraction"] = rows.over_rows((~keep & rows.valid).to(dtype))
            elif all(s["outcome"].token_keep is None for s in mine):
                outcomes = []
                for s in mine:
                    o = s["outcome"]
                    trm = (per_row(s, "trm0"), per_row(s, "trm1")) if "trm0" in s["rows"] else None
                    outcomes.append(dataclasses.replace(o, row_keep=per_row(s, "row_keep"), stat=per_row(s, "stat"),
                                                        trm=trm))
                out.update(rule.metrics(outcomes, rows))
            else:  # token-level rules registered later: token-weighted means of their chunks' metrics
                tot = mine[0]["tot"]
                for key, value in tot.items():
                    if key.startswith("m:"):
                        out[key[2:]] = torch.tensor(value / max(tot["tokens"], 1.0), dtype=dtype)
        return out

    def _summaries(self) -> list[RuleSummary]:
        return [RuleSummary(s["rule"], s["statistic"], s["threshold"], s["level"], s["effect"], s["sequences"],
                            s["tokens"], quantiles(np.concatenate(s["observed"])))
                for s in self.summaries]

    def _finding_table(self, info: DumpInfo) -> FindingTable:
        keys = ("rule", "row", "line", "position", "value", "excess", "tokens")
        if self.finds:
            cols = {k: np.concatenate([f[k] for f in self.finds]) for k in keys}
        else:
            cols = {k: np.zeros(0, np.float64 if k in ("value", "excess") else np.int64) for k in keys}
        order = np.lexsort((cols["position"], cols["row"], cols["rule"]))  # rule order, then file order
        cols = {k: v[order] for k, v in cols.items()}
        labels = [_label(self.labels[i], info) for i in order.tolist()]
        snippets = [_choose_snippet(self.snippets[i], info) for i in order.tolist()]
        meta = [{k: s[k] for k in ("rule", "statistic", "threshold", "level", "effect", "lower", "upper")}
                for s in self.summaries]
        return FindingTable(meta, cols, labels, snippets)

    def _token_rows(self, info: DumpInfo, factor: float) -> list[TokenRow]:
        out = []
        for _, _, pos, line, text, tid, log_mu, log_old, hits, w in self.candidates:
            if hits:
                fate = hits
            elif w is not None:
                fate = f"kept, w = {fmt(w / factor if factor != 1.0 else w)}"
            else:
                fate = "kept"
            shown = text if info.complete.get("token_text") else None
            tid = tid if shown is None and info.complete.get("tokens") else None
            out.append(TokenRow(line, pos, shown, tid, log_mu, log_old, fate))
        return out


def _rule_sum(state: dict, o: RuleOutcome, tok) -> None:
    """One rule outcome of a chunk into its accumulators (``state["rows"]``: per-row arrays, ``state["tot"]``)."""
    rows, tot = state["rows"], state["tot"]

    def keep(name: str, x: Tensor) -> None:
        rows.setdefault(name, []).append(x.detach().cpu().numpy())

    def add(name: str, x: float, how=None) -> None:
        tot[name] = x if name not in tot else (how or (lambda a, b: a + b))(tot[name], x)

    if o.kind == "rs" and o.rs.token_keep is not None:  # a token option: the token branch's sums
        r = o.rs
        x, is_k1 = r.token_stat, r.lower is not None
        lower = r.lower if is_k1 else 0.0
        add("x_sum", float(x.sum()))
        add("x_max", float(tok.valid_max(x)), max)
        add("x_min", float(tok.valid_min(x)), min)
        add("high", int(torch.count_nonzero((x > r.upper) & tok.mask)))
        add("low", int(torch.count_nonzero((x < lower) & tok.mask)) if is_k1 else 0)
        cm = x.clamp(min=lower, max=r.upper).mul_(tok.mask_f)
        add("cm_sum", float(cm.sum()))
        add("cm_sq", float(cm.square_().sum()))
        rejected = ~r.token_keep & tok.mask
        add("rejected", int(torch.count_nonzero(rejected)))
        keep("row_stat", r.row_stat)
        keep("row_keep", ~any_per_row(rejected))
    elif o.kind == "rs":
        keep("row_stat", o.rs.row_stat)
        keep("row_keep", o.rs.row_keep)
    elif o.kind == "veto":
        keep("row_keep", o.row_keep)
    elif o.token_keep is None:  # TRM, OPSM and row-level rules registered later
        keep("row_keep", o.row_keep)
        keep("stat", o.stat)
        if o.trm is not None:
            keep("trm0", o.trm[0])
            keep("trm1", o.trm[1])
    else:  # a token-level rule registered later: its metrics, weighted by the chunk's tokens
        n = float(tok.num_tokens)
        for key, value in metric_fns.metrics_to_floats(RULES_BY_KIND()[o.kind].metrics([o], tok)).items():
            add(f"m:{key}", value * n)
        add("tokens", n)


def RULES_BY_KIND() -> dict:  # noqa: N802 - a lookup of the registered rules, as of the call
    return {rule.kind: rule for rule in RULES}


def _token_option(seq_metrics: dict[str, Tensor], tot: dict, r: RSOutcome, rows: Rows) -> dict[str, Tensor]:
    """``rs_option_metrics`` of a token option from its token sums: the token branch's keys (mean, max, min,
    fractions, std, masked fraction); the per-row ones from the sequence view ``seq_metrics``."""
    p = f"rollout_rs_{r.option}"
    dtype = rows.dtype
    total = rows.den(rows.num_tokens)
    is_k1 = r.lower is not None
    mean = torch.tensor(tot["cm_sum"], dtype=dtype) / total
    std = (torch.tensor(tot["cm_sq"], dtype=dtype) / total - mean.square()).clamp_min(0).sqrt()
    out = {
        f"{p}_mean": torch.tensor(tot["x_sum"], dtype=dtype) / total,
        f"{p}_max": torch.tensor(tot["x_max"], dtype=dtype),
        f"{p}_min": torch.tensor(tot["x_min"], dtype=dtype),
        f"{p}_fraction_high": torch.tensor(float(tot["high"]), dtype=dtype) / total,
        f"{p}_fraction_low": torch.tensor(float(tot["low"]), dtype=dtype) / total if is_k1 else torch.zeros((), dtype=dtype),
        f"{p}_std": torch.where(rows.num_tokens > 1, std, torch.zeros_like(std)),
    }
    for key, value in seq_metrics.items():
        if key not in out and key != f"{p}_masked_fraction":
            out[key] = value
        if key == f"{p}_seq_fraction_low" or (not is_k1 and key == f"{p}_seq_fraction_high"):
            out[f"{p}_masked_fraction"] = torch.tensor(float(tot["rejected"]), dtype=dtype) / total
    out[f"{p}_seq_masked_fraction"] = out.pop(f"{p}_seq_masked_fraction")
    return out


def _fate_hits(findings: list[dict], summaries: list[dict], b: int, t: int) -> str:
    """What the rules do to token t of row b of a chunk ("" when none removes or zeroes it)."""
    by_effect: dict[str, list[str]] = {}
    for level in ("token", "sequence"):  # the token's own findings first, then its row's, in rule order
        for f in findings:
            if f["level"] != level:
                continue
            hit = (f["local"] == b) & (f["position"] == t) if level == "token" else f["local"] == b
            if hit.any():
                rule = summaries[f["rule"]]["rule"]
                by_effect.setdefault(f["effect"], []).append(rule if level == "token" else f"{rule} (sequence)")
    return "; ".join(f"{effect} by {', '.join(rules)}" for effect, rules in sorted(by_effect.items()))


def _label(label: tuple, info: DumpInfo) -> str | None:
    """A token as reports name it: its text when every row has token texts, else its id when every row has ids."""
    text, tid = label
    if info.complete.get("token_text"):
        return text
    if info.complete.get("tokens") and tid is not None:
        return f"id {tid}"
    return None


def _snippet_of(chunk: Dump, b: int) -> tuple[str | None, str | None]:
    """The start of row b's response: (its text, its token texts joined), ``SNIPPET`` characters each."""
    text = chunk.text[b][:SNIPPET] if chunk.text is not None else None
    joined = None
    if chunk.token_text is not None:
        n = int(chunk.response_mask[b].sum())
        parts, size = [], 0
        for piece in chunk.token_text[b][:n]:
            parts.append(piece)
            size += len(piece)
            if size > SNIPPET:
                break
        joined = "".join(parts)[:SNIPPET]
    return text, joined


def _choose_snippet(pair: tuple | None, info: DumpInfo) -> str | None:
    if pair is None:
        return None
    text, joined = pair
    if info.complete.get("text"):
        return text
    if info.complete.get("token_text"):
        return joined
    return None


def iter_chunks(dump: Dump, positions: int) -> Iterable[Dump]:
    """An in-memory dump cut into chunks of at most ``positions`` padded positions (rows grouped by length), as
    ``DumpReader.chunks`` cuts a file — for checking that a chunked analysis equals the whole one."""
    from rollcorr.dumps.rows import _as_dump, _Rows

    mask = dump.response_mask
    b, t = mask.shape
    lengths = np.where(mask.any(-1).numpy(), t - mask.flip(-1).int().argmax(-1).numpy(), 0).astype(np.int64)
    lengths = np.maximum(lengths, 1)
    keep = np.arange(t)[None, :] < lengths[:, None]

    def flat(x: Tensor | None, dtype=None) -> np.ndarray | None:
        return None if x is None else x.numpy()[keep].astype(dtype or x.numpy().dtype)

    numeric = {k: flat(getattr(dump, k)) for k in ("advantages", "tokens", "version") if getattr(dump, k) is not None}
    routed = {role: [None if getattr(dump, role) is None else getattr(dump, role)[i, : lengths[i]].tolist()
                     for i in range(b)] for role in ("routed_experts", "learner_routed_experts")}
    rows = _Rows(
        lines=np.asarray(dump.line_numbers, np.int64), n=lengths, rollout=flat(dump.rollout_log_prob),
        learner=flat(dump.learner_log_prob), mask=flat(mask), numeric=numeric,
        has={k: np.full(b, k in numeric) for k in ("advantages", "tokens", "version")},
        token_text=list(dump.token_text) if dump.token_text is not None else [None] * b,
        text=list(dump.text) if dump.text is not None else [None] * b, routed=routed,
        extras={k: list(v) for k, v in dump.extras.items()}, correction=[None] * b,
    )
    order = np.argsort(lengths, kind="stable")
    a = 0
    while a < b:
        stop = a + 1
        while stop < b and (stop + 1 - a) * lengths[order[stop]] <= positions:
            stop += 1
        sel = order[a:stop]
        yield _as_dump(rows, sel, dump.path, dump.fields, tuple(dump.extras), row_index=sel.astype(np.int64))
        a = stop


def analyze_chunks(dump: Dump, config: CorrectionConfig, positions: int, source: str = "", *,
                   top: int = TOP_TOKENS) -> Analysis:
    """``analyze`` with the dump cut into chunks of at most ``positions`` padded positions (``iter_chunks``)."""
    engine = _Engine(config, source, _info_of(dump), top=top)
    engine.check_start()
    with one_thread():
        for chunk in iter_chunks(dump, positions):
            engine.feed(chunk)
        return engine.finish(dump)


def _explain_rule(rule: RuleOutcome, tok, k2: Tensor, add_rows, add_tokens) -> None:
    """One rule's findings, through ``add_rows`` (a sequence rule: the statistic per row, and the token to name)
    or ``add_tokens`` (a token rule), shown in the statistic's own terms (K1 windows as ratios, veto as ρ_t)."""
    name, drop = rule.rule, ~rule.row_keep if rule.row_keep is not None else ~rule.token_keep
    if rule.rs is not None:
        r = rule.rs
        if name.endswith("k1"):  # statistic space k1 = −log ρ → show ratios
            lo, hi = exp_or_inf(-r.upper), exp_or_inf(-r.lower)
            shown = torch.exp(-rule.stat)
        else:
            lo, hi, shown = None, r.upper, rule.stat
        if r.token_keep is not None:
            add_tokens(name, STATISTICS[name], kept_range(lo, hi), drop, shown, lo, hi)
        else:
            add_rows(name, STATISTICS[name], kept_range(lo, hi), drop, shown, lo, hi)
    elif rule.flags is not None:  # veto: the row's smallest (floor) or largest (ceiling) ρ_t
        floor = rule.lower is not None
        ell = rule.stat.masked_fill(~tok.mask, math.inf if floor else -math.inf)
        value, pos = ell.min(dim=-1) if floor else ell.max(dim=-1)
        lo, hi = (rule.threshold, None) if floor else (None, rule.threshold)
        statistic, window = ("min ρ_t", f"≥ {fmt(lo)}") if floor else ("max ρ_t", f"≤ {fmt(hi)}")
        add_rows(name, statistic, window, drop, value.exp(), lo, hi, positions=pos.numpy())
    elif name == "trm_max_k2":
        pos = k2.masked_fill(~tok.mask, -1.0).argmax(dim=-1).numpy()
        add_rows(name, "max ½ℓ²", f"≤ {fmt(rule.upper)}", drop, rule.stat, None, rule.upper, positions=pos)
    elif rule.token_keep is not None:  # a token-level rule registered later
        add_tokens(name, name, f"≤ {fmt(rule.upper)}", drop, rule.stat, None, rule.upper)
    else:
        statistic = {"trm_mean_k3": "mean k3", "opsm": "mean(log μ − log π_θ), A<0"}.get(name, name)
        add_rows(name, statistic, f"≤ {fmt(rule.upper)}", drop, rule.stat, None, rule.upper)


def _explain_masked_weights(config, tok, w: Tensor | None, add_rows, add_tokens) -> None:
    """IcePop / MIS (``is_mode=mask``): the tokens or sequences whose weight the band set to zero."""
    raw, row_log = raw_weights(tok, config.is_level, config.safety_bound)
    zeroed = (w == 0) & (raw != 0) & tok.mask  # w: the masked weights
    lo, hi = config.is_lower, config.is_upper
    name = {"token": "icepop", "sequence": "seq_mis", "geometric": "geo_mis"}[config.is_level]
    if config.is_level == "token":
        add_tokens(name, "ρ_t", kept_range(lo, hi), zeroed, raw, lo, hi, effect="zero weight")
    else:
        stat = "Π ρ_t" if config.is_level == "sequence" else "geo-mean ρ"
        add_rows(name, stat, kept_range(lo, hi), zeroed.any(dim=-1), row_log.exp(), lo, hi,
                 effect="zero weight")
