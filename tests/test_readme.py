"""The README's library example runs as written (on random log-probs)."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_library_example_runs():
    code = re.search(r"## As a library\s+```python\n(.*?)```", README.read_text(), re.S).group(1)
    g = torch.Generator().manual_seed(0)
    b, t = 4, 12
    rollout_log_prob = -torch.rand(b, t, generator=g) * 3
    old_log_prob = rollout_log_prob + 0.01 * torch.randn(b, t, generator=g)
    old_log_prob = old_log_prob.clamp(max=0.0)
    log_prob = old_log_prob.clone().requires_grad_(True)
    response_mask = torch.ones(b, t, dtype=torch.bool)
    response_mask[0, 8:] = False
    advantages = torch.randn(b, 1, generator=g).expand(b, t)
    scope = {
        "old_log_prob": old_log_prob,
        "rollout_log_prob": rollout_log_prob,
        "log_prob": log_prob,
        "response_mask": response_mask,
        "advantages": advantages,
        "print": lambda *a, **k: None,
    }
    exec(compile(code, str(README), "exec"), scope)
    loss = scope["loss"]
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(log_prob.grad).all()
