"""vLLM adapter on CPU: the missing-vLLM error and the pure conversion of vLLM-shaped outputs to a Rollout."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field

import pytest
import torch

from rollcorr.engines import vllm as vllm_engine
from rollcorr.engines.base import SamplingParams
from rollcorr.engines.vllm import sampled_log_probs, vllm_outputs_to_rollout


# The shapes of vllm.outputs.RequestOutput / CompletionOutput / vllm.logprobs.Logprob that the adapter reads.
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def completion(
    index: int, tokens: list[int], lps: list[float], reason: str | None = "stop"
) -> CompletionOutput:
    # logprobs=0 returns the sampled token; add a decoy top-1 entry to check the right one is picked
    steps = [{t: Logprob(lp, rank=2), 99: Logprob(-0.01, rank=1)} for t, lp in zip(tokens, lps)]
    return CompletionOutput(index, "x" * len(tokens), tokens, sum(lps), steps, reason)


def outputs():
    return [
        RequestOutput(
            "0", "ab", [5, 6], [completion(0, [7, 8, 2], [-0.5, -1.0, -0.1]), completion(1, [9], [-2.0])]
        ),
        RequestOutput(
            "1",
            "abc",
            [5, 6, 7],
            [completion(0, [3, 4], [-0.3, -0.7], "length"), completion(1, [4, 2], [-1.5, -0.2])],
        ),
    ]


def test_conversion_layout_and_values():
    meta = [{"answer": "1"}, {"answer": "2"}]
    r = vllm_outputs_to_rollout(outputs(), version=4, pad_token_id=0, group_ids=[10, 11], meta=meta)
    assert r.batch_size == 4
    assert r.prompt_ids.tolist() == [[0, 5, 6], [0, 5, 6], [5, 6, 7], [5, 6, 7]]  # left-padded
    assert r.prompt_mask.tolist()[0] == [False, True, True]
    assert r.response_ids.tolist() == [[7, 8, 2], [9, 0, 0], [3, 4, 0], [4, 2, 0]]  # right-padded
    assert r.response_mask.sum(1).tolist() == [3, 1, 2, 2]
    expected = torch.tensor([[-0.5, -1.0, -0.1], [-2.0, 0, 0], [-0.3, -0.7, 0], [-1.5, -0.2, 0]])
    torch.testing.assert_close(r.rollout_log_prob, expected)
    assert r.log_kept_mass is not None and (r.log_kept_mass == 0).all()  # no truncation: nothing cut
    assert r.version.tolist() == [[4, 4, 4], [4, 0, 0], [4, 4, 0], [4, 4, 0]]
    assert r.group_ids.tolist() == [10, 10, 11, 11]
    assert [m["answer"] for m in r.meta] == ["1", "1", "2", "2"]
    assert [m["finish_reason"] for m in r.meta] == ["stop", "stop", "length", "stop"]
    assert all(m["finished"] for m in r.meta) and r.meta[0]["response_text"] == "xxx"
    assert meta[0] == {"answer": "1"}  # caller's meta untouched


def test_conversion_truncated_and_greedy():
    r = vllm_outputs_to_rollout(outputs(), version=0, pad_token_id=0, truncated=True)
    assert r.log_kept_mass is None  # vLLM does not report the kept mass under top-k / top-p
    assert r.group_ids.tolist() == [0, 0, 1, 1]
    g = vllm_outputs_to_rollout(outputs(), version=0, pad_token_id=0, greedy=True)
    assert (g.rollout_log_prob == 0).all()  # μ is a point mass
    assert g.log_kept_mass[0].tolist() == pytest.approx([-0.5, -1.0, -0.1])  # p(argmax) of the model


def test_conversion_rejects_bad_outputs():
    with pytest.raises(ValueError, match="no vLLM outputs"):
        vllm_outputs_to_rollout([], version=0, pad_token_id=0)
    bad = outputs()
    bad[0].outputs[0].logprobs = None
    with pytest.raises(ValueError, match="logprobs=0"):
        vllm_outputs_to_rollout(bad, version=0, pad_token_id=0)
    bad = outputs()
    del bad[1].outputs[1].logprobs[0][4]
    with pytest.raises(ValueError, match="sampled token 4"):
        vllm_outputs_to_rollout(bad, version=0, pad_token_id=0)
    bad = outputs()
    bad[0].outputs[1].logprobs[0][9].logprob = -math.inf
    with pytest.raises(ValueError, match="non-finite"):
        vllm_outputs_to_rollout(bad, version=0, pad_token_id=0)
    with pytest.raises(ValueError, match="group ids"):
        vllm_outputs_to_rollout(outputs(), version=0, pad_token_id=0, group_ids=[1])
    with pytest.raises(ValueError, match="steps for"):
        sampled_log_probs([1, 2], [{1: -0.1}])
    assert sampled_log_probs([1], [{1: -0.25}]) == [-0.25]  # plain floats accepted


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_missing_vllm_gives_clear_error():
    with pytest.raises(RuntimeError, match=r"pip install rollcorr\[vllm\]"):
        vllm_engine.VLLMSampler("builtin")
    with pytest.raises(RuntimeError, match="vLLM is not installed"):
        vllm_engine.import_vllm()


def test_sampler_against_a_stand_in_engine(monkeypatch):
    """VLLMSampler's own logic (request building, partial-rollout refusal, weight RPC) on a stand-in ``vllm``."""
    calls = {}

    class FakeSamplingParams:
        def __init__(self, **kw):
            calls["sampling"] = kw

    class FakeLLM:
        def __init__(self, **kw):
            calls["llm"] = kw

        def get_tokenizer(self):
            from rollcorr.models.builtin import build_tokenizer

            return build_tokenizer()

        def generate(self, prompts, sampling_params, use_tqdm=False):
            calls["prompts"] = prompts
            return [
                RequestOutput(str(i), None, p["prompt_token_ids"], [completion(0, [7, 2], [-0.1, -0.2])])
                for i, p in enumerate(prompts)
            ]

        def collective_rpc(self, method, args=()):
            calls["rpc"] = (method, args)

        def reset_prefix_cache(self):
            calls["reset"] = True

    class FakeVLLM:
        LLM = FakeLLM
        SamplingParams = FakeSamplingParams

    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: FakeVLLM)
    sampler = vllm_engine.VLLMSampler("some/model", dtype="float16", gpu_memory_utilization=0.3)
    assert calls["llm"]["logprobs_mode"] == "processed_logprobs"
    assert calls["llm"]["worker_extension_cls"] == vllm_engine.WORKER_EXTENSION
    assert calls["llm"]["gpu_memory_utilization"] == 0.3 and calls["llm"]["dtype"] == "float16"

    r = sampler.generate(
        ["1+2=", "3+4="], SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, seed=3), n=1
    )
    assert calls["sampling"] == dict(
        n=1, temperature=0.7, top_k=0, top_p=0.9, seed=3, max_tokens=5, logprobs=0
    )
    tok = sampler.tokenizer
    assert calls["prompts"][0]["prompt_token_ids"] == tok.encode("1+2=", add_special_tokens=False)
    assert r.batch_size == 2 and r.log_kept_mass is None  # top_p < 1: kept mass unknown

    with pytest.raises(NotImplementedError, match="hf or llamacpp"):
        sampler.generate(["1+2="], SamplingParams(), max_steps=2)
    with pytest.raises(ValueError, match="sets 'logprobs_mode'"):
        vllm_engine.VLLMSampler("m", logprobs_mode="raw_logprobs")

    w = {"lm_head.weight": torch.zeros(2, 2)}
    assert sampler.load_weights(w, 7) == 7 and sampler.version == 7
    method, (weights,) = calls["rpc"]
    assert method == "rollcorr_load_weights" and weights[0][0] == "lm_head.weight" and calls["reset"]


def test_worker_extension_loads_into_the_model_runner():
    loaded = []

    class Model:
        def load_weights(self, weights):
            loaded.extend(weights)

    class Worker(vllm_engine.RollcorrWorkerExtension):
        model_runner = type("Runner", (), {"model": Model()})()

    assert Worker().rollcorr_load_weights([("a", torch.ones(1))]) == 1
    assert loaded[0][0] == "a"
