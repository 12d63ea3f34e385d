"""``rollcorr audit --from-log`` in bounded memory: the audit of a rollout dump read chunk by chunk.

A dump whose padded (responses × longest response) size fits ``WHOLE_POSITIONS`` and whose responses number at
most ``WHOLE_ROWS`` is audited as it always was (``collect.from_dump`` → ``report.write_report``, the whole dump
in memory: ~17 KB a response besides its tokens, so 10⁵ one-token rows took 1.9 GB). A larger one — many rows,
or one very long row among short ones, which would pad every row to its length — is read in chunks
(``rollcorr.dumps.DumpReader.chunks``) and every number of ``summary.json`` is summed chunk by chunk
with the formulas of ``rollcorr.audit.stats`` (equal to float rounding): probability table, KL / χ² / ESS, the
per-response distributions (exact quantiles over values kept per row, 4 floats a row), the position profile
(per-position sums), the worst tokens with their context, the routing section. Only the four figures are drawn
from a part of the dump: the response with the largest |Δp| and a fixed pseudo-random sample of the others
(``FIGURE_ROWS`` rows, ``FIGURE_POSITIONS`` padded positions at most); ``summary.json`` and the report's source
table say so (``source["figures"]``).
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rollcorr.audit import levels
from rollcorr.audit.collect import AuditData, from_dump
from rollcorr.audit.stats import MAX_OVER_TOP, median_max_over
from rollcorr.chunked import one_thread, quantiles, release_memory
from rollcorr.config.correction import LOG_RATIO_CLAMP
from rollcorr.correction import metrics as metric_fns
from rollcorr.correction.ratios import Rows, make_tokens
from rollcorr.dumps import CHUNK_POSITIONS, Dump, DumpInfo, open_dump
from rollcorr.moe import routing_add, routing_result
from rollcorr.turns import TurnStats

WHOLE_POSITIONS = 1 << 21  # padded positions up to which a dump is audited whole, exactly as before
WHOLE_ROWS = 1 << 13  # responses up to which it is (the whole path's per-response cost: ~140 MB at this many)
FIGURE_ROWS = 2000  # responses the figures of a larger dump are drawn from (besides the worst one)
FIGURE_POSITIONS = 1 << 22  # padded positions those figures' responses may take
CONTEXT_TOKENS = 12  # as report.CONTEXT_TOKENS


@dataclass
class LogAudit:
    """A dump read for the audit: ``data`` (the whole dump, when it fits) or the chunk-summed ``summary`` and
    the ``figures`` view (a part of the dump). ``write(out_dir)`` writes the report."""

    data: AuditData | None
    summary: dict[str, Any] | None
    figures: AuditData | None

    def write(self, out_dir: str | Path, worst_k: int = 10) -> dict[str, Any]:
        """summary.json, the PNGs and report.html into ``out_dir`` (``report.write_report``'s files); the summary."""
        from rollcorr.audit import plots
        from rollcorr.audit.report import _atomic_write, render_html, write_report
        from rollcorr.audit.stats import check_inputs

        if self.data is not None:
            return write_report(self.data, out_dir, worst_k=worst_k)
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        summary = dict(self.summary)
        f = self.figures
        images = plots.draw_all(check_inputs(f.rollout_log_prob, f.old_log_prob, f.response_mask), out_dir)
        summary["files"] = sorted([*(p.name for p in images.values()), "report.html", "summary.json"])
        _atomic_write(out_dir / "summary.json", json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
        _atomic_write(out_dir / "report.html", render_html(summary, images))
        return summary


def audit_log(
    path: str | Path,
    *,
    rollout_field: str = "rollout_log_probs",
    learner_field: str = "old_log_probs",
    mask_field: str = "response_mask",
    worst_k: int = 10,
    positions: int = CHUNK_POSITIONS,
    whole_positions: int = WHOLE_POSITIONS,
    whole_rows: int = WHOLE_ROWS,
) -> LogAudit:
    """Read a dump (JSONL / Parquet, a file, ``-`` or a FIFO) for the audit, chunk by chunk; see the module
    docstring. Raises ``ValueError`` / ``FileNotFoundError`` as ``read_dump`` does."""
    reader = open_dump(path, rollout_field=rollout_field, learner_field=learner_field, mask_field=mask_field)
    sums = _AuditSums(worst_k)
    held: list[Dump] | None = []  # the chunks, while the whole dump would fit whole_positions padded, whole_rows
    longest = 0
    with one_thread():
        for i, chunk in enumerate(reader.chunks(positions)):
            sums.feed(chunk)
            if i % 16 == 15:
                release_memory()
            if held is not None:
                longest = max(longest, chunk.response_mask.shape[1])
                held.append(chunk)
                rows = sum(len(c) for c in held)
                if rows > whole_rows or rows * longest > whole_positions:
                    held = None
        info = reader.info()
        fields = (rollout_field, learner_field, mask_field)
        if held is not None:
            data = from_dump(_whole(held, info), path=path, fields=fields)
            if info.routing_note:  # routing in the dump that cannot be compared: said, not dropped silently
                data.diagnosis["routing_note"] = info.routing_note
            return LogAudit(data, None, None)
        summary, figures = sums.finish(info, path)
    return LogAudit(None, summary, figures)


def _whole(chunks: list[Dump], info: DumpInfo) -> Dump:
    """The chunks' rows back in file order, padded to the longest (the ``Dump`` ``read_dump`` gives)."""
    rows = sorted(((int(i), c, b) for c in chunks for b, i in enumerate(c.row_index.tolist())))
    t = max(c.response_mask.shape[1] for c in chunks)

    def stack(name: str) -> Tensor | None:
        if any(getattr(c, name) is None for c in chunks):
            return None
        parts = []
        for _, c, b in rows:
            x = getattr(c, name)[b]
            pad = torch.zeros((t - x.shape[0], *x.shape[1:]), dtype=x.dtype)
            parts.append(torch.cat([x, pad]))
        return torch.stack(parts)

    def listed(name: str) -> list | None:
        return None if any(getattr(c, name) is None for c in chunks) else [getattr(c, name)[b] for _, c, b in rows]

    routed = [stack("routed_experts"), stack("learner_routed_experts")]
    if not (info.complete.get("routed_experts") and info.complete.get("learner_routed_experts")):
        routed = [None, None]
    return Dump(
        path=info.path, rollout_log_prob=stack("rollout_log_prob"), learner_log_prob=stack("learner_log_prob"),
        response_mask=stack("response_mask"), line_numbers=[c.line_numbers[b] for _, c, b in rows],
        fields=info.fields, malformed=info.malformed, token_text=listed("token_text") if info.complete.get("token_text") else None,
        routed_experts=routed[0], learner_routed_experts=routed[1],
        turn=stack("turn") if info.complete.get("turn") else None,
        extras={key: [c.extras[key][b] for _, c, b in rows] for key in info.extra_fields}, total_rows=info.total_rows,
    )


def _hash(i: int) -> int:
    """A fixed pseudo-random rank for row i (the figures' sample: the same rows on every run)."""
    return (i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & ((1 << 64) - 1)


class _AuditSums:
    """``audit_stats``' reductions summed chunk by chunk (``rollcorr.audit.stats`` has the formulas)."""

    def __init__(self, worst_k: int) -> None:
        self.worst_k = worst_k
        keys = ("index", "n", "max", "sum", "seq", "old", "roll", "lr", "d_max", "d_sum", "k3", *levels.THRESHOLDS)
        self.per_row: dict[str, list[np.ndarray]] = {k: [] for k in keys}
        self.prompts_ok = True  # every row's prompt is text (report.token_context shows the prompt then)
        self.tot: dict[str, float] = {}
        self.lr_min, self.lr_max = math.inf, -math.inf
        self.position = {"sum": np.zeros(0), "max": np.zeros(0), "count": np.zeros(0, np.int64)}
        self.worst: list[tuple] = []  # (−|Δp|, row, pos, item)
        self.sample: list[tuple] = []  # max-heap on the hash: (−hash, row, tensors…)
        self.sample_tokens = 0
        self.top_row: tuple | None = None  # the row with the largest |Δp|: (−max, row, tensors…)
        self.routing: dict | None = None
        self.turns = TurnStats()  # the mismatch per turn and by place in the turn (multi-turn dumps)
        self.top_abs_diff = torch.zeros(0, dtype=torch.float64)  # the largest |Δp|, descending (median_max_over)

    def add(self, key: str, value: float) -> None:
        self.tot[key] = self.tot.get(key, 0.0) + value

    def feed(self, chunk: Dump) -> None:
        mask = chunk.response_mask
        log_mu, log_old = chunk.rollout_log_prob, chunk.learner_log_prob  # float64, 0 on padding, ≤ 0
        index = chunk.row_index.numpy()
        lr = (log_old - log_mu).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask  # TokenView.log_ratio
        abs_diff = (log_mu.exp() - log_old.exp()).abs() * mask  # TokenView.abs_diff
        n = mask.sum(dim=1)
        row_max = abs_diff.max(dim=1).values
        for key, x in (("index", index), ("n", n.numpy()), ("max", row_max.numpy()), ("sum", abs_diff.sum(dim=1).numpy()),
                       ("seq", lr.sum(dim=1).numpy()), ("k3", levels.row_k3(lr, mask).numpy())):
            self.per_row[key].append(np.asarray(x))
        kept = torch.cat([self.top_abs_diff, abs_diff[mask.bool()]])
        self.top_abs_diff = kept.topk(min(MAX_OVER_TOP, kept.numel())).values
        for key, x in levels.row_hits(abs_diff, mask)[0].items():  # the verdict level's shares, per response
            self.per_row[key].append(x.numpy())
        # the probability table (mismatch_stats) and the divergences (offpolicy / divergence metrics)
        tok = make_tokens(log_old, log_mu, mask, bound=LOG_RATIO_CLAMP, verl=False)
        pad = float(tok.num_pad)
        a, b = tok.anchor.exp(), tok.rollout.exp()  # 1 on padding
        dot = lambda x, y: float(torch.dot(x.reshape(-1), y.reshape(-1)))  # noqa: E731
        self.add("p_old_sum", float(a.sum()) - pad)
        self.add("p_rollout_sum", float(b.sum()) - pad)
        self.add("p_old_sq_sum", dot(a, a) - pad)
        self.add("p_rollout_sq_sum", dot(b, b) - pad)
        self.add("p_cross_sum", dot(a, b) - pad)
        d = (a - b).abs()
        self.per_row["d_max"].append(d.amax(dim=-1).numpy())
        self.per_row["d_sum"].append(d.sum(dim=-1).numpy())
        self.add("small_diff_count", float(torch.count_nonzero(d < 1e-3)) - pad)
        self.add("tokens_differing", float(torch.count_nonzero((log_mu != log_old) & mask.bool())))
        for i, threshold in enumerate(metric_fns.PROB_SHARES):
            self.add(f"ge{i}", float(torch.count_nonzero(d >= threshold)))
        rho, lrs = tok.ratio, tok.log_ratio_safe
        k3 = (rho - 1.0).sub_(lrs)
        self.per_row["old"].append(tok.anchor.sum(dim=-1).numpy())
        self.per_row["roll"].append(tok.rollout.sum(dim=-1).numpy())
        self.per_row["lr"].append(tok.log_ratio.sum(dim=-1).numpy())
        self.add("k3_sum", float(k3.sum()))
        self.add("rho2", dot(rho, rho) - pad)
        rho_lr = rho * lrs
        self.add("policy_kl", float((rho_lr - rho + 1.0).sum()))
        js = torch.nn.functional.softplus(lrs).sub_(math.log(2.0)).mul_(rho + 1.0)
        self.add("js", float((rho_lr - js).mul_(0.5).sum()))
        self.add("e_abs", float(torch.maximum(rho, torch.reciprocal(rho)).sub_(1.0).sum()))
        self.add("abs", float(lrs.abs().sum()))
        valid = mask
        r_valid, lr_valid = lr[valid].exp(), lr[valid]  # the audit's own: ρ·ℓ, ESS, extremes
        self.add("rho_lr", float((r_valid * lr_valid).sum()))
        self.add("rho_sum", float(r_valid.sum()))
        self.add("rho_sq", float(r_valid.square().sum()))
        self.lr_min, self.lr_max = min(self.lr_min, float(lr_valid.min())), max(self.lr_max, float(lr_valid.max()))
        # position profile: per-position sums, maxima and counts
        t = mask.shape[1]
        if len(self.position["sum"]) < t:
            for key, dtype in (("sum", np.float64), ("max", np.float64), ("count", np.int64)):
                grown = np.zeros(t, dtype)
                grown[: len(self.position[key])] = self.position[key]
                self.position[key] = grown
        self.position["sum"][:t] += abs_diff.sum(dim=0).numpy()
        self.position["max"][:t] = np.maximum(self.position["max"][:t], abs_diff.max(dim=0).values.numpy())
        self.position["count"][:t] += mask.sum(dim=0).numpy()
        self._worst_tokens(chunk, index, abs_diff, lr)
        self.turns.feed(log_mu, log_old, mask, chunk.turn)
        self._figure_rows(chunk, index, row_max)
        if chunk.routed_experts is not None and chunk.learner_routed_experts is not None:
            self.routing = routing_add(self.routing, chunk.routed_experts, chunk.learner_routed_experts,
                                       chunk.rollout_log_prob, chunk.learner_log_prob, chunk.response_mask)

    def _worst_tokens(self, chunk: Dump, index: np.ndarray, abs_diff: Tensor, lr: Tensor) -> None:
        k = self.worst_k
        mask = chunk.response_mask
        if not k:
            return
        kk = min(k, int(mask.sum()))
        threshold = torch.topk(abs_diff[mask], kk).values.min()
        hit = torch.nonzero((abs_diff >= threshold) & mask).numpy()
        bb, tt = hit[:, 0], hit[:, 1]
        vals = abs_diff[torch.from_numpy(bb), torch.from_numpy(tt)].numpy()
        order = np.lexsort((tt, index[bb], -vals))[:kk]
        prompts = chunk.extras.get("prompt")
        self.prompts_ok = self.prompts_ok and prompts is not None and all(isinstance(p, str) for p in prompts)
        for i in order.tolist():
            b, t = int(bb[i]), int(tt[i])
            item = {
                "row": int(index[b]), "position": t, "p_sampler": float(chunk.rollout_log_prob[b, t].exp()),
                "p_learner": float(chunk.learner_log_prob[b, t].exp()), "abs_diff": float(vals[i]),
                "log_ratio": float(lr[b, t]),
            }
            tokens = chunk.token_text[b] if chunk.token_text is not None else None
            prompt = prompts[b] if prompts is not None else None
            self.worst.append((-float(vals[i]), int(index[b]), t, item, (_context(tokens, prompt, t),
                                                                          _context(tokens, None, t))))
        self.worst.sort(key=lambda w: w[:3])
        del self.worst[k:]

    def _figure_rows(self, chunk: Dump, index: np.ndarray, row_max: Tensor) -> None:
        """Keep the worst row and the rows of smallest hash (``FIGURE_ROWS``, ``FIGURE_POSITIONS`` tokens)."""
        mask = chunk.response_mask
        lengths = (mask.shape[1] - mask.flip(-1).int().argmax(-1)).tolist()

        def row(b: int) -> tuple[Tensor, Tensor, Tensor]:
            n = lengths[b]
            return (chunk.rollout_log_prob[b, :n].clone(), chunk.learner_log_prob[b, :n].clone(),
                    mask[b, :n].clone())

        maxima = row_max.tolist()
        for b, i in enumerate(index.tolist()):
            key = (-maxima[b], i)
            if self.top_row is None or key < self.top_row[:2]:
                self.top_row = (*key, row(b))
            rank = -_hash(i)
            if len(self.sample) >= FIGURE_ROWS and rank <= self.sample[0][0]:
                continue  # not among the smallest hashes
            item = (rank, i, row(b))
            if len(self.sample) < FIGURE_ROWS:
                heapq.heappush(self.sample, item)
            else:
                self.sample_tokens -= len(heapq.heapreplace(self.sample, item)[2][0])
            self.sample_tokens += lengths[b]
            while self.sample_tokens > FIGURE_POSITIONS // 4 and len(self.sample) > 1:
                self.sample_tokens -= len(heapq.heappop(self.sample)[2][0])

    # -- the whole dump -----------------------------------------------------------------------------------------
    def finish(self, info: DumpInfo, path) -> tuple[dict[str, Any], AuditData]:
        from rollcorr.audit.verdict import conclude, reference_token_counts

        order = np.argsort(np.concatenate(self.per_row["index"]), kind="stable")
        row = {k: np.concatenate(v)[order] for k, v in self.per_row.items() if k != "index"}
        n = torch.from_numpy(row["n"].astype(np.float64))
        rows = Rows(n=n, valid=n > 0, num_tokens=n.sum(), num_rows=(n > 0).sum().to(n.dtype),
                    num_pad=torch.zeros((), dtype=torch.float64), verl=False, count_dtype=torch.float32)
        tensor = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
        tot = self.tot
        prob = metric_fns.metrics_to_floats(metric_fns.prob_from_sums(
            rows, p_old_sum=tensor(tot["p_old_sum"]), p_rollout_sum=tensor(tot["p_rollout_sum"]),
            p_old_sq_sum=tensor(tot["p_old_sq_sum"]), p_rollout_sq_sum=tensor(tot["p_rollout_sq_sum"]),
            p_cross_sum=tensor(tot["p_cross_sum"]), d_row_max=torch.from_numpy(row["d_max"]),
            d_row_sum=torch.from_numpy(row["d_sum"]), small_diff_count=tensor(tot["small_diff_count"]),
            ge=[tensor(tot[f"ge{i}"]) for i in range(len(metric_fns.PROB_SHARES))],
        ))
        lr_row = torch.from_numpy(row["lr"])
        div = metric_fns.metrics_to_floats({
            **metric_fns.offpolicy_from_sums(rows, old_row=torch.from_numpy(row["old"]), roll_row=torch.from_numpy(row["roll"]),
                                             lr_row=lr_row, lr_sum=lr_row.sum(), k3_sum=tensor(tot["k3_sum"]),
                                             rho2_sum=tensor(tot["rho2"])),
            **metric_fns.divergence_from_sums(rows, k3_sum=tensor(tot["k3_sum"]), policy_kl_sum=tensor(tot["policy_kl"]),
                                              js_sum=tensor(tot["js"]), e_abs_sum=tensor(tot["e_abs"]), lr_sum=lr_row.sum(),
                                              abs_sum=tensor(tot["abs"])),
        })
        tokens = int(row["n"].sum())
        w = np.exp(np.clip(row["seq"], -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        div.update(
            policy_kl_k1=tot["rho_lr"] / tokens,
            ess_token=tot["rho_sum"] ** 2 / (tokens * tot["rho_sq"]),
            ess_seq=float(w.sum() ** 2 / (len(w) * np.square(w).sum())),
            log_ratio_min=self.lr_min,
            log_ratio_max=self.lr_max,
        )
        lengths = row["n"].astype(np.float64)
        per_response = {
            "max_abs_diff": _distribution(row["max"]),
            "mean_abs_diff": _distribution(row["sum"] / np.maximum(lengths, 1)),
            "length": _distribution(lengths),
        }
        source = {
            "log": str(path), "fields": info.fields, "rows_read": info.total_rows,
            "malformed_rows": [f"line {m.line}: {m.reason}" for m in info.malformed],
        }
        figures = self._figures()
        source["figures"] = (
            f"drawn from {len(figures.response_mask)} of {info.rows} responses (the response with the largest |Δp| "
            "and a fixed sample of the others): the dump is too large to plot whole; every number is from all of them"
        )
        summary: dict[str, Any] = {
            "source": source, "n_responses": info.rows, "n_tokens": tokens,
            "tokens_differing": int(self.tot.get("tokens_differing", 0.0)), "probability": prob,
            "per_response": per_response, "divergence": div, "position": self._profile(),
            "worst_tokens": [{**item, **context[0 if self.prompts_ok else 1]} for *_, item, context in self.worst],
            "verdict_level": levels.verdict_level_from_rows({k: torch.from_numpy(row[k]) for k in levels.THRESHOLDS}, n),
            "k3_level": levels.k3_level(torch.from_numpy(row["k3"]), n),
            "max_over_tokens": {str(c): median_max_over(self.top_abs_diff, tokens, c) for c in reference_token_counts()},
        }
        if (info.complete.get("routed_experts") and info.complete.get("learner_routed_experts") and self.routing
                and not self.routing.get("mismatch")):
            summary["routing"] = routing_result(self.routing)
        elif info.routing_note:  # routing in the dump that cannot be compared: said, not dropped silently
            summary["routing_note"] = info.routing_note
        if self.turns.multi_turn:
            summary["turns"] = self.turns.result()
        conclude(summary)
        return summary, figures

    def _profile(self, n_buckets: int = 20) -> dict[str, list[float]]:
        """``stats.position_profile`` from the per-position sums."""
        count = self.position["count"]
        t = int(np.flatnonzero(count).max()) + 1
        width = -(-t // n_buckets)
        out: dict[str, list[float]] = {"start": [], "end": [], "mean": [], "max": [], "count": []}
        for start in range(0, t, width):
            c = int(count[start : start + width].sum())
            if not c:
                continue
            out["start"].append(start)
            out["end"].append(min(start + width, t))
            out["mean"].append(float(self.position["sum"][start : start + width].sum() / c))
            out["max"].append(float(self.position["max"][start : start + width].max()))
            out["count"].append(c)
        return out

    def _figures(self) -> AuditData:
        """The figures' rows: the worst one first, then the sample in row order, padded to the longest."""
        rows = [self.top_row[2]] + [r for _, i, r in sorted(self.sample, key=lambda s: s[1]) if i != self.top_row[1]]
        while len(rows) > 1 and len(rows) * max(len(r[0]) for r in rows) > FIGURE_POSITIONS:
            rows.pop(max(range(1, len(rows)), key=lambda j: len(rows[j][0])))  # the longest sampled row
        t = max(len(r[0]) for r in rows)

        def pad(j: int, dtype) -> Tensor:
            return torch.stack([torch.cat([r[j], torch.zeros(t - len(r[j]), dtype=dtype)]) for r in rows])

        return AuditData(rollout_log_prob=pad(0, torch.float64), old_log_prob=pad(1, torch.float64),
                         response_mask=pad(2, torch.bool))


def _distribution(x: np.ndarray) -> dict[str, float]:
    """``stats._quantiles``: mean, median, p90, p99 and max of per-row values."""
    median, p90, p99 = quantiles(x, (0.5, 0.9, 0.99))
    return {"mean": float(torch.from_numpy(x).mean()), "median": median, "p90": p90, "p99": p99, "max": float(x.max())}


def _context(tokens: list[str] | None, prompt: Any, position: int, window: int = CONTEXT_TOKENS) -> dict[str, str]:
    """``report.token_context`` for one token, from its row's token texts and prompt."""
    from rollcorr.audit.report import _visible

    if tokens is None:
        return {"before": "", "token": "", "after": ""}
    before = "".join(tokens[max(0, position - window) : position])
    if position < window and isinstance(prompt, str):
        before = prompt[-(window - position) * 4 :] + "│" + before
    return {"before": _visible(before), "token": _visible(tokens[position]),
            "after": _visible("".join(tokens[position + 1 : position + 1 + window]))}
