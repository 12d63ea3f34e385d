"""``rollcorr audit``: measure how far the sampler's token probabilities are from the learner's.

collect (sample + score, or read a dump) → stats (pure functions on (B, T) log-probs) → plots (PNGs) →
report (summary.json, report.html, a rich table). The CLI is in ``rollcorr.audit.cli``.
"""

from rollcorr.audit.collect import AuditData, builtin_prompts, collect, from_log, from_rollout, load_prompts
from rollcorr.audit.report import build_summary, print_summary, render_html, write_report
from rollcorr.audit.stats import audit_stats

__all__ = [
    "AuditData",
    "audit_stats",
    "build_summary",
    "builtin_prompts",
    "collect",
    "from_log",
    "from_rollout",
    "load_prompts",
    "print_summary",
    "render_html",
    "write_report",
]
