"""The hf sampler and learner on the built-in model: docs/spec.md §8 log-probs, mismatch ordering, partial rollouts."""

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FORWARD_SANITY, assert_as_accurate, log_softmax_bound, processed64
from rollcorr.engines import SamplingParams, make_learner, make_sampler, parse_spec, process_logits
from rollcorr.engines.hf import HFSampler, finished_rows
from rollcorr.models.builtin import BUILTIN_DIR
from rollcorr.tasks import AdditionTask

pytestmark = pytest.mark.skipif(
    not (BUILTIN_DIR / "model.safetensors").exists(), reason="no built-in checkpoint"
)

PROMPTS = [item["prompt"] for item in AdditionTask(3).sample(16, seed=7, split="test")]


@pytest.fixture(scope="module")
def learner():
    return make_learner("hf:fp32")


@pytest.fixture(scope="module")
def sampler():
    return make_sampler("hf:fp32")


@pytest.fixture(scope="module")
def learner64(learner):
    """The learner with its model in float64: the reference of float32 comparisons (call it inside conftest's
    ``float64_reference``, which lifts the model's own float32 casts)."""
    twin = copy.deepcopy(learner)
    twin.model.double()
    return twin


def response_logits(model, r):
    """(B, T, V) logits predicting each response token, one full forward, in the model's dtype."""
    pos = (r.attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=r.input_ids, attention_mask=r.attention_mask.long(), position_ids=pos).logits
    p = r.prompt_ids.shape[1]
    return logits[:, p - 1 : p - 1 + r.response_ids.shape[1]]


def processed_reference(learner, learner64, float64_reference, r, params):
    """(float32, float64) pairs of (log μ at the response tokens, log kept mass) (B, T) from the learner's full
    forward: process_logits on the float32 logits, and its kept set in float64 (``processed64``)."""
    logits = response_logits(learner.model, r)
    log_mu, log_kept = process_logits(logits.flatten(0, 1), params)
    kept = torch.isfinite(log_mu)
    with float64_reference():
        logits64 = response_logits(learner64.model, r)
    log_mu64, log_kept64 = processed64(logits64.flatten(0, 1), params, kept)
    tokens = r.response_ids.flatten()[:, None]
    shape = r.response_ids.shape
    chosen, chosen64 = (x.gather(-1, tokens).view(shape) for x in (log_mu, log_mu64))
    return (chosen, log_kept.view(shape)), (chosen64, log_kept64.view(shape)), logits


def probs_gap(rollout, learner, temperature=1.0):
    """|p_sampler − p_learner| on the valid tokens (full distributions)."""
    log_pi = learner.log_prob(rollout, temperature=temperature)
    log_mu_full = rollout.rollout_log_prob + rollout.log_kept_mass
    mask = rollout.response_mask
    return (log_mu_full.exp() - log_pi.exp())[mask].abs()


# ---- parameters and specs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_parse_spec():
    assert parse_spec("hf") == parse_spec("hf:fp32:eager")
    s = parse_spec("hf:sdpa:bf16")
    assert (s.backend, s.dtype, s.attn, s.quant) == ("hf", "bf16", "sdpa", None)
    assert parse_spec("hf:int8").quant == "int8"
    assert parse_spec("llamacpp:q8_0").quant == "q8_0"
    assert parse_spec("vllm").dtype == "bf16" and str(parse_spec("vllm")) == "vllm:bf16"  # the default, said
    assert parse_spec("vllm:fp16").dtype == "fp16"
    for bad, message in [
        ("tensorrt", "unknown engine backend"),
        ("hf:fp8", "unknown or repeated option 'fp8'"),
        ("hf:bf16:fp16", "unknown or repeated option 'fp16'"),
        ("vllm:int8", "unknown or repeated option"),
        ("", "non-empty"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_spec(bad)


# ---- spec §8: the processed distribution ---------------------------------------------------------------


@settings(deadline=None, max_examples=40)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.floats(0.3, 2.0),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.05, 1.0),
)
def test_process_logits_is_the_renormalised_truncated_distribution(seed, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 10, generator=g) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    log_mu, log_kept = process_logits(logits, params)
    log_p = torch.log_softmax(logits / temperature, -1)
    kept = torch.isfinite(log_mu)
    # each float32 log-softmax / log-sum-exp here rounds by ≤ b (log_softmax_bound); an identity between
    # up to four such quantities holds to 4 b (log kept mass ≤ 0 exactly: to b)
    b = log_softmax_bound(logits / temperature)
    assert torch.allclose(torch.logsumexp(log_mu, -1), torch.zeros(4), atol=4 * b, rtol=0)
    assert torch.all(log_kept <= b)
    # log μ − log p_full = −log(kept mass) on every kept token
    assert torch.allclose((log_mu - log_p)[kept], (-log_kept)[:, None].expand(4, 10)[kept], atol=4 * b, rtol=0)
    assert torch.allclose(log_kept.exp(), log_p.exp().masked_fill(~kept, 0).sum(-1), atol=4 * b, rtol=0)
    if top_k:
        assert torch.all(kept.sum(-1) <= top_k)
    for row in range(4):  # kept tokens are the most likely ones; top-p keeps the smallest sufficient prefix
        p = log_p[row].exp()
        if (~kept[row]).any():
            assert p[kept[row]].min() >= p[~kept[row]].max()
        if top_p < 1.0 and (top_k == 0 or kept[row].sum() < top_k):
            mass = p[kept[row]].sum()  # the test's float32 mass vs process_logits' own: 4 b as above
            assert mass >= top_p - 4 * b
            assert mass - p[kept[row]].min() < top_p + 4 * b


def test_greedy_is_a_point_mass(sampler, learner, learner64, float64_reference):
    r = sampler.generate(PROMPTS[:4], SamplingParams(max_new_tokens=6, temperature=0.0))
    mask = r.response_mask
    assert torch.all(r.rollout_log_prob[mask] == 0)
    # the kept mass is p(argmax): the sampler's decode as close to float64 as the learner's full forward
    with float64_reference():
        exact = learner64.log_prob(r)
    assert_as_accurate(r.log_kept_mass[mask], learner.log_prob(r)[mask], exact[mask],
                       sanity=FORWARD_SANITY * float(exact[mask].norm()), what="log p(argmax)")


# ---- sampler vs learner --------------------------------------------------------------------------------


def test_fp32_sampler_agrees_with_fp32_learner(sampler, learner):
    r = sampler.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=0), n=4)
    gap = probs_gap(r, learner)
    assert gap.numel() > 100
    assert (gap < 1e-3).float().mean() >= 0.999
    assert gap.max() < 1e-2


def test_sampled_log_prob_is_processed_logits_at_chosen_token(sampler, learner, learner64, float64_reference):
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=3, top_p=0.8, seed=3)
    r = sampler.generate(PROMPTS[:8], params, n=2)
    mask = r.response_mask
    # recompute the processed distribution from the learner's own full-sequence logits (float32, and float64
    # on the same kept set): the sampler's decode is as close to float64 as that full forward
    (chosen, log_kept), (chosen64, log_kept64), logits = processed_reference(learner, learner64, float64_reference,
                                                                             r, params)
    for what, got, want, exact in (("log μ", r.rollout_log_prob, chosen, chosen64),
                                   ("log kept mass", r.log_kept_mass, log_kept, log_kept64)):
        assert_as_accurate(got[mask], want[mask], exact[mask], sanity=FORWARD_SANITY * float(exact[mask].norm()),
                           what=what)
    # log μ − log π_full = −log(kept mass), and truncation actually happened somewhere
    log_pi = learner.log_prob(r, temperature=0.7)
    with float64_reference():
        log_pi64 = learner64.log_prob(r, temperature=0.7)
    assert_as_accurate((r.rollout_log_prob + r.log_kept_mass)[mask], log_pi[mask], log_pi64[mask],
                       what="log μ + log kept mass = log π_full")
    assert (r.log_kept_mass[mask] < -1e-3).any()
    # ≤ 0 exactly (a mass ≤ 1): to two float32 log-sum-exps' rounding (log_softmax_bound)
    assert torch.all(r.log_kept_mass[mask] <= 2 * log_softmax_bound(logits / 0.7))


def test_low_precision_samplers_disagree_more(learner):
    params = SamplingParams(max_new_tokens=6, seed=1)
    share = {}
    for spec in ("hf:fp32", "hf:bf16", "hf:int8"):
        gap = probs_gap(make_sampler(spec).generate(PROMPTS[:8], params, n=4), learner)
        share[spec] = (gap >= 0.01).float().mean().item() + gap.mean().item()
    assert share["hf:fp32"] < share["hf:bf16"]
    assert share["hf:fp32"] < share["hf:int8"]
    assert share["hf:bf16"] > 10 * share["hf:fp32"]


def test_sdpa_matches_eager(learner):
    r = make_sampler("hf:fp32:sdpa").generate(PROMPTS[:8], SamplingParams(max_new_tokens=6, seed=2), n=2)
    assert (probs_gap(r, learner) < 1e-3).all()


def test_generation_layout_and_reproducibility(sampler):
    params = SamplingParams(max_new_tokens=6, seed=11)
    meta = [{"prompt": p} for p in PROMPTS[:3]]
    r = sampler.generate(PROMPTS[:3], params, n=2, meta=meta, group_ids=[5, 6, 7])
    assert r.group_ids.tolist() == [5, 5, 6, 6, 7, 7]
    assert [m["prompt"] for m in r.meta] == [p for p in PROMPTS[:3] for _ in range(2)]
    assert r.prompt_mask[:, 0].logical_not().any() or r.prompt_mask.all()  # left padding
    lengths = r.response_mask.sum(1)
    eos = sampler.tokenizer.eos_token_id
    for i, n_tok in enumerate(lengths.tolist()):
        assert r.response_mask[i, :n_tok].all() and not r.response_mask[i, n_tok:].any()
        assert (r.response_ids[i, n_tok - 1] == eos) == r.meta[i]["finished"]
        assert eos not in r.response_ids[i, : n_tok - 1].tolist()
    assert torch.all(r.rollout_log_prob[~r.response_mask] == 0) and torch.all(r.version == 0)
    again = sampler.generate(PROMPTS[:3], params, n=2, meta=meta, group_ids=[5, 6, 7])
    assert torch.equal(again.response_ids, r.response_ids)
    assert torch.equal(again.rollout_log_prob, r.rollout_log_prob)
    other = sampler.generate(PROMPTS[:3] * 2, SamplingParams(max_new_tokens=6, seed=12), n=2)
    same = sampler.generate(PROMPTS[:3] * 2, SamplingParams(max_new_tokens=6, seed=11), n=2)
    assert not torch.equal(other.response_ids, same.response_ids)


@pytest.mark.parametrize("spec", ["hf:fp32", "hf:bf16", "hf:int8"])
def test_static_kv_decode_matches_the_transformers_path(spec, learner, learner64, float64_reference):
    """The fast decoder (static KV cache, each distinct prompt prefilled once) gives the tokens and log-probs
    of decoding through ``model(...)`` with a DynamicCache: same seed, same machine, prompts of two lengths."""
    from rollcorr.engines.kvdecode import HFDecoder, StaticKVDecoder, make_decoder

    s = make_sampler(spec)
    assert isinstance(make_decoder(s.model, s.device), StaticKVDecoder)
    assert isinstance(make_decoder(s.model, s.device, fast=False), HFDecoder)
    prompts = ["7+5=", "12+9="] + PROMPTS[:6]
    tol = 1e-3  # bf16 / int8: the low-precision paths' own rounding (fp32 is measured against float64 below)
    for params in [SamplingParams(max_new_tokens=6, seed=3), SamplingParams(max_new_tokens=6, temperature=0.0),
                   SamplingParams(max_new_tokens=5, temperature=0.7, top_k=8, top_p=0.9, seed=4)]:
        runs = {}
        for fast in (False, True):
            s.fast_decode = fast
            first = s.generate(prompts, params, n=4, max_steps=2)
            runs[fast] = (first, s.generate(prompts, params, n=4, resume=first))
        for ref, got in zip(runs[False], runs[True]):
            assert torch.equal(ref.response_ids, got.response_ids)
            assert torch.equal(ref.response_mask, got.response_mask)
            if spec != "hf:fp32":
                assert torch.allclose(ref.rollout_log_prob, got.rollout_log_prob, atol=tol, rtol=0)
                assert torch.allclose(ref.log_kept_mass, got.log_kept_mass, atol=tol, rtol=0)
                continue
            # fp32: the fast decoder as close to float64 (the learner's full forward in float64, on the kept
            # sets process_logits chose) as the transformers path is; padding 0 on both
            m = ref.response_mask
            _, exact, _ = processed_reference(learner, learner64, float64_reference, ref, params)
            for what, a, b, x in (("log μ", ref.rollout_log_prob, got.rollout_log_prob, exact[0]),
                                  ("log kept mass", ref.log_kept_mass, got.log_kept_mass, exact[1])):
                assert torch.equal(a[~m], b[~m])
                assert_as_accurate(b[m], a[m], x[m], what=what)
    assert not isinstance(make_decoder(make_sampler("hf:fp32:sdpa").model, s.device), StaticKVDecoder)


def test_shared_prompt_scoring_matches_one_full_forward(sampler, float64_reference):
    """The learner's prompt-sharing path (each distinct prompt once) gives the log-probs, entropies and
    gradients of one full forward through the transformers model, for prompts of two lengths: in float32,
    each as close to the same full forward in float64 as the full float32 forward is."""
    r = sampler.generate(["7+5="] + PROMPTS[:5], SamplingParams(max_new_tokens=6, seed=9), n=4)

    def score(share, dtype=torch.float32):
        scorer = make_learner("hf")
        scorer.share_prompts = share
        scorer.model.to(dtype)
        lp, ent = scorer.log_prob(r, grad=True, with_entropy=True, temperature=0.8)
        (lp.sum() + 0.1 * ent.sum()).backward()
        return lp.detach(), ent.detach(), [p.grad for p in scorer.parameters()]

    full, shared = score(False), score(True)
    # rollcorr.logprobs accumulates a float64 head in float64; float64_reference lifts the model's own float32
    # norm / softmax casts, so the reference is float64 throughout
    with float64_reference():
        exact = score(False, torch.float64)
    # sanity: the full float32 forward itself near float64 (conftest.FORWARD_SANITY)
    for what, a, b, ref in (("log-probs", *(x[0] for x in (full, shared, exact))),
                            ("entropies", *(x[1] for x in (full, shared, exact)))):
        assert_as_accurate(b, a, ref, sanity=FORWARD_SANITY * float(ref.norm()), what=what)
    names = [name for name, _ in make_learner("hf").model.named_parameters()]
    for name, a, b, ref in zip(names, full[2], shared[2], exact[2]):
        assert_as_accurate(b, a, ref, sanity=FORWARD_SANITY * float(ref.norm()), what=f"∂/∂{name}")


def test_learner_entropy_chunks_and_grad(learner, learner64, sampler, float64_reference):
    r = sampler.generate(PROMPTS[:4], SamplingParams(max_new_tokens=6, seed=4), n=2)
    lp, ent = learner.log_prob(r, with_entropy=True)
    chunked = make_learner("hf", chunk_size=2)
    lp2, ent2 = chunked.log_prob(r, with_entropy=True)
    with float64_reference():
        lp64, ent64 = learner64.log_prob(r, with_entropy=True)
    mask = r.response_mask
    assert torch.equal(lp2[~mask], lp[~mask]) and torch.equal(ent2[~mask], ent[~mask])
    assert_as_accurate(lp2[mask], lp[mask], lp64[mask], what="log-probs, vocabulary chunks of 2")
    assert_as_accurate(ent2[mask], ent[mask], ent64[mask], what="entropies, vocabulary chunks of 2")
    # 0 ≤ H ≤ log V exactly; float32 H = log s − u/s rounds by ≤ b (1 + H) (b: log_softmax_bound of the logits;
    # u/s = Σ p (m − z) ≤ H carries the relative error)
    vocab = len(learner.tokenizer)
    slack = log_softmax_bound(response_logits(learner.model, r)) * (1 + math.log(vocab))
    assert torch.all(ent[mask] >= 0) and torch.all(ent[mask] <= math.log(vocab) + slack)
    assert torch.all(lp[~mask] == 0) and torch.all(ent[~mask] == 0)
    out = chunked.log_prob(r, grad=True)
    assert out.requires_grad
    out[mask].sum().backward()
    grads = [p.grad for p in chunked.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    assert not learner.log_prob(r).requires_grad


# ---- weights and partial rollouts ----------------------------------------------------------------------


def perturbed(state, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
        for k, v in state.items()
    }


@pytest.mark.parametrize("spec", ["hf:fp32", "hf:bf16", "hf:int8"])
def test_load_weights_reaches_the_sampler(spec, learner):
    s = make_sampler(spec)
    params = SamplingParams(max_new_tokens=6, seed=5)
    new_state = perturbed(learner.state_dict())
    assert s.load_weights(new_state, version=3) == 3 and s.version == 3
    after = s.generate(PROMPTS[:4], params)
    assert torch.all(after.version[after.response_mask] == 3)
    # the sampler now holds the new weights: an fp32 learner with them agrees (loosely for low precision)
    scorer = make_learner("hf")
    scorer.model.load_state_dict(new_state)
    if spec == "hf:fp32":
        assert probs_gap(after, scorer).mean() < 1e-3
    assert probs_gap(after, learner).mean() > 2 * probs_gap(after, scorer).mean()  # the old weights are gone
    with pytest.raises(ValueError, match="missing"):
        s.load_weights({k: v for k, v in new_state.items() if "embed" not in k}, version=4)
    assert s.version == 3


def test_resume_continues_unfinished_rows_with_current_weights(learner):
    s = make_sampler("hf:fp32")
    prompts = ["1+2=", "7+8="] + PROMPTS[:4]  # 1-digit answers finish within 3 tokens, 3-digit ones need 4+
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    full = s.generate(prompts, greedy)
    part = s.generate(prompts, greedy, max_steps=3)
    done = finished_rows(part)
    assert done[:2].all() and not done[2:].any()
    assert part.response_mask.sum(1).max() == 3
    resumed = s.generate([], greedy, resume=part)
    assert finished_rows(resumed).all()
    assert torch.equal(resumed.response_ids, full.response_ids)  # same weights: same result as one call
    assert torch.allclose(resumed.rollout_log_prob, full.rollout_log_prob)
    assert [m["response_text"] for m in resumed.meta] == [m["response_text"] for m in full.meta]

    # new weights between the two halves: new tokens carry the new version and the new weights' log-probs
    sampled = SamplingParams(max_new_tokens=6, seed=9)
    part = s.generate(prompts, sampled, n=2, max_steps=2)
    new_state = perturbed(learner.state_dict(), scale=0.02, seed=1)
    s.load_weights(new_state, version=1)
    resumed = s.generate([], sampled, resume=part)
    again = s.generate([], sampled, resume=part)
    assert torch.equal(again.response_ids, resumed.response_ids)  # seeded resume is reproducible
    m = resumed.response_mask
    assert torch.equal(resumed.version[:, :2][m[:, :2]], torch.zeros(int(m[:, :2].sum()), dtype=torch.long))
    assert torch.all(resumed.version[:, 2:][m[:, 2:]] == 1)
    assert torch.equal(resumed.response_ids[:, :2], part.response_ids[:, :2])
    assert torch.equal(resumed.rollout_log_prob[:, :2], part.rollout_log_prob[:, :2])
    scorer = make_learner("hf")
    scorer.model.load_state_dict(new_state)
    new = m & (resumed.version == 1)
    assert torch.allclose(scorer.log_prob(resumed)[new], resumed.rollout_log_prob[new], atol=1e-3)
    assert finished_rows(s.generate([], sampled, resume=resumed)).all()


# ---- bad input -----------------------------------------------------------------------------------------


def test_bad_input_fails_early(tmp_path, sampler):
    with pytest.raises(ValueError, match="unknown engine backend"):
        make_sampler("jax:fp32")
    with pytest.raises(ValueError, match="unknown or repeated option"):
        make_sampler("hf:fp64")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_sampler("hf", tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        HFSampler(tmp_path)
    with pytest.raises(ValueError, match="int8 quantisation is for samplers"):
        make_learner("hf:int8")
    with pytest.raises(ValueError, match="empty"):
        sampler.generate([""], SamplingParams())
    with pytest.raises(ValueError, match="no prompts"):
        sampler.generate([], SamplingParams())
    with pytest.raises(ValueError, match="meta has 1 entries for 2 prompts"):
        sampler.generate(["1+1=", "2+2="], SamplingParams(), meta=[{}])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sampler.generate([[1, 2, 10_000]], SamplingParams())
    with pytest.raises(ValueError, match="n must be"):
        sampler.generate(["1+1="], SamplingParams(), n=0)


def test_tokenizer_that_does_not_fit_the_model_is_rejected(tmp_path):
    from transformers import AutoModelForCausalLM

    from rollcorr.models.builtin import build_tokenizer, builtin_config

    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_config(
        builtin_config(
            vocab_size=40,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tokenizer has 101 tokens but the model's embedding has only 40"):
        make_sampler("hf", tmp_path)


def test_closed_sampler_refuses_work():
    s = make_sampler("hf:int8")
    assert s.device.type == "cpu"
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.generate(["1+1="], SamplingParams())
