"""The audit's suggested commands survive copy and paste, and its tables never cut a number: each command is
printed whole on a line of its own at any width (rich wrapped them at 80 columns, and a pasted half trained with
the default correction), --from-run's included; report.html shows them as code blocks with a copy button."""

import json
import os
import re
import shlex
import subprocess
import sys
from io import StringIO
from pathlib import Path

import torch
from rich.console import Console

from rollcorr.audit import AuditData, write_report
from rollcorr.audit.report import print_summary
from rollcorr.cli import main

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _printed_commands(text: str) -> list[tuple[str, str]]:
    """(label, the line after it) for each "<label>:" line the summary prints before a command."""
    lines = ANSI.sub("", text).splitlines()
    return [(lines[i][:-1], lines[i + 1]) for i in range(len(lines) - 1) if lines[i + 1].startswith("  rollcorr ")]


def _run_pasted(line: str, cwd: Path) -> subprocess.CompletedProcess:
    """The line as a shell reads it when pasted; a `rollcorr train` line checks and prints its config instead
    of training for 600 steps (--print-config reads and checks every key the line sets)."""
    line = line.strip().replace("rollcorr ", f"{shlex.quote(sys.executable)} -m rollcorr ", 1)
    if " -m rollcorr train " in line:
        line += " --print-config"
    return subprocess.run(["bash", "-c", line], cwd=cwd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])})


def test_at_60_columns_the_printed_command_is_one_line_that_runs_as_pasted(tmp_path):
    """`rollcorr audit` in a 60-column output (COLUMNS=60, not a terminal): the command after "Apply it:" is
    the one in summary.json, whole on its line; pasted into a shell, the trainer takes it. The same at 60 columns
    in a terminal (rich's colours stripped)."""
    done = subprocess.run([sys.executable, "-m", "rollcorr", "audit", "-n", "8", "--max-new-tokens", "6", "--out",
                           str(tmp_path / "audit")], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "COLUMNS": "60"})
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "audit/summary.json").read_text())
    assert summary["commands"] and summary["commands"][-1]["label"] == "Apply it"
    assert _printed_commands(done.stdout) == [(c["label"], "  " + c["command"]) for c in summary["commands"]]
    line = _printed_commands(done.stdout)[-1][1]
    assert len(line) > 60 and line.strip() == "rollcorr train model.sampler=hf:bf16 model.learner=hf:fp32 " \
        "algorithm.correction.preset=tis"
    pasted = _run_pasted(line, tmp_path)
    assert pasted.returncode == 0, pasted.stderr[-2000:]
    assert "sampler: hf:bf16" in pasted.stdout and "learner: hf:fp32" in pasted.stdout
    terminal = Console(width=60, file=StringIO(), force_terminal=True, color_system="standard")
    print_summary(summary, terminal)
    assert "\x1b[" in terminal.file.getvalue()  # a terminal's output, with its colours
    assert _printed_commands(terminal.file.getvalue()) == _printed_commands(done.stdout)
    page = (tmp_path / "audit/report.html").read_text()
    assert f"<pre><code>{summary['commands'][-1]['command']}</code></pre><button type='button' onclick=" in page


def test_from_run_commands_are_whole_and_run_as_pasted_and_step_0_is_the_starting_model(tmp_path):
    """--from-run RUN --step 0 audits the run's starting model (it has no checkpoint of step 0); its "Apply it"
    trains the run's own config with the preset into a new folder, its other commands audit the run again:
    each printed whole at 60 columns, each taken by rollcorr as pasted."""
    run = tmp_path / "run"
    assert main(["train", "trainer.steps=1", "trainer.eval_every=0", "trainer.progress=false", "trainer.plot=false",
                 "rollout.prompts_per_step=2", "rollout.max_new_tokens=4", "task.eval_prompts=0",
                 f"trainer.out={run}"]) == 0
    out = tmp_path / "audit"
    assert main(["audit", "--from-run", str(run), "--step", "0", "-n", "8", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["source"]["step"] == 0 and summary["source"]["model"] == "builtin"  # config.yaml's model.path
    apply = next(c["command"] for c in summary["commands"] if c["label"] == "Apply it")
    assert apply == (f"rollcorr train --config {run}/config.yaml --out {run}-{summary['suggested_preset']} "
                     f"model.sampler=hf:bf16 model.learner=hf:fp32 algorithm.correction.preset={summary['suggested_preset']}")
    console = Console(width=60, file=StringIO())
    print_summary(summary, console)
    printed = _printed_commands(console.file.getvalue())
    assert printed == [(c["label"], "  " + c["command"]) for c in summary["commands"]]
    for _, line in printed:
        pasted = _run_pasted(line, tmp_path)
        assert pasted.returncode == 0, (line, pasted.stderr[-2000:])


def test_tables_never_cut_a_number_when_narrow_or_redirected(tmp_path):
    """At 60 columns, not a terminal: every value of the summary and what-if tables is printed whole (rich cut
    the what-if table's k3 "2.049e-06" to "2.049…" at 80); a label may wrap."""
    g = torch.Generator().manual_seed(0)
    log_mu = torch.empty(16, 8).uniform_(0.2, 0.8, generator=g).log()
    data = AuditData(log_mu, log_mu + 0.012 * torch.randn(16, 8, generator=g), torch.ones(16, 8, dtype=torch.bool),
                     source={"sampler": "hf:bf16", "learner": "hf:fp32", "model": "builtin"})
    data.diagnosis = {"whatif": [{"change": "lm_head_fp32", "sampler": "hf:bf16", "prob_diff_frac_lt_1e-3": 0.5476,
                                  "prob_diff_frac_ge_0.01": 0.0952, "prob_diff_frac_ge_0.05": 0.0,
                                  "prob_diff_max": 0.03971, "prob_diff_mean": 0.003312, "k3_kl": 2.049e-06,
                                  "n_tokens": 128, "verdict_level": "bf16"}]}
    summary = write_report(data, tmp_path / "r")
    console = Console(width=60, file=StringIO())
    print_summary(summary, console)
    text = console.file.getvalue()
    from rollcorr.audit.report import summary_rows, whatif_rows

    values = [v for *_, v in summary_rows(summary)] + [v for row in whatif_rows(summary) for v in row[2:-1]]
    assert "2.049e-06" in values
    missing = [v for v in values if v not in text]
    assert not missing and "…" not in text, missing
