"""rollcorr.proximal: every strategy against exact old logits on a tiny model trained across versions."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from transformers import Qwen2ForCausalLM

from conftest import FORWARD_SANITY, assert_as_accurate, assert_metrics_as_accurate, metric_floor
from rollcorr.models.builtin import builtin_config
from rollcorr.proximal import (
    EWMA,
    STRATEGIES,
    ProximalResult,
    ProximalStrategy,
    SnapshotStore,
    discrepancy_drift,
    interpolation_alpha,
    lag_beta,
    make_proximal,
    old_logit_error,
)
from rollcorr.proximal.scoring import model_bytes
from rollcorr.rollout import Rollout

P, T = 4, 8


# ---- a tiny learner: private forward, used only until/unless the hf engine is importable ----------------
class TinyLearner:
    def __init__(self, model):
        self.model = model

    def log_prob(self, rollout, *, temperature=1.0, with_entropy=False, grad=False):
        attn = rollout.attention_mask.long()
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        with torch.set_grad_enabled(grad):
            logits = self.model(input_ids=rollout.input_ids, attention_mask=attn, position_ids=pos).logits
            p = rollout.prompt_ids.shape[1]
            logits = logits[:, p - 1 : p - 1 + rollout.response_ids.shape[1]]
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # float64 stays
            return logits.log_softmax(-1).gather(-1, rollout.response_ids[..., None]).squeeze(-1)

    def state_dict(self):
        return self.model.state_dict()


def _vocab():
    try:
        from rollcorr.models.builtin import build_tokenizer

        return len(build_tokenizer())
    except ImportError:
        return 40


VOCAB = _vocab()


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = builtin_config(
        VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64
    )
    model = Qwen2ForCausalLM(cfg).eval()
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 saved as a HF directory (with the built-in tokenizer) for the hf learner."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_model().save_pretrained(path)
    try:
        from rollcorr.models.builtin import build_tokenizer

        build_tokenizer().save_pretrained(path)
    except ImportError:
        pass
    return path


@pytest.fixture(scope="module")
def make_learner(model_dir):
    """learner(seed): the hf engine's Learner when it exists (else the private TinyLearner), random weights."""
    try:
        from rollcorr.engines.hf import HFLearner
    except ImportError:
        HFLearner = None

    template = None if HFLearner is None else HFLearner(model_dir, device="cpu")

    def build(seed=0):
        model = tiny_model(seed)
        if template is None:
            return TinyLearner(model)
        learner = copy.deepcopy(template)  # loading from disk once is enough
        learner.model.load_state_dict(model.state_dict())
        return learner

    return build


def make_rollout(version, seed=0, lengths=None, rollout_log_prob=None):
    g = torch.Generator().manual_seed(seed)
    b = version.shape[0]
    lengths = lengths if lengths is not None else [T - (i % 3) for i in range(b)]
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    prompt_mask = torch.ones(b, P, dtype=torch.bool)
    prompt_mask[0, :2] = False  # one left-padded prompt
    prompt_ids = torch.randint(1, VOCAB, (b, P), generator=g).masked_fill(~prompt_mask, 0)
    response_ids = torch.randint(1, VOCAB, (b, T), generator=g).masked_fill(~mask, 0)
    if rollout_log_prob is None:
        rollout_log_prob = -torch.rand(b, T, generator=g) * 3
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=mask,
        rollout_log_prob=rollout_log_prob.masked_fill(~mask, 0),
        version=version.masked_fill(~mask, 0),
        group_ids=torch.arange(b),
    )


def sgd_step(learner, seed):
    """One SGD step on a random REINFORCE-like loss: moves the weights to a new version."""
    g = torch.Generator().manual_seed(1000 + seed)
    r = make_rollout(torch.zeros(4, T, dtype=torch.long), seed=1000 + seed)
    opt = torch.optim.SGD(learner.model.parameters(), lr=0.5)
    lp = learner.log_prob(r, grad=True)
    adv = torch.randn(4, 1, generator=g)
    loss = -(adv * lp * r.response_mask).sum() / r.response_mask.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def exact_reference(states, model, rollout, temperature=1.0, dtype=torch.float32):
    """Independent exact old logits: a fresh copy per version, each token picks its own version (``dtype``:
    the copies cast to it; float64 inside conftest's ``float64_reference``: the reference of the reference)."""
    out = torch.zeros(rollout.response_ids.shape, dtype=dtype)
    for v, state in states.items():
        twin = copy.deepcopy(model)
        twin.load_state_dict(state)
        lp = TinyLearner(twin.to(dtype)).log_prob(rollout, temperature=temperature).detach()
        out = torch.where(rollout.version == v, lp, out)
    return out.masked_fill(~rollout.response_mask, 0)


def assert_exact_old_logits(got, states, model, rollout, float64_reference, where=None):
    """``got`` (a strategy's π_old, the hf learner's forward) is the exact old logits: as close to their float64
    values as ``exact_reference``'s own float32 forward (transformers' full logits) is, on the valid tokens
    (and ``where``; without it, 0 on padding too). The two forwards differ by float rounding alone, which
    depends on the CPU's kernels."""
    mask = rollout.response_mask if where is None else rollout.response_mask & where
    if where is None:
        assert not got[~rollout.response_mask].any(), "π_old is 0 on padding"
    established = exact_reference(states, model, rollout)
    with float64_reference():
        exact = exact_reference(states, model, rollout, dtype=torch.float64)
    assert_as_accurate(got[mask], established[mask], exact[mask], sanity=FORWARD_SANITY * float(exact[mask].norm()),
                       what="old log-probs")
    return established, exact


def assert_error_metrics(got, old_log_prob, established, exact, mask):
    """A strategy's measured error (``old_logit_error`` against its own exact π_old) against the same metrics
    from ``exact_reference``'s float32 and float64 values: means and maxima over the valid tokens."""
    want, want64 = (old_logit_error(old_log_prob, x, mask) for x in (established, exact))
    assert got.keys() == want.keys()
    assert_metrics_as_accurate(got, want, want64, n=int(mask.sum()))


def partial_versions(current, k, b=6, seed=0):
    """(B, T) non-decreasing versions per row in [current − k, current]: partial rollouts span versions."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(max(current - k, 0), current + 1, (b, 1), generator=g)
    steps = (torch.rand(b, T, generator=g) < 0.3).long().cumsum(1)
    return torch.minimum(start + steps, torch.tensor(current))


@pytest.fixture(scope="module")
def run(make_learner):
    """A tiny async run: publish v0..v3 (one SGD step per version); every strategy sees the same hooks."""
    torch.manual_seed(0)
    learner = make_learner(0)
    model = learner.model
    names = ["recompute", "bypass", "snapshot", "old_logit_model", "interrupt", "loglinear", "linear", "ewma"]
    strategies = {n: make_proximal(n, max_staleness=3, measure_error=(n != "snapshot")) for n in names}
    states = {}
    for v in range(4):
        states[v] = {k: t.clone() for k, t in model.state_dict().items()}
        for s in strategies.values():
            s.on_publish(v, model)
        if v < 3:
            # a trained batch with lags 0..3 (mean 1.5: EWMA's β = 1.5 / 2.5 = 0.6), every token kept
            lags = torch.tensor([0, 1, 2, 3])[:, None].expand(4, T)
            trained = kept(make_rollout(v - lags, lengths=[T] * 4), v, 1.0)
            for s in strategies.values():
                s.after_correction(trained, v)
            sgd_step(learner, v)
            for s in strategies.values():
                s.after_optimizer_step(model)
    rollout = make_rollout(partial_versions(3, 3))
    yield {"model": model, "learner": learner, "strategies": strategies, "states": states, "rollout": rollout}
    strategies["old_logit_model"].close()


def test_snapshot_is_exact(run, float64_reference):
    r = run["rollout"]
    assert len(set(r.version[r.response_mask].tolist())) >= 3  # the batch really spans versions
    res = run["strategies"]["snapshot"].old_log_prob(r, run["learner"], 3)
    assert isinstance(res, ProximalResult)
    assert_exact_old_logits(res.old_log_prob, run["states"], run["model"], r, float64_reference)
    assert not res.old_log_prob.requires_grad
    assert res.extra_bytes >= run["strategies"]["snapshot"].store.nbytes > 0
    assert res.metrics["versions_scored"] == len(set(r.version[r.response_mask].tolist()))
    # a different version assignment gives different values: the check above can fail
    assert not torch.allclose(
        res.old_log_prob,
        exact_reference(
            {3: run["states"][3]}, run["model"], r.replace(version=torch.full_like(r.version, 3))
        ),
    )


def test_recompute_is_current_forward_and_reports_error(run, float64_reference):
    r = run["rollout"]
    res = run["strategies"]["recompute"].old_log_prob(r, run["learner"], 3)
    live = run["learner"].log_prob(r).detach().masked_fill(~r.response_mask, 0)
    torch.testing.assert_close(res.old_log_prob, live, atol=0, rtol=0)
    exact = exact_reference(run["states"], run["model"], r)
    with float64_reference():
        exact64 = exact_reference(run["states"], run["model"], r, dtype=torch.float64)
    assert_error_metrics(res.error, live, exact, exact64, r.response_mask)
    assert res.error["logp_abs_err_mean"] > 1e-4  # stale tokens: recompute is not π_train(v_gen)
    share = float((r.version[r.response_mask] == 3).float().mean())
    assert res.metrics["exact_token_fraction"] == pytest.approx(share)


def test_bypass_is_mu_and_its_error_is_the_discrepancy(run, float64_reference):
    r = run["rollout"]
    res = run["strategies"]["bypass"].old_log_prob(r, run["learner"], 3)
    assert torch.equal(res.old_log_prob, r.rollout_log_prob)
    exact = exact_reference(run["states"], run["model"], r)
    with float64_reference():
        exact64 = exact_reference(run["states"], run["model"], r, dtype=torch.float64)
    assert_error_metrics(res.error, r.rollout_log_prob, exact, exact64, r.response_mask)  # d = |exact − μ|
    with pytest.raises(ValueError, match="sampler's log-probs"):
        run["strategies"]["bypass"].old_log_prob(r.replace(rollout_log_prob=None), run["learner"], 3)
    nan = r.rollout_log_prob.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        run["strategies"]["bypass"].old_log_prob(r.replace(rollout_log_prob=nan), run["learner"], 3)


def test_interpolation_follows_areal_formulas(run):
    r = run["rollout"]
    live = run["learner"].log_prob(r).detach()
    alpha = interpolation_alpha(r.version, 3)
    gap = 3 - r.version
    # α = (gap − 1)/gap: 0 for gap 0 and 1, 1/2 for gap 2, 2/3 for gap 3
    for g, a in [(0, 0.0), (1, 0.0), (2, 0.5), (3, 2 / 3)]:
        if (gap == g).any():
            assert torch.allclose(alpha[gap == g], torch.tensor(a))
    mu, m = r.rollout_log_prob, r.response_mask
    res_ll = run["strategies"]["loglinear"].old_log_prob(r, run["learner"], 3)
    torch.testing.assert_close(res_ll.old_log_prob, (mu + alpha * (live - mu)).masked_fill(~m, 0))
    res_l = run["strategies"]["linear"].old_log_prob(r, run["learner"], 3)
    manual = torch.log((1 - alpha) * mu.exp() + alpha * live.exp()).masked_fill(~m, 0)
    torch.testing.assert_close(res_l.old_log_prob, manual)
    one_behind = m & (gap == 1)
    assert torch.equal(res_ll.old_log_prob[one_behind], mu[one_behind])  # α = 0 → μ
    for res in (res_ll, res_l):  # errors are measured, finite, bounded by the μ/π_θ envelope
        assert res.error is not None and 0 < res.error["logp_abs_err_mean"] < 10
        assert res.metrics["alpha_mean"] == pytest.approx(float(alpha[m].mean()))


def split_rollout(full, cut):
    """(partial, finished): the first ``cut`` tokens generated at v0, the rest at v1 (a partial rollout)."""
    b = full.batch_size
    partial = Rollout(
        prompt_ids=full.prompt_ids,
        prompt_mask=full.prompt_mask,
        response_ids=full.response_ids[:, :cut],
        response_mask=full.response_mask[:, :cut],
        rollout_log_prob=full.rollout_log_prob[:, :cut],
        version=torch.zeros(b, cut, dtype=torch.long),
        group_ids=full.group_ids,
    )
    version = (torch.arange(T) >= cut).long().expand(b, T)
    return partial, full.replace(version=version.masked_fill(~full.response_mask, 0))


def test_old_logit_model_scores_in_background_and_is_exact(make_learner, float64_reference):
    learner = make_learner(1)
    model = learner.model
    strat = make_proximal("old_logit_model", max_staleness=2)
    states = {0: copy.deepcopy(model.state_dict())}
    strat.on_publish(0, model)
    batches = [make_rollout(torch.zeros(5, T, dtype=torch.long), seed=s) for s in range(3)]
    for b in batches:  # samples arrive while the learner trains
        strat.submit(b, learner)
    partial, finished = split_rollout(make_rollout(torch.zeros(4, T, dtype=torch.long), seed=11), cut=3)
    strat.submit(partial, learner)  # a partial rollout, handed over before the weights move on
    sgd_step(learner, 0)
    strat.on_publish(1, model)  # queued after the submitted rollouts: they are scored with v0
    states[1] = copy.deepcopy(model.state_dict())
    late = make_rollout(torch.ones(5, T, dtype=torch.long), seed=9)
    strat.submit(late, learner)
    for b in [*batches, late, finished]:
        res = strat.old_log_prob(b, learner, 1)
        assert_exact_old_logits(res.old_log_prob, states, model, b, float64_reference)
        assert res.metrics["exact_token_fraction"] == 1.0
    assert res.extra_bytes == model_bytes(model) + 4 * len(strat.store)
    assert res.metrics["background_seconds"] > 0 and res.metrics["stored_tokens"] > 0
    # a partial rollout spanning v0/v1 that was never submitted: its v0 tokens are flagged inexact
    mixed = make_rollout(partial_versions(1, 1, b=5, seed=3), seed=4)
    res = strat.old_log_prob(mixed, learner, 1)
    share = float((mixed.version[mixed.response_mask] == 1).float().mean())
    assert res.metrics["exact_token_fraction"] == pytest.approx(share) and share < 1
    assert_exact_old_logits(res.old_log_prob, states, model, mixed, float64_reference, where=mixed.version == 1)
    strat.close()


def test_interrupt_is_exact_for_interrupted_tokens(make_learner, float64_reference):
    learner = make_learner(2)
    model = learner.model
    strat = make_proximal("interrupt", max_staleness=2)
    strat.on_publish(0, model)
    v0 = copy.deepcopy(model.state_dict())
    partial, finished = split_rollout(make_rollout(torch.zeros(4, T, dtype=torch.long), seed=5), cut=3)
    stall = strat.before_publish(learner, [partial])
    assert stall > 0 and strat.metrics()["interrupts"] == 1
    sgd_step(learner, 7)
    strat.on_publish(1, model)
    v1 = copy.deepcopy(model.state_dict())
    order = torch.tensor([2, 0, 3, 1])  # re-batched: rows need no ids
    finished = finished.select(order)
    res = strat.old_log_prob(finished, learner, 1)
    assert_exact_old_logits(res.old_log_prob, {0: v0, 1: v1}, model, finished, float64_reference)
    recompute = learner.log_prob(finished).detach()
    interrupted = finished.response_mask & (finished.version == 0)
    assert not torch.allclose(res.old_log_prob[interrupted], recompute[interrupted], atol=1e-4)
    assert res.metrics["interrupted_token_fraction"] == pytest.approx(
        float(interrupted.sum() / finished.response_mask.sum())
    )
    assert res.metrics["exact_token_fraction"] == 1.0
    assert res.extra_bytes == 4 * int((partial.response_mask).sum())
    strat.on_publish(4, model)  # v0 entries fall out of the window
    assert res.extra_bytes > 0 and strat.extra_bytes == 0


def test_ewma_decay_zero_is_live_weights(run):
    r = run["rollout"]
    strat = EWMA(beta=0.0, max_staleness=3)
    strat.on_publish(0, tiny_model(5))
    strat.after_optimizer_step(run["model"])
    res = strat.old_log_prob(r, run["learner"], 3)
    live = run["learner"].log_prob(r).detach().masked_fill(~r.response_mask, 0)
    torch.testing.assert_close(res.old_log_prob, live, atol=1e-6, rtol=0)


def test_ewma_closed_form_matches_weighted_average(make_learner):
    learner = make_learner(3)
    model = learner.model
    beta = 0.6
    strat = EWMA(beta=beta, max_staleness=4, reset_keep_ratio=None)
    strat.on_publish(0, model)
    thetas = [copy.deepcopy(model.state_dict())]
    for step in range(4):
        sgd_step(learner, 20 + step)
        strat.after_optimizer_step(model)
        thetas.append(copy.deepcopy(model.state_dict()))
    n = len(thetas) - 1
    weights = torch.tensor([beta ** (n - j) for j in range(n + 1)], dtype=torch.float64)
    avg = strat.average
    for name, value in avg.items():
        if not value.is_floating_point():
            continue
        manual = sum(w * th[name].double() for w, th in zip(weights, thetas)) / weights.sum()
        torch.testing.assert_close(value.double(), manual, atol=1e-6, rtol=1e-5)
    assert strat.weight == pytest.approx(float(weights.sum()))
    assert not torch.allclose(
        avg["lm_head.weight"], thetas[-1]["lm_head.weight"]
    )  # not just the live weights


def kept(rollout, version, keep_share):
    """``rollout`` after a correction that kept the first ``keep_share`` of each row's valid tokens."""
    n = rollout.response_mask.sum(1, keepdim=True)
    first = torch.arange(T)[None, :] < (n * keep_share).ceil()
    return rollout.replace(kept_mask=rollout.response_mask & first)


def test_lag_beta_puts_centre_of_mass_at_the_mean_lag():
    for lag, s in [(1, 1), (2, 1), (0.5, 4), (4, 2)]:
        beta = lag_beta(lag, s)
        assert beta / (1 - beta) == pytest.approx(lag * s)
    assert lag_beta(0.0) == 0.0
    with pytest.raises(ValueError, match="beta"):
        EWMA(beta=1.0)
    with pytest.raises(ValueError, match="mean_lag"):
        lag_beta(-1.0)


def test_ewma_beta_follows_the_measured_lag_not_the_configured_window():
    strat = EWMA(max_staleness=8, steps_per_version=2, reset_keep_ratio=None)
    assert strat.beta == 0.0  # nothing measured yet: the live weights
    for lags, expected in [([0, 0, 0, 0], 0.0), ([1, 1, 1, 1], 2 / 3), ([0, 2, 1, 3], lag_beta(1.5, 2))]:
        version = torch.tensor(lags)[:, None].expand(4, T).clone()
        r = kept(make_rollout(5 - version, lengths=[T] * 4), 5, 1.0)  # generated at 5 − lag, learner at 5
        strat.after_correction(r, 5)
        assert strat.beta == pytest.approx(expected)
        assert strat.metrics()["ewma_lag"] == pytest.approx(sum(lags) / 4)
    fixed = EWMA(beta=0.5, max_staleness=8)
    fixed.after_correction(kept(make_rollout(torch.zeros(4, T, dtype=torch.long)), 3, 1.0), 3)
    assert fixed.beta == 0.5


def test_ewma_auto_reset_fires_on_the_correction_keep_share(make_learner):
    learner = make_learner(4)
    model = learner.model
    strat = make_proximal("ewma", max_staleness=8, reset_keep_ratio=0.9)
    strat.on_publish(0, model)
    stale = make_rollout(torch.zeros(4, T, dtype=torch.long))  # every token 2 versions old at version 2
    strat.after_correction(kept(stale, 2, 1.0), 2)
    for step in range(2):
        sgd_step(learner, 40 + step)
        strat.after_optimizer_step(model)
    assert strat.resets == 0 and strat.weight > 1
    strat.after_correction(kept(stale, 2, 0.5), 2)
    assert strat.last_keep_ratio < 0.9
    sgd_step(learner, 43)
    strat.after_optimizer_step(model)
    assert strat.resets == 1 and strat.weight == 1.0
    for name, value in strat.average.items():
        torch.testing.assert_close(value, model.state_dict()[name], atol=0, rtol=0)
    # the reset may also apply at the next old_log_prob
    strat.after_correction(kept(stale, 2, 0.25), 2)
    res = strat.old_log_prob(make_rollout(torch.zeros(3, T, dtype=torch.long)), learner, 2)
    assert res.metrics["ewma_resets"] == 2.0 and res.metrics["ewma_keep_ratio"] < 0.9


def test_snapshot_eviction_and_memory_accounting(make_learner):
    learner = make_learner(6)
    model = learner.model
    strat = make_proximal("snapshot", max_staleness=2)
    for v in range(6):
        strat.on_publish(v, model)
        sgd_step(learner, 60 + v)
    assert strat.store.versions == [3, 4, 5]
    one = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for n, b in model.named_buffers() if n in model.state_dict()
    )
    assert strat.store.nbytes == 3 * one  # the tied embedding / lm_head is stored once per version
    stale = make_rollout(torch.full((3, T), 2, dtype=torch.long))
    with pytest.raises(KeyError, match="version 2"):
        strat.old_log_prob(stale, learner, 5)
    with pytest.raises(ValueError, match="newer than"):
        strat.old_log_prob(make_rollout(torch.full((3, T), 6, dtype=torch.long)), learner, 5)
    store = SnapshotStore(max_staleness=0)
    store.put(7, model)
    store.put(8, model)
    assert store.versions == [8]


@pytest.mark.parametrize(
    "name", ["recompute", "bypass", "snapshot", "old_logit_model", "interrupt", "loglinear", "linear", "ewma"]
)
def test_state_dict_round_trip(run, name):
    r, learner = run["rollout"], run["learner"]
    strat = run["strategies"][name]
    if name == "interrupt":
        strat.before_publish(learner, [r], version=3)
    before = strat.old_log_prob(r, learner, 3)
    buf = io.BytesIO()
    torch.save(strat.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=False)
    fresh = make_proximal(name, max_staleness=3)
    fresh.load_state_dict(state)  # as the trainer does: no model at hand, weights restored lazily
    after = fresh.old_log_prob(r, learner, 3)
    torch.testing.assert_close(after.old_log_prob, before.old_log_prob, atol=1e-6, rtol=0)
    if before.error is not None and name != "snapshot":
        assert after.error == pytest.approx(before.error, rel=1e-5, abs=1e-7)
    with pytest.raises(ValueError, match="proximal strategy"):
        make_proximal("recompute" if name != "recompute" else "bypass").load_state_dict(state)
    if name == "old_logit_model":
        fresh.close()


def test_discrepancy_drift_factors():
    g = torch.Generator().manual_seed(0)
    mu, old, theta = (-torch.rand(3, 5, generator=g) * 2 for _ in range(3))
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    out = discrepancy_drift(mu, old, theta, mask)
    d, s = (old - mu)[mask], (theta - old)[mask]
    n = int(mask.sum())  # float32 reductions over the n valid tokens, in another order: metric_floor's bound
    for key, want in (("discrepancy_log_mean", d.mean()), ("drift_log_mean", s.mean()),
                      ("discrepancy_log_std", d.std(correction=0)), ("total_log_mean", (theta - mu)[mask].mean()),
                      ("drift_ratio_mean", s.exp().mean())):
        want = float(want)
        assert out[key] == pytest.approx(want, rel=0, abs=metric_floor(want, n, std=key.endswith("_std"))), key
    with pytest.raises(ValueError, match="no token"):
        discrepancy_drift(mu, old, theta, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="shape"):
        discrepancy_drift(mu[:, :4], old, theta, mask)
    bad = old.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        discrepancy_drift(mu, bad, theta, mask)


def test_make_proximal_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="unknown proximal strategy 'snap'"):
        make_proximal("snap")
    with pytest.raises(TypeError, match="bad options for proximal strategy 'recompute'"):
        make_proximal("recompute", beta=0.5)
    with pytest.raises(ValueError, match="max_staleness"):
        make_proximal("snapshot", max_staleness=-1)


def test_interrupt_skips_when_learner_left_the_published_weights(make_learner):
    learner = make_learner(7)
    strat = make_proximal("interrupt", max_staleness=2)
    strat.on_publish(0, learner.model)
    sgd_step(learner, 70)
    strat.after_optimizer_step(learner.model)  # learner now ahead of the sampler's version 0
    rollout = make_rollout(torch.zeros(3, T, dtype=torch.long))
    with pytest.warns(UserWarning, match="moved past the published weights"):
        assert strat.before_publish(learner, [rollout]) == 0.0
    assert len(strat.store) == 0 and strat.metrics()["interrupt_skipped"] == 1
    strat.on_publish(1, learner.model)
    assert strat.before_publish(learner, [rollout.replace(version=torch.ones_like(rollout.version))]) > 0
    assert len(strat.store) == int(rollout.response_mask.sum())


def test_error_is_unmeasured_not_fatal_outside_the_reference_window(make_learner):
    learner = make_learner(8)
    strat = make_proximal("recompute", max_staleness=1, measure_error=True)
    for v in range(3):
        strat.on_publish(v, learner.model)
    res = strat.old_log_prob(make_rollout(torch.zeros(3, T, dtype=torch.long)), learner, 2)
    assert res.error is None and res.metrics["reference_missing"] == 1.0
    res = strat.old_log_prob(make_rollout(torch.full((3, T), 2, dtype=torch.long)), learner, 2)
    assert res.error is not None and res.error["logp_abs_err_max"] < 1e-6  # recompute is exact at v_cur


def test_ewma_error_is_reported_and_bounded(run, float64_reference):
    r, learner = run["rollout"], run["learner"]
    ewma = run["strategies"]["ewma"].old_log_prob(r, learner, 3)
    recompute = run["strategies"]["recompute"].old_log_prob(r, learner, 3)
    exact = exact_reference(run["states"], run["model"], r)
    with float64_reference():
        exact64 = exact_reference(run["states"], run["model"], r, dtype=torch.float64)
    assert_error_metrics(ewma.error, ewma.old_log_prob, exact, exact64, r.response_mask)
    # θ̄ averages v0..v3 (random-direction SGD here, so it need not beat the live weights); it stays within
    # the scale of the versions' spread rather than drifting off
    assert 0 < ewma.error["logp_abs_err_mean"] < 2 * recompute.error["logp_abs_err_mean"]
    assert ewma.extra_bytes == model_bytes(run["model"]) and ewma.metrics["ewma_beta"] == pytest.approx(0.6)


class _Minimal(ProximalStrategy):
    """The smallest strategy: only ``_old_log_prob``; every hook and question comes from the protocol."""

    name = "minimal"

    def _old_log_prob(self, rollout, learner, current_version):
        return torch.zeros(rollout.response_ids.shape)


def test_protocol_defaults_cover_every_hook(make_learner):
    learner = make_learner(9)
    strat = _Minimal(measure_error=True)
    r = make_rollout(torch.zeros(3, T, dtype=torch.long))
    assert not (strat.exact or strat.follows_sampler or strat.pauses_sampler or strat.old_is_rollout)
    assert not strat.needs_rollout_log_prob and strat.is_exact(r, 0) is False
    assert _Minimal.run_defaults(temperature=0.7, max_staleness=3, steps_per_version=2) == {
        "temperature": 0.7, "max_staleness": 3
    }
    strat.on_sampler_load(0, learner.model)  # default: the same as on_publish (the reference stores it)
    assert strat.reference.versions == [0]
    assert strat.before_publish(learner, [r]) == 0.0
    assert strat.submit(r, learner) is None
    strat.after_correction(r.replace(kept_mask=r.response_mask), 0)
    strat.after_optimizer_step(learner.model)
    strat.wait()
    res = strat.old_log_prob(r, learner, 0)
    assert strat.current_log_prob(res) is None and res.error is not None


def test_strategies_answer_the_trainer_through_the_protocol(run):
    r, learner = run["rollout"], run["learner"]
    strategies = run["strategies"]
    assert {n for n, s in strategies.items() if s.follows_sampler} == {"old_logit_model"}
    assert {n for n, s in strategies.items() if s.pauses_sampler} == {"interrupt"}
    assert {n for n, s in strategies.items() if s.old_is_rollout} == {"bypass"}
    assert {n for n, s in strategies.items() if s.exact} == {"snapshot", "old_logit_model", "interrupt"}
    recompute = strategies["recompute"]
    assert not recompute.is_exact(r, 3)  # stale tokens
    current = r.replace(version=torch.full_like(r.version, 3))
    assert recompute.is_exact(current, 3)
    res = recompute.old_log_prob(current, learner, 3)
    assert recompute.current_log_prob(res) is res.old_log_prob  # log π_θ for free
    assert "steps_per_version" in STRATEGIES["ewma"].run_defaults(1.0, 4, 2)
