"""The README's and the docs' examples run as written and do what their text says."""

import contextlib
import io
import re
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def library_snippet() -> str:
    return re.search(r"## As a library\s+```python\n(.*?)```", README.read_text(), re.S).group(1)


def test_readme_library_example_runs_on_its_own_data_and_gives_a_loss():
    code = library_snippet()
    scope: dict = {}
    printed = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
        warnings.simplefilter("error")  # no AllRejectedWarning: the preset keeps the example's sequences
        exec(compile(code, str(README), "exec"), scope)
    loss, log_prob = scope["loss"], scope["log_prob"]
    assert torch.isfinite(loss) and loss.item() != 0.0
    assert torch.isfinite(log_prob.grad).all() and log_prob.grad.abs().sum() > 0
    # the value printed is the one the comment shows, and "it keeps all four" holds
    shown = float(re.search(r"# loss (-?[0-9.]+)", code).group(1))
    assert printed.getvalue().splitlines()[0] == f"loss {shown:.4f}"
    assert torch.equal(scope["corr"].mask.bool(), scope["response_mask"].bool())


def test_readme_geo_rs_remark_holds_on_the_example_data():
    """"On this example's 0.01-nat mismatch they reject every sequence and the loss is 0, with a warning"."""
    from rollcorr.config.presets import PRESETS, preset
    from rollcorr.correction import AllRejectedWarning, compute_correction

    scope: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(library_snippet(), str(README), "exec"), scope)
    for name in (n for n in PRESETS if "geo_rs" in n and n.startswith("decoupled")):
        with pytest.warns(AllRejectedWarning):
            corr = compute_correction(scope["old_log_prob"], scope["rollout_log_prob"], scope["response_mask"],
                                      preset(name))  # fmt: skip
        assert not corr.mask.any(), name
