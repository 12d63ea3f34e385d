import math
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

    def alternate(self, rollout, episodes=None):
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


# ---- the fused correction path ------------------------------------------------------------------------------
class EveryVariant:
    """A ``fused._state["warm"]`` that holds every kernel variant: as if ``fused.warm`` had run for each."""

    def __contains__(self, key) -> bool:
        return True


@pytest.fixture
def kernel_calls(monkeypatch):
    """Take the fused (compiled) statistics on any batch size, as a process that ran ``fused.warm`` does, with the
    kernel function run eagerly (``_row_pass`` is pure; tests/test_correction_perf_fused.py compiles it); the
    list of the kernel's calls."""
    from rollcorr.correction import fused

    calls = []

    def counted(*args):
        calls.append(args)
        return fused._row_pass(*args)

    monkeypatch.setattr(fused, "MIN_POSITIONS", 0)
    monkeypatch.setitem(fused._state, "compiled", counted)
    monkeypatch.setitem(fused._state, "warm", EveryVariant())
    return calls


def on_default_path(monkeypatch, fn, *args, **kw):
    """``fn(*args, **kw)`` on the default statistics (the built kernel where it serves, else plain torch): no
    compiled kernel warmed."""
    from rollcorr.correction import fused

    with monkeypatch.context() as m:
        m.setitem(fused._state, "warm", set())
        return fn(*args, **kw)


@pytest.fixture
def plain_torch(monkeypatch):
    """The plain-torch statistics pass (correction/statistics.py) for every batch: the built kernel
    (correction/native.py) is not used, as in a process where it was not built."""
    from rollcorr.correction import native

    monkeypatch.setitem(native._state, "loaded", False)


# ---- float tolerances -------------------------------------------------------------------------------------
# torch picks its float kernels by CPU (ATEN_CPU_CAPABILITY=default / avx2 / avx512), so two float32 paths that
# are equal in exact arithmetic differ by an amount that no number tuned on one machine bounds. The rule of
# this suite: a bound derived from the arithmetic — a float64 reference and a bound in units of ε₃₂ × the
# reduction length, or each float32 path's error measured against a float64 reference (assert_as_accurate).

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7: float32's unit of relative rounding
# How much less accurate than the established float32 path the one under test may be. Both run the same
# float32 operations in another order (another batch split, kernel or fusion), so their errors against float64
# are of one size: the ratios seen on default, AVX2 and AVX512 kernels stay under 3. 8 leaves room for that
# spread and still fails a real bug, whose error (a wrong position id or gradient average: 1e-2 and more) is
# thousands of times a float32 path's rounding.
ERROR_RATIO = 8
# Sanity bound on an established float32 forward itself (assert_as_accurate's ``sanity``, relative to ‖ref‖):
# the small models here round log-probs and gradients by ~1e-6 relative on any kernels; 1e-4 flags a precision
# fault (a bf16 cast, a float32 cast of a float64 path) and stays far below a real error (1e-2 and more).
FORWARD_SANITY = 1e-4


def _as_float64(x) -> torch.Tensor:
    if isinstance(x, (list, tuple)):
        return torch.cat([_as_float64(v).flatten() for v in x]) if len(x) else torch.zeros(0, dtype=torch.float64)
    if not isinstance(x, torch.Tensor):
        return torch.tensor(x, dtype=torch.float64)  # a Python float is float64: no float32 detour
    return x.detach().to(torch.float64).cpu()


def assert_as_accurate(got, established, reference, *, floor=None, sanity=None, ratio=ERROR_RATIO, what=""):
    """The float32 path ``got`` is about as accurate as the ``established`` float32 path, both measured
    against ``reference`` (the same computation in float64), in the Euclidean norm:

        ‖got − ref‖ ≤ ratio · ‖established − ref‖ + floor          floor: 4 ε₃₂ ‖ref‖ unless given

    (the floor covers an established path that happens to round almost exactly). ``sanity``: also require
    ‖established − ref‖ ≤ sanity, a loose bound that the established path is sound itself. Tensors, floats or
    lists of them (concatenated, flattened).
    """
    got, established, reference = _as_float64(got), _as_float64(established), _as_float64(reference)
    assert got.shape == established.shape == reference.shape, what
    ref_norm = float(reference.norm())
    floor = 4 * EPS32 * ref_norm if floor is None else floor
    err_got, err_est = float((got - reference).norm()), float((established - reference).norm())
    assert err_got <= ratio * err_est + floor, (
        f"{what}: error {err_got:.3g} vs float64, > {ratio} × the established path's {err_est:.3g} + {floor:.3g}"
        f" (‖ref‖ = {ref_norm:.3g})"
    )
    if sanity is not None:
        assert err_est <= sanity, f"{what}: the established path is {err_est:.3g} from float64, > {sanity:.3g}"


@pytest.fixture
def float64_reference(monkeypatch):
    """``with float64_reference(): …``: a model cast to float64 (``model.double()``) computes in float64 inside.

    transformers' Qwen2 / Llama / Qwen3-MoE RMSNorm and eager attention, and rollcorr's LlamaBlocks (the
    shared-prompt and static-KV path), round their norm / softmax to float32 whatever the input dtype. In
    float64 that is float32 rounding inside the reference — and NaN: the float64 mask value (−1.8e308) becomes
    −inf in float32, so a fully masked (padding) row's softmax is 0/0. Inside the context a float64 input stays
    float64 there; float32 inputs are computed as before. The rotary cos/sin stay float32 values (computed from
    the float32 inverse frequencies, then cast): every path uses that same table, so it is part of the model.
    """
    import contextlib

    import torch.nn.functional as F

    def keep_float64(softmax):
        def wrapped(x, *args, dtype=None, **kwargs):
            return softmax(x, *args, dtype=None if x.dtype == torch.float64 else dtype, **kwargs)

        return wrapped

    def rms_norm(self, hidden_states):
        if hidden_states.dtype != torch.float64:
            return original[type(self)](self, hidden_states)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    original = {cls: cls.forward for cls in (Qwen2RMSNorm, LlamaRMSNorm, Qwen3MoeRMSNorm)}

    @contextlib.contextmanager
    def context():
        with monkeypatch.context() as m:
            m.setattr(torch, "softmax", keep_float64(torch.softmax))
            m.setattr(F, "softmax", keep_float64(F.softmax))
            for cls in original:
                m.setattr(cls, "forward", rms_norm)
            # the patch took: a float64 norm and softmax are float64-exact (float32 would be off by ~1e-8)
            x = torch.linspace(-1, 1, 7, dtype=torch.float64) / 3
            norm = Qwen2RMSNorm(7).double()
            assert torch.equal(norm(x), x * torch.rsqrt(x.pow(2).mean() + norm.variance_epsilon))
            assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float64
            yield

    return context


def log_softmax_bound(z) -> float:
    """Rounding of a float32 log-softmax / log-sum-exp over the last dim of ``z`` (n terms): the n-term sum of
    e^{z − max} ∈ [1, n] is off by ≤ n ε₃₂/2 relative (Higham's γ_n), i.e. absolutely in its log; the shift,
    each exp, the log and the final subtraction round once more, on values ≤ 2 max|z|: ε₃₂ (n + 4 max|z|)."""
    return EPS32 * (z.shape[-1] + 4 * float(z.abs().max()))


def processed64(logits, params, kept):
    """(log μ (…, V), log kept mass (…)) of the processed distribution in float64 over the token set ``kept``
    that ``process_logits`` chose (a float32 decision both compared paths share): ``process_logits`` itself
    computes in float32 whatever its input (engines/base.py), so the float64 reference is written out here."""
    z = logits.double() / (1.0 if params.greedy else params.temperature)
    log_p = torch.log_softmax(z, dim=-1)
    log_kept = torch.logsumexp(log_p.masked_fill(~kept, -math.inf), dim=-1)
    if params.greedy:  # μ = one-hot(argmax), kept mass p(argmax) of the untempered distribution
        return torch.where(kept, 0.0, -math.inf).double(), log_kept
    return (log_p - log_kept[..., None]).masked_fill(~kept, -math.inf), log_kept


def forward_rounding(config) -> float:
    """Relative rounding of one float32 forward's log-probs, for a transformers model ``config``: Higham's γ_n
    (n ε₃₂) for a dot product of length ≤ n (the longest: hidden or MLP width), through the L layers and the
    head: (L + 1) n ε₃₂. Two float32 forwards of the same weights (two engines, two batch layouts) differ by
    at most twice that, relative to max(|log p|, 1); in probability (p |Δ log p| with p ≤ 1) by at most twice
    that absolutely. For a bound where no float64 reference is at hand (a run's logged metrics)."""
    n = max(config.hidden_size, getattr(config, "intermediate_size", 0) or 0)
    return (config.num_hidden_layers + 1) * n * EPS32


def assert_same_forward(got, expected, config, what="") -> None:
    """Two float32 forwards of the same weights over the same tokens (another batch layout, a sharded model, a
    strategy's copy of the weights): per token |Δ log p| ≤ 2 · forward_rounding(config) · max(|log p|, 1) —
    the arithmetic's bound, whatever kernels the CPU picks; a wrong weight or routing is off by 1e-3 and more."""
    got, expected = got.detach().double(), expected.detach().double()
    bound = 2 * forward_rounding(config) * expected.abs().clamp(min=1.0)
    excess = ((got - expected).abs() - bound).max()
    assert float(excess) <= 0, f"{what}: a log-prob is off by more than two float32 forwards' rounding"


def metric_floor(reference: float, n: int, *, std: bool = False) -> float:
    """The rounding one float32 metric may carry from a length-``n`` reduction (Higham's γ_n: n ε₃₂ of the
    terms' size), on terms of size max(|value|, 1): a metric that cancels to ≈ 0 (a KL, a mean log-ratio)
    still carries its O(1) terms' rounding; one that is exp of a reduction (a perplexity, an IS weight's
    moments) rounds relatively by its exponent's absolute error, up to max(|log |value||, 1) times more.
    ``std``: sqrt(E[x²] − E[x]²) — a variance off by δ moves it by sqrt(v + δ) − sqrt(v), up to sqrt(δ) where
    the variance is ≈ 0."""
    scale = max(abs(reference), 1.0) * max(abs(math.log(abs(reference))) if reference else 0.0, 1.0)
    if not std:
        return n * EPS32 * scale
    delta = n * EPS32 * scale**2
    return (reference**2 + delta) ** 0.5 - abs(reference)


def assert_metrics_as_accurate(got: dict, established: dict, reference: dict, *, n: int, keys=None, what="",
                               sanity_rel=None) -> None:
    """``assert_as_accurate`` for each float metric of ``reference`` (non-finite ones must match exactly), with
    ``metric_floor(…, n)`` as the floor (keys ending in ``_std`` as standard deviations). ``sanity_rel``: the
    established path within that share of max(|value|, 1) of the reference."""
    import math

    for key in reference if keys is None else keys:
        r, a, b = (float(m[key]) for m in (reference, established, got))
        if not (math.isfinite(r) and math.isfinite(a)):
            assert (b == a) or (math.isnan(b) and math.isnan(a)), f"{what}{key}: {b} vs {a}"
            continue
        sanity = None if sanity_rel is None else sanity_rel * max(abs(r), 1.0)
        assert_as_accurate(b, a, r, floor=metric_floor(r, n, std=key.endswith("_std")), sanity=sanity,
                           what=f"{what}{key}")
