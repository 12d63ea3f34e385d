"""The keep mask (``sampler_distribution="keep_mask"``): the sampler records its top-k / top-p kept sets and the
learner renormalises π over them, so identical models give ρ = 1 and k3 = 0 where the truncated comparison gives
ρ = kept mass (DeepSeek-V3.2's "keep sampling mask"; vLLM's return_sampling_mask)."""

import math

import pytest
import torch

from conftest import EPS32, assert_as_accurate
from rollcorr.config.correction import CorrectionConfig
from rollcorr.correction import compute_correction, metrics_to_floats
from rollcorr.engines import SamplingParams, make_learner, make_sampler, process_logits
from rollcorr.engines.base import draw, kept_token_ids
from rollcorr.logprobs import logprobs_from_logits, logprobs_over_kept, logprobs_over_kept_logits
from rollcorr.models.builtin import BUILTIN_DIR
from rollcorr.rollout import Rollout
from rollcorr.tasks import AdditionTask
from rollcorr.train.alerts import truncation_warning

builtin = pytest.mark.skipif(not (BUILTIN_DIR / "model.safetensors").exists(), reason="no built-in checkpoint")
PROMPTS = [item["prompt"] for item in AdditionTask(3).sample(8, seed=3, split="test")]


def identical_logits(rows: int = 256, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    """Logits of a peaked next-token distribution (a real model's shape: a few likely tokens, a long tail)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * 3.0


def sample_and_score(logits: torch.Tensor, params: SamplingParams, mode: str):
    """One draw per row from ``logits`` under ``params`` (the sampler), and the learner's log-prob of it from the
    very same logits in ``mode``: (log π (N,), log μ (N,), kept mass (N,))."""
    log_mu, log_kept = process_logits(logits, params)
    tokens = draw(log_mu, params, torch.Generator().manual_seed(1))
    mu = log_mu.gather(-1, tokens[:, None]).squeeze(-1)
    if mode == "keep_mask":
        pi = logprobs_over_kept_logits(logits, tokens, kept_token_ids(log_mu), temperature=params.temperature)
    else:  # the learner's full distribution
        pi = logprobs_from_logits(logits, tokens, temperature=params.temperature)[0]
    return pi, mu, log_kept.exp()


def correction_of(pi: torch.Tensor, mu: torch.Tensor, mode: str):
    config = CorrectionConfig(is_level="token", is_upper=None, sampler_distribution=mode)
    res = compute_correction(pi[None], mu[None], torch.ones_like(pi[None], dtype=torch.bool), config)
    return res.is_weights[0], metrics_to_floats(res.metrics)


def test_identical_logits_top_p_0_8_give_rho_1_and_k3_0_under_the_keep_mask():
    logits = identical_logits()
    params = SamplingParams(temperature=1.0, top_p=0.8)
    pi, mu, kept_mass = sample_and_score(logits, params, "keep_mask")
    rho, metrics = correction_of(pi, mu, "keep_mask")
    # both sides compute z_y − log Σ_S e^z in float32 from the same logits, the sampler through the full
    # log-softmax first: their difference is a few roundings of numbers of size max |z| + log V
    bound = 8 * EPS32 * (float(logits.abs().max()) + math.log(logits.shape[1]))
    assert float((rho.double().log()).abs().max()) <= bound
    # k3 = e^x − 1 − x ≤ x² for |x| ≤ 1, computed in float32 as ρ − 1 − x: plus the rounding of ρ and ρ − 1
    assert abs(metrics["rollout_corr/k3_kl"]) <= bound**2 + 4 * EPS32
    # the truncated comparison of the same tokens: ρ is the kept mass, its mean ≈ 0.8 at top_p = 0.8, k3 > 0
    full, _, _ = sample_and_score(logits, params, "truncated")
    rho_truncated, truncated = correction_of(full, mu, "truncated")
    assert torch.allclose(rho_truncated.double(), kept_mass.double(), rtol=0, atol=bound)
    assert 0.8 <= float(rho_truncated.mean()) < 0.95 and truncated["rollout_corr/k3_kl"] > 100 * bound


def test_top_k_sets_and_their_renormalised_scores():
    logits = identical_logits(rows=32, vocab=40, seed=2)
    params = SamplingParams(temperature=0.7, top_k=5)
    log_mu, _ = process_logits(logits, params)
    kept = kept_token_ids(log_mu)
    assert kept.shape == (32, 5) and kept.dtype == torch.int32
    assert torch.equal(kept.long(), (logits / 0.7).topk(5, dim=-1).indices)  # the five most likely, in order
    pi, mu, _ = sample_and_score(logits, params, "keep_mask")
    assert float((pi - mu).abs().max()) <= 8 * EPS32 * (float(logits.abs().max()) / 0.7 + math.log(40))


def test_the_kept_set_score_matches_its_float64_definition_and_gradients():
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(9, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(13, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    kept = torch.stack([torch.randperm(13, generator=gen)[:4] for _ in range(9)])
    kept[2, 1:] = -1  # a set of one token: log π_S = 0
    kept[4] = -1  # padding: scores 0
    targets = kept[:, 0].clone()
    targets[4] = 3
    got = logprobs_over_kept(hidden, weight, targets, kept, temperature=0.9).detach()
    z = hidden.detach() @ weight.detach().T / 0.9
    for i in range(9):
        ids = kept[i][kept[i] >= 0]
        want = 0.0 if not len(ids) else float(z[i, targets[i]] - torch.logsumexp(z[i, ids], 0))
        assert abs(float(got[i]) - want) <= 1e-12
    assert float(got[2]) == 0.0 and float(got[4]) == 0.0
    assert torch.autograd.gradcheck(lambda h, w: logprobs_over_kept(h, w, targets, kept, temperature=0.9), (hidden, weight))
    assert torch.autograd.gradcheck(lambda h, w: logprobs_over_kept_logits(h @ w.T, targets, kept, temperature=0.9),
                                    (hidden, weight))
    outside = targets.clone()
    outside[0] = next(t for t in range(13) if t not in kept[0].tolist())
    with pytest.raises(ValueError, match="not in their own kept set"):
        logprobs_over_kept(hidden, weight, outside, kept)


def test_the_old_mode_warns_and_the_others_do_not():
    said = truncation_warning(0, 0.8, True, "truncated")
    assert said.startswith("warning: rollout.top_p=0.8 with algorithm.correction.sampler_distribution=truncated")
    assert "keep_mask" in said and "\n" not in said
    assert truncation_warning(0, 0.8, True, "keep_mask") is None
    assert truncation_warning(0, 0.8, True, "full") is None  # μ_full: ρ = 1 on identical models too
    assert truncation_warning(0, 1.0, False, "truncated") is None  # nothing cut
    assert CorrectionConfig().sampler_distribution == "keep_mask"  # the default


@builtin
def test_the_hf_sampler_records_kept_sets_and_the_learner_scores_over_them():
    sampler, learner = make_sampler("hf:fp32"), make_learner("hf:fp32")
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.8, seed=0, record_kept_ids=True)
    r = sampler.generate(PROMPTS, params, n=2)
    assert r.kept_ids is not None and r.kept_ids.shape[:2] == r.response_ids.shape
    valid = r.response_mask.bool()
    assert ((r.kept_ids == r.response_ids[..., None]).any(-1) == valid).all()  # each token in its own set
    assert (r.kept_ids[~valid] == -1).all()
    assert sampler.generate(PROMPTS, SamplingParams(max_new_tokens=6, top_p=0.8, seed=0), n=2).kept_ids is None
    # the learner over the kept sets against the float64 definition from its own full logits
    got = learner.log_prob(r)
    full = learner.log_prob((r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask))
    p = r.prompt_ids.shape[1]
    with torch.no_grad():
        pos = (r.attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = learner.model(input_ids=r.input_ids, attention_mask=r.attention_mask.long(),
                               position_ids=pos).logits[:, p - 1 : p - 1 + r.response_ids.shape[1]].double()
    log_p = torch.log_softmax(logits, -1)
    ids = r.kept_ids.long()
    in_set = torch.where(ids >= 0, log_p.gather(-1, ids.clamp_min(0)), torch.full(ids.shape, -math.inf, dtype=torch.float64))
    want = (log_p.gather(-1, r.response_ids[..., None]).squeeze(-1) - torch.logsumexp(in_set, -1))[valid]
    assert_as_accurate(got[valid], full[valid] - torch.logsumexp(in_set, -1)[valid], want, what="kept-set log-probs")
    # identical weights on both sides: log ρ is the engines' float32 noise, not the kept mass (≈ −0.1 and below)
    log_rho = (got - r.rollout_log_prob)[valid]
    assert float(log_rho.abs().max()) < 0.01 < float(-(r.log_kept_mass[valid]).mean())


@builtin
def test_the_audit_under_the_keep_mask_sees_no_mismatch_on_one_engine_and_the_processed_one_the_kept_mass():
    """``rollcorr audit --top-p 0.8 --sampler-dist keep_mask`` with one engine on both sides: the learner scored
    over the sampler's kept sets gives k3 ≈ 0 (float noise, as the full comparison); compared with the
    renormalised distribution (processed) the learner's full one sees the kept mass, k3 = mean e^x − 1 − x of
    x = log kept mass."""
    from rollcorr.audit.collect import collect, from_rollout
    from rollcorr.audit.stats import audit_stats

    sampler, learner = make_sampler("hf:fp32"), make_learner("hf:fp32")

    def k3_of(dist: str) -> tuple[float, Rollout, torch.Tensor]:
        params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.8, seed=0,
                                record_kept_ids=dist == "keep_mask")
        rollout = collect(sampler, learner, PROMPTS, params, batch_size=8)
        data = from_rollout(rollout, sampler_dist=dist)
        stats = audit_stats(data.rollout_log_prob, data.old_log_prob, data.response_mask)
        valid = rollout.response_mask.bool()
        return stats["divergence"]["k3_kl"], rollout, valid

    kept, r, valid = k3_of("keep_mask")
    assert r.kept_ids is not None
    noise = float((r.old_log_prob - r.rollout_log_prob)[valid].abs().max())  # log ρ: the engines' float noise
    assert noise < 1e-3  # not the kept mass (≈ −0.1 and below)
    assert 0 <= kept <= noise**2 + 4 * EPS32  # k3 = e^x − 1 − x ≤ x² for |x| ≤ 1, plus its float32 rounding
    processed, r, valid = k3_of("processed")
    assert r.kept_ids is None
    x = r.log_kept_mass[valid].double()
    artefact = float((x.exp() - 1 - x).mean())  # what one engine shows against the renormalised distribution
    # log ρ = log kept mass + ε (ε the engines' noise); k3 moves by at most |ε| · |e^x − 1| ≤ |ε| for x ≤ 0
    eps = float((r.old_log_prob - r.rollout_log_prob - r.log_kept_mass)[valid].abs().max())
    assert artefact > 1000 * (noise**2 + 4 * EPS32)
    assert abs(processed - artefact) <= eps + 4 * EPS32


@builtin
def test_resumed_rows_keep_the_sets_they_were_drawn_from():
    sampler = make_sampler("hf:fp32")
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=4, seed=1, record_kept_ids=True)
    part = sampler.generate(PROMPTS[:4], params, max_steps=2)
    assert part.kept_ids.shape[-1] == 4
    whole = sampler.generate(None, params, resume=part)
    valid = whole.response_mask.bool()
    assert ((whole.kept_ids == whole.response_ids[..., None]).any(-1) == valid).all()
    assert torch.equal(whole.kept_ids[:, :2], part.kept_ids[:, :2])  # the first two tokens' sets unchanged
    both = Rollout.concat([part, whole])
    assert both.kept_ids.shape == (8, whole.response_ids.shape[1], 4) and (both.kept_ids[:4, 2:] == -1).all()


@pytest.mark.usefixtures("alternating_rewards")
def test_training_with_top_p_replays_the_kept_sets(tmp_path, addition_model_dir, capsys):
    """Two runs with top_p = 0.8 and one engine on both sides: under the keep mask the correction sees ρ ≈ 1
    (k1 ≈ 0); the truncated comparison sees the kept mass in every ratio (|k1| = mean −log kept mass) and says so."""
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import run

    def k1_of(mode: str) -> float:
        config = load_config(None, ["task.name=addition:1", "rollout.prompts_per_step=2", "rollout.group_size=4",
                                    "rollout.max_new_tokens=4", "rollout.top_p=0.8", "task.eval_prompts=0",
                                    "trainer.progress=false", "trainer.plot=false", "trainer.tensorboard=false",
                                    "trainer.mini_batches=1", "trainer.steps=1", "model.sampler=hf:fp32",
                                    f"model.path={addition_model_dir}", f"trainer.out={tmp_path / mode}",
                                    f"algorithm.correction.sampler_distribution={mode}"])
        run(config)
        rows = [r for r in map(__import__("json").loads, (tmp_path / mode / "metrics.jsonl").read_text().splitlines())
                if "rollout_corr/kl" in r]
        return rows[0]["rollout_corr/kl"]

    kept = k1_of("keep_mask")
    assert "sampler_distribution=truncated compares" not in capsys.readouterr().out
    truncated = k1_of("truncated")
    assert "sampler_distribution=truncated compares" in capsys.readouterr().out
    assert abs(kept) < 1e-3 < 0.05 < abs(truncated)


@builtin
def test_trajectories_keep_the_sets_of_the_models_tokens_and_none_for_the_environments():
    """A multi-turn episode under top-k: the environment's tokens carry no kept set (−1), each model token its own,
    and the learner scores the model's tokens over theirs (the observations are not scored)."""
    from rollcorr.envs import Limits, Renderer, Turn, play

    class Echo:  # answers every turn, never done
        name, max_turns = "echo", 10

        def sample(self, n, seed, split="train"):
            return [{"prompt": "12+34="}] * n

        held_out = sample

        def reset(self, item):
            return type("E", (), {"prompt": item["prompt"], "step": lambda self, text: Turn("1+1=", 0.25)})()

    sampler, learner = make_sampler("hf:fp32"), make_learner("hf:fp32")
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=3, seed=2, record_kept_ids=True)
    r = play(sampler, Echo(), [{"prompt": "12+34="}] * 2, Renderer(sampler.tokenizer, chat=False), params,
             limits=Limits(max_turns=3))
    model, observed = r.response_mask.bool(), r.observation_mask.bool()
    assert observed.any() and (r.kept_ids[observed] == -1).all() and (r.kept_ids[~r.token_mask] == -1).all()
    assert ((r.kept_ids == r.response_ids[..., None]).any(-1) == model).all()
    assert ((r.kept_ids >= 0).sum(-1)[model] == 3).all()
    log_rho = (learner.log_prob(r) - r.rollout_log_prob)[model]
    assert float(log_rho.abs().max()) < 0.01  # one engine on both sides: float noise, not the kept mass


def _chain_trajectories(params: SamplingParams) -> Rollout:
    """Two-turn trajectories of the checkpoints environment on the built-in chain model (4 items × 2 responses),
    rewarded 1, 0, 1, 0, … by row so that every group has a gradient."""
    from rollcorr.envs import Renderer, make_env, play
    from rollcorr.tasks import make_task

    sampler = make_sampler("hf:fp32", "builtin:chain")
    env = make_env(make_task("chain"), {"name": "checkpoints", "every": 7})
    items = [it for it in env.sample(4, seed=3) for _ in range(2)]
    r = play(sampler, env, items, Renderer(sampler.tokenizer, chat=False), params, group_ids=[i // 2 for i in range(8)])
    return r.replace(rewards=(torch.arange(8) % 2).float())


def _keep_mask_step(rollout: Rollout) -> tuple[dict, dict]:
    """One training step of ``chain_turns`` under top-k 3 and the keep mask: (its metrics, the weights after)."""
    from rollcorr.train.build import build_proximal, build_step_config
    from rollcorr.train.config import load_config
    from rollcorr.train.step import train_step

    config = load_config("chain_turns", ["trainer.mini_batches=1", "rollout.top_k=3",
                                         "algorithm.correction.sampler_distribution=keep_mask"])
    torch.manual_seed(0)
    learner = make_learner("hf:fp32", "builtin:chain")
    optimizer = torch.optim.AdamW(learner.model.parameters(), lr=1e-3)
    proximal = build_proximal(config)
    proximal.on_publish(0, learner.model)
    result = train_step(rollout, learner, optimizer, proximal, build_step_config(config), version=0)
    return result.metrics, {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


@builtin
def test_a_trajectorys_step_reads_the_models_tokens_over_their_sets_and_nothing_of_the_environments():
    """Multi-turn under top-k with the keep mask: the loss, the correction and every metric read the model's tokens
    alone, each over the set it was drawn from. Whatever the environment's positions hold — a kept set (here
    its own token alone, as a tool's "certain" token would read), log-probs of NaN, any kept mass — the step is the
    same, weights bit for bit (Flash-RL's tool-token leak, on the keep-mask path)."""
    params = SamplingParams(max_new_tokens=35, temperature=0.7, top_k=3, seed=5, record_kept_ids=True)
    r = _chain_trajectories(params)
    model, observed = r.response_mask.bool(), r.observation_mask.bool()
    assert observed.any() and (r.turns == 2).all() and (r.kept_ids[observed] == -1).all()
    assert ((r.kept_ids >= 0).sum(-1)[model] == 3).all()  # every model token drawn from a set of three
    reference_metrics, reference_weights = _keep_mask_step(r)
    assert reference_metrics["rollout_corr/num_tokens"] == int(model.sum())  # the model's tokens, no observation
    sets = r.kept_ids.clone()
    sets[observed] = -1
    sets[..., 0][observed] = r.response_ids[observed].to(sets.dtype)
    filled = r.replace(kept_ids=sets, rollout_log_prob=r.rollout_log_prob.masked_fill(observed, math.nan),
                       log_kept_mass=r.log_kept_mass.masked_fill(observed, -7.0))
    metrics, weights = _keep_mask_step(filled)
    timing = {k for k in metrics if k.startswith(("time/", "memory/", "proximal/seconds"))}
    assert {k: v for k, v in metrics.items() if k not in timing} == pytest.approx(
        {k: v for k, v in reference_metrics.items() if k not in timing}, nan_ok=True)
    for name, value in weights.items():
        assert torch.equal(value, reference_weights[name]), name


def test_training_trajectories_with_top_k_replays_the_models_sets(tmp_path):
    """``chain_turns`` (two model turns, the environment's number between them) under top-k 2 at τ = 1.5, one
    engine on both sides: the keep mask gives ρ ≈ 1 on every model token of both turns (k1 ≈ 0), the truncated
    comparison the kept mass (|k1| = mean −log kept mass): the sets reach the learner across the observation.
    The task's own reward (a patched one would skip the episodes' bookkeeping); k1 is measured before any update."""
    from rollcorr.train.config import load_config
    from rollcorr.train.loop import run

    def k1_of(mode: str) -> float:
        config = load_config("chain_turns", [
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.top_k=2", "rollout.temperature=1.5",
            "task.eval_prompts=0", "trainer.eval_every=0", "trainer.progress=false", "trainer.plot=false",
            "trainer.tensorboard=false", "trainer.steps=1", "trainer.mini_batches=1", "model.sampler=hf:fp32",
            f"trainer.out={tmp_path / mode}", f"algorithm.correction.sampler_distribution={mode}"])
        run(config)
        rows = [r for r in map(__import__("json").loads, (tmp_path / mode / "metrics.jsonl").read_text().splitlines())
                if "rollout_corr/kl" in r]
        assert rows[0]["env/turns_mean"] == 2.0
        return rows[0]["rollout_corr/kl"]

    kept, truncated = k1_of("keep_mask"), k1_of("truncated")
    assert abs(kept) < 1e-3 < 0.05 < abs(truncated)
