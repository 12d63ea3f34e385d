import os

import pytest
import torch

# One thread: the tensors in the tests are small, and on a shared 2-core machine extra threads mostly
# contend (measured: 100 tiny forwards 6.8 s with 2 threads vs 0.09 s with 1 under load).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def addition_model_dir(tmp_path_factory):
    """A 2-layer Qwen2 (hidden 64) taught 1-digit addition by 100 supervised steps: ~10 % greedy accuracy.

    The training tests use it so that rewards — hence gradients — are non-zero from the first step and they
    do not depend on the shipped checkpoint. Built once per session (~4 s).
    """
    from transformers import AutoModelForCausalLM

    from rollcorr.models.builtin import build_tokenizer, builtin_config
    from rollcorr.tasks import make_task

    torch.manual_seed(0)
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_config(
        builtin_config(len(tok), hidden_size=64, intermediate_size=256, num_hidden_layers=2)
    )
    task = make_task("addition:1")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(100):
        rows, labels = [], []
        for item in task.sample(64, seed=step, split="train"):
            prompt = tok(item["prompt"], add_special_tokens=False)["input_ids"]
            answer = tok(item["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            rows.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        width = max(map(len, rows))
        ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
        lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
        mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = tmp_path_factory.mktemp("addition_model")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster (2 CPUs) for one test module; start-up is most of a Ray test's cost."""
    ray = pytest.importorskip("ray")
    from rollcorr.train.ray_executor import LOCAL_RAY_ENV

    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def versions():
    """weights(v): the built-in model moved v steps along a fixed random direction (a simulated learner)."""
    from rollcorr.engines import make_sampler

    base = make_sampler("hf:fp32").float_model.state_dict()
    g = torch.Generator().manual_seed(0)
    direction = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in base.items()}
    return lambda v: {k: base[k] + v * direction[k] for k in base}


@pytest.fixture
def alternating_rewards(monkeypatch):
    """Training batches rewarded 1, 0, 1, 0, … by row, whatever tokens were sampled.

    Groups are consecutive rows of an even size, so every group holds both rewards: advantages — hence the
    gradient — are non-zero by construction on any CPU (torch's float kernels differ between AVX2, AVX512
    and the default build, so the same seed samples different tokens, and a tiny model's real reward can be
    uniform over a whole mini-batch). The reward depends on the row only, so a resumed run sees the same
    rewards. For tests of the training mechanics, not of learning; greedy evaluation keeps the task's real
    reward; in-process only (the sampler process of trainer.mode=async and Ray workers score with the real
    reward).
    """
    from rollcorr.train.source import RolloutSource

    def alternate(self, rollout):
        rows = torch.arange(rollout.response_ids.shape[0])
        return rollout.replace(rewards=(rows % 2 == 0).float())

    monkeypatch.setattr(RolloutSource, "reward", alternate)


@pytest.fixture
def protocol_held():
    """``check(protocol, protocol_commit, results_dir, run_folders)``: a pre-registered study's protocol file is
    unchanged since ``protocol_commit`` (the commit that added it), ``results_dir/results.json`` records that
    commit, it is an ancestor of HEAD, and every run file in ``run_folders`` was made by a descendant of it.
    Skips outside a git checkout or when the history is too shallow to find the commit."""
    import json
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> int:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).returncode

    def check(protocol, protocol_commit, results_dir: Path, run_folders=("runs",)) -> None:
        if shutil.which("git") is None or git("rev-parse", "HEAD") != 0:
            pytest.skip("not a git checkout")
        if protocol_commit is None:
            pytest.skip("the protocol is not committed yet (or history is shallow)")
        assert git("diff", "--quiet", protocol_commit, "HEAD", "--", str(protocol)) == 0, "the protocol was edited"
        assert git("merge-base", "--is-ancestor", protocol_commit, "HEAD") == 0
        results = results_dir / "results.json"
        if results.is_file():
            assert json.loads(results.read_text())["summary"]["protocol_commit"] == protocol_commit
        for folder in run_folders:
            for path in (results_dir / folder).glob("*.json"):
                commit = json.loads(path.read_text())["code_commit"]
                assert git("merge-base", "--is-ancestor", protocol_commit, commit) == 0, path.name

    return check
