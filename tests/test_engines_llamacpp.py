"""llama.cpp sampler: GGUF export run by llama.cpp against the HF fp32 model, μ bookkeeping, weight reload."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import EPS32, ERROR_RATIO, FORWARD_SANITY, assert_as_accurate

pytest.importorskip("gguf", reason="the gguf package (GGUF writer) is not installed")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install rollcorr[llamacpp])")

from rollcorr.engines.base import SamplingParams, process_logits  # noqa: E402
from rollcorr.engines.llamacpp import LlamaCppSampler  # noqa: E402
from rollcorr.models.builtin import build_tokenizer, builtin_config  # noqa: E402

pytestmark = pytest.mark.llamacpp

PROMPTS = ["12+34=", "7+8=", "905+17=", "Hello, world!\n\t{x} ~ y"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small random Qwen2 with the built-in character tokenizer, weights scaled up so that the
    next-token distributions are peaked (a trained model's are; a fresh init's are nearly uniform)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    config = builtin_config(
        len(tokenizer), num_hidden_layers=2, hidden_size=64, intermediate_size=128, initializer_range=0.08
    )
    model = Qwen2ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


@pytest.fixture(scope="module")
def samplers(model_dir):
    path = model_dir[0]
    out = {q: LlamaCppSampler(path, q, max_batch=8, n_threads=1) for q in ("f32", "f16", "q8_0", "q4_0")}
    yield out
    for s in out.values():
        s.close()


def hf_log_probs(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0]
        return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)  # float64 stays


def float64_probs(model, seqs, float64_reference) -> list[torch.Tensor]:
    """The HF model's next-token probabilities in float64 (a float64 copy, conftest's float64_reference)."""
    twin = copy.deepcopy(model).double()
    with float64_reference():
        return [hf_log_probs(twin, s).exp() for s in seqs]


def assert_f32_forward(got, established, exact, what=""):
    """llama.cpp's f32 probabilities ``got`` as close to the float64 HF forward as HF's float32 ones: in the
    Euclidean norm (conftest.assert_as_accurate) and in the largest entry (same rule, floor 4 ε₃₂ for p ≤ 1)."""
    got, established, exact = (torch.cat([x.double().flatten() for x in xs]) for xs in (got, established, exact))
    assert_as_accurate(got, established, exact, sanity=FORWARD_SANITY * float(exact.norm()), what=what)
    worst, worst_hf = float((got - exact).abs().max()), float((established - exact).abs().max())
    assert worst <= ERROR_RATIO * worst_hf + 4 * EPS32, f"{what}: max |Δp| {worst:.3g} vs HF fp32's {worst_hf:.3g}"


def sequences(tokenizer) -> list[list[int]]:
    rng = np.random.default_rng(0)
    seqs = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    seqs += [rng.integers(4, len(tokenizer), size=40).tolist() for _ in range(4)]
    return seqs


@pytest.fixture(scope="module")
def reference(model_dir):
    """Token sequences and the HF fp32 model's next-token probabilities on them (computed once)."""
    _, model, tokenizer = model_dir
    seqs = sequences(tokenizer)
    return seqs, [hf_log_probs(model, s).exp() for s in seqs]


def mismatch(sampler, reference) -> np.ndarray:
    """|p_llama.cpp − p_HF| over every position and vocabulary entry."""
    seqs, probs = reference
    out = [(torch.softmax(logits, -1) - p).abs().flatten() for logits, p in zip(sampler.logits(seqs), probs)]
    return torch.cat(out).numpy()


def test_f32_gguf_reproduces_hf_fp32(samplers, reference, model_dir, float64_reference):
    # f32 weights, f32 KV cache, no (f16) flash attention: the same fp32 forward up to summation order, whose
    # rounding depends on each library's CPU kernels: measured against the float64 forward
    seqs, probs = reference
    ours = [torch.softmax(logits.double(), -1) for logits in samplers["f32"].logits(seqs)]
    assert_f32_forward(ours, probs, float64_probs(model_dir[1], seqs, float64_reference), what="f32 GGUF")


def test_quantisation_mismatch_grows_in_the_expected_order(samplers, reference):
    mean = {q: mismatch(samplers[q], reference).mean() for q in ("f32", "f16", "q8_0", "q4_0")}
    assert mean["f32"] < mean["f16"] < mean["q8_0"] < mean["q4_0"], mean
    assert mean["q4_0"] > 1e-4, mean  # 4-bit weights visibly move the distribution


def test_native_tokenizer_agrees_with_hf(model_dir, samplers):
    _, _, tokenizer = model_dir
    s = samplers["q8_0"]
    for text in PROMPTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert s.tokenize_native(text) == ids
        assert s.detokenize_native(ids) == tokenizer.decode(ids) == text
    eos = tokenizer.eos_token_id
    assert s.detokenize_native([eos]) == "<eos>"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=12, temperature=1.0, seed=1),
        SamplingParams(max_new_tokens=12, temperature=0.7, top_k=5, top_p=0.8, seed=2),
        SamplingParams(max_new_tokens=12, temperature=0.0),
    ],
    ids=["plain", "topk-topp", "greedy"],
)
def test_recorded_log_probs_are_the_processed_distribution(samplers, params):
    s = samplers["q4_0"]
    r = s.generate(PROMPTS[:3], params, n=3, meta=[{"i": i} for i in range(3)], group_ids=[5, 6, 7])
    assert r.batch_size == 9 and r.group_ids.tolist() == [5, 5, 5, 6, 6, 6, 7, 7, 7]
    assert [m["i"] for m in r.meta] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert (r.version[r.response_mask] == s.version).all()
    # recompute μ from llama.cpp's teacher-forced logits over prompt + response
    for i in range(r.batch_size):
        prompt = r.prompt_ids[i][r.prompt_mask[i]].tolist()
        resp = r.response_ids[i][r.response_mask[i]].tolist()
        logits = s.logits([prompt + resp])[0][len(prompt) - 1 : len(prompt) - 1 + len(resp)]
        log_mu, log_kept = process_logits(logits, params)
        expected = log_mu.gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
        n = len(resp)
        assert torch.isfinite(expected).all()  # every sampled token is inside the kept set
        torch.testing.assert_close(r.rollout_log_prob[i, :n], expected, atol=2e-4, rtol=0)
        torch.testing.assert_close(r.log_kept_mass[i, :n], log_kept, atol=2e-4, rtol=0)
        assert (r.rollout_log_prob[i, n:] == 0).all() and (r.log_kept_mass[i, n:] == 0).all()
        finished_by_eos = resp[-1] == s.eos_id
        assert r.meta[i]["finished"] and (finished_by_eos or n == params.max_new_tokens)
        assert s.eos_id not in resp[:-1]
    if params.top_k or params.top_p < 1:
        assert (r.log_kept_mass[r.response_mask] < 0).any()  # truncation removed some mass
    if params.greedy:
        assert (r.rollout_log_prob == 0).all()
        again = s.generate(PROMPTS[:3], params, n=3)
        assert torch.equal(again.response_ids, r.response_ids)


def test_kept_sets_are_recorded_when_asked(samplers):
    """The keep mask's record (Rollout.kept_ids): every sampled token in its step's top-5 set, sets of the
    processed distribution's size, across two batches of the context (9 rows, max_batch 8)."""
    s = samplers["q4_0"]
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_k=5, seed=2, record_kept_ids=True)
    r = s.generate(PROMPTS[:3], params, n=3)
    valid = r.response_mask.bool()
    assert r.kept_ids.shape == (*r.response_ids.shape, 5) and r.kept_ids.dtype == torch.int32
    assert ((r.kept_ids == r.response_ids[..., None]).any(-1) == valid).all()
    assert ((r.kept_ids >= 0).sum(-1)[valid] == 5).all() and (r.kept_ids[~valid] == -1).all()
    prompt = r.prompt_ids[0][r.prompt_mask[0]].tolist()
    resp = r.response_ids[0][valid[0]].tolist()
    logits = s.logits([prompt + resp])[0][len(prompt) - 1 : len(prompt) - 1 + len(resp)]
    top = (logits / 0.7).topk(6, dim=-1)
    clear = (top.values[:, 4] - top.values[:, 5]) > 1e-2  # no near-tie at the set's edge
    for t in clear.nonzero().flatten().tolist():
        assert set(r.kept_ids[0, t].tolist()) == set(top.indices[t, :5].tolist())
    assert s.generate(PROMPTS[:3], replace(params, record_kept_ids=False), n=3).kept_ids is None


def test_seed_reproducible(samplers):
    s = samplers["f32"]
    params = SamplingParams(max_new_tokens=8, seed=11)
    a = s.generate(PROMPTS, params, n=2)
    b = s.generate(PROMPTS, params, n=2)
    assert torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.rollout_log_prob, b.rollout_log_prob)
    assert (
        s.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=12), n=2).response_ids.tolist()
        != a.response_ids.tolist()
    )


def test_weight_reload_changes_outputs_and_version(model_dir):
    path, model, _ = model_dir
    s = LlamaCppSampler(path, "f32", max_batch=4, n_threads=1)
    try:
        old_file = s.gguf_path
        seq = [[5, 6, 7, 8, 9]]
        before = s.logits(seq)[0]
        r0 = s.generate(PROMPTS[:2], SamplingParams(max_new_tokens=6, seed=0))
        assert (r0.version[r0.response_mask] == 0).all()

        state = {k: v.clone() for k, v in model.state_dict().items()}
        state["model.norm.weight"] = state["model.norm.weight"] * 3.0
        assert s.load_weights(state, 3) == 3 and s.version == 3
        assert s.gguf_path != old_file and s.gguf_path.exists() and not old_file.exists()
        after = s.logits(seq)[0]
        assert (after - before).abs().max() > 0.1
        torch.testing.assert_close(after, before * 3.0, atol=1e-3, rtol=1e-3)  # final norm scales the logits
        r1 = s.generate(PROMPTS[:2], SamplingParams(max_new_tokens=6, seed=0))
        assert (r1.version[r1.response_mask] == 3).all()

        bad = dict(state)
        bad.pop("model.norm.weight")
        with pytest.raises(ValueError, match="missing"):
            s.load_weights(bad, 4)
        assert s.version == 3 and torch.equal(s.logits(seq)[0], after)  # old weights keep serving
    finally:
        s.close()
    assert not s.work_dir.exists()
    with pytest.raises(RuntimeError, match="closed"):
        s.generate(PROMPTS[:1], SamplingParams())


def test_partial_rollout_resumes_with_new_version(model_dir):
    path, model, _ = model_dir
    s = LlamaCppSampler(path, "q8_0", max_batch=4, n_threads=1)
    try:
        params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)
        part = s.generate(PROMPTS[:2], params, n=2, max_steps=3)
        unfinished = [i for i, m in enumerate(part.meta) if not m["finished"]]
        assert unfinished, "expected rows cut by max_steps"
        assert all(part.response_mask[i].sum() == 3 for i in unfinished)
        s.load_weights(model.state_dict(), 1)
        full = s.generate([], params, resume=part)
        assert all(m["finished"] for m in full.meta)
        for i in unfinished:
            n = int(full.response_mask[i].sum())
            assert full.version[i, :3].tolist() == [0, 0, 0] and (full.version[i, 3:n] == 1).all()
            assert torch.equal(full.response_ids[i, :3], part.response_ids[i, :3])
            torch.testing.assert_close(full.rollout_log_prob[i, :3], part.rollout_log_prob[i, :3])
    finally:
        s.close()


def test_bad_input(model_dir, samplers):
    s = samplers["q8_0"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.generate([[5, 10_000]], SamplingParams())
    with pytest.raises(ValueError, match="n_ctx"):
        s.generate([[5] * 120], SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="no prompts"):
        s.generate([], SamplingParams())
    with pytest.raises(ValueError, match="unknown quant"):
        LlamaCppSampler(model_dir[0], "q3_k")
    with pytest.raises(FileNotFoundError):
        LlamaCppSampler(model_dir[0] / "nope", "f32")


def test_extra_buffer_types_off(model_dir, samplers):
    """The AMX workaround path (use_extra_bufts = False, no weight repacking) loads and computes the same
    q4_0 model up to kernel differences."""
    path, _, tokenizer = model_dir
    s = LlamaCppSampler(path, "q4_0", max_batch=2, n_threads=1, extra_bufts=False)
    try:
        assert s.extra_bufts is False
        seq = sequences(tokenizer)[:2]
        for a, b in zip(s.logits(seq), samplers["q4_0"].logits(seq)):
            torch.testing.assert_close(a, b, atol=1e-2, rtol=0)
    finally:
        s.close()


def test_llama_architecture_matches_hf(tmp_path, float64_reference):
    """A Llama checkpoint (q/k rows permuted for llama.cpp's rope, untied lm-head) through the same path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.08,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    assert not config.tie_word_embeddings
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    s = LlamaCppSampler(tmp_path, "f32", max_batch=2, n_threads=1)
    try:
        seq = list(range(4, 40))
        ours = torch.softmax(s.logits([seq])[0], -1)
        with torch.no_grad():
            theirs = torch.softmax(model(torch.tensor([seq])).logits[0], -1)
        assert_f32_forward([ours], [theirs], float64_probs(model, [seq], float64_reference), what="untied")
    finally:
        s.close()


@pytest.mark.slow
def test_mismatch_report(model_dir, capsys, float64_reference, monkeypatch):
    """benchmarks/bench_llamacpp.py: the audit's statistics per quant type, ordered as the bits go down. f32's
    gap to the fp32 learner is float rounding: |B − A| ≤ (C + 1) ‖A − R‖ + floor for any B as accurate as the
    learner A (conftest.assert_as_accurate's rule), with ‖A − R‖ the learner's own distance to its float64
    forward R on the rollout the report scored (mean |Δ log p| and max |Δp|)."""
    import importlib.util
    from pathlib import Path

    audit_collect = importlib.import_module("rollcorr.audit.collect")  # the module (the package re-exports the function)
    collected, collect = {}, audit_collect.collect

    def recorded(sampler, learner, *args, **kwargs):
        rollout = collect(sampler, learner, *args, **kwargs)
        twin = copy.deepcopy(learner)
        twin.model.double()
        with float64_reference():
            exact = twin.log_prob(rollout)
        m = rollout.response_mask
        old = rollout.old_log_prob.double()
        collected[repr(sampler)] = {
            "log": float((old - exact)[m].abs().mean()), "p": float((old.exp() - exact.exp())[m].abs().max()),
            "log_floor": 4 * EPS32 * float(exact[m].abs().mean()),
        }
        return rollout

    monkeypatch.setattr(audit_collect, "collect", recorded)

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_llamacpp.py"
    spec = importlib.util.spec_from_file_location("bench_llamacpp", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.mismatch_report(str(model_dir[0]), ("llamacpp:f32", "llamacpp:q4_0"), prompts=6, n=2,
                                 max_new_tokens=4, threads=1)
    f32, q4 = rows
    assert f32["spec"] == "llamacpp:f32" and f32["tokens"] > 0
    (learner_f32,) = [v for k, v in collected.items() if "f32" in k]
    assert f32["mean_abs_log_ratio"] <= (ERROR_RATIO + 1) * learner_f32["log"] + learner_f32["log_floor"]
    assert f32["max_abs_dp"] <= (ERROR_RATIO + 1) * learner_f32["p"] + 4 * EPS32
    assert q4["mean_abs_log_ratio"] > 10 * f32["mean_abs_log_ratio"] and q4["gguf_mb"] < f32["gguf_mb"]
    assert bench.main(["--model", str(model_dir[0]), "--specs", "llamacpp:q8_0", "--prompts", "2", "--n", "1"]) == 0
    assert "llamacpp:q8_0 |" in capsys.readouterr().out


def test_builtin_model_prompts():
    """On the shipped model: llama.cpp tokenizes the addition prompts exactly as tokenizer.json does, and
    greedy decoding gives the hf sampler's tokens (f32 is the fp32 forward)."""
    from tokenizers import Tokenizer

    from rollcorr.engines.hf import HFSampler
    from rollcorr.models.builtin import BUILTIN_DIR
    from rollcorr.tasks.addition import AdditionTask

    if not (BUILTIN_DIR / "model.safetensors").exists():
        pytest.skip("built-in checkpoint not present")
    items = AdditionTask(digits=3).sample(6, seed=0)
    prompts = [it["prompt"] for it in items]
    reference = Tokenizer.from_file(str(BUILTIN_DIR / "tokenizer.json"))
    s = LlamaCppSampler("builtin", "f32", max_batch=8, n_threads=1)
    try:
        for text in prompts + [it["answer"] for it in items]:
            ids = reference.encode(text).ids
            assert s.tokenize_native(text) == ids and s.detokenize_native(ids) == text
        params = SamplingParams(max_new_tokens=6, temperature=0.0)
        ours = s.generate(prompts, params)
        theirs = HFSampler("builtin", device="cpu").generate(prompts, params)
        assert torch.equal(ours.response_ids, theirs.response_ids)
        assert [m["response_text"] for m in ours.meta] == [m["response_text"] for m in theirs.meta]
    finally:
        s.close()


def test_serves_a_shipped_gguf_file_as_it_is(model_dir, samplers, reference, tmp_path):
    """quant="file": llama.cpp loads the given GGUF (here a q8_0 export) unchanged; it cannot take new weights."""
    import shutil

    path, model, tokenizer = model_dir
    shipped = tmp_path / "shipped-q8_0.gguf"
    shutil.copy(samplers["q8_0"].gguf_path, shipped)
    sampler = LlamaCppSampler(path, "file", gguf_file=shipped, max_batch=8, n_threads=1)
    try:
        # same file, same kernels: the same probabilities as the sampler that wrote it
        assert np.allclose(mismatch(sampler, reference), mismatch(samplers["q8_0"], reference), atol=1e-6)
        rollout = sampler.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, seed=0), n=2)
        assert rollout.response_mask.any() and torch.isfinite(rollout.rollout_log_prob).all()
        with pytest.raises(ValueError, match="cannot take new weights"):
            sampler.load_weights(model.state_dict(), 1)
    finally:
        sampler.close()
    assert shipped.is_file()  # the user's file is never deleted
    with pytest.raises(ValueError, match="go together"):
        LlamaCppSampler(path, "file")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LlamaCppSampler(path, "file", gguf_file=tmp_path / "nope.gguf")


def test_make_sampler_threads_reach_llamacpp(model_dir):
    """``make_sampler(..., threads=k)`` (what the trainer passes from ``trainer.threads``) sets llama.cpp's
    thread count; an explicit ``n_threads`` wins; 0 keeps llama.cpp's default."""
    import os

    from rollcorr.engines import make_sampler

    path = model_dir[0]
    for kwargs, want in (
        ({"threads": 1}, 1),
        ({"threads": 1, "n_threads": 2}, 2),
        ({}, min(4, os.cpu_count() or 1)),
    ):
        s = make_sampler("llamacpp:q8_0", path, max_batch=2, **kwargs)
        try:
            assert s.n_threads == want
        finally:
            s.close()
