"""--localize's default (issue 50 item 6): every component's share estimated to first order in one backward,
the largest estimates measured exactly. The estimate's arithmetic against float64 references, and the default
and --localize-exact naming the same component first wherever one tensor of the sampler was moved."""

from types import SimpleNamespace

import pytest
import torch

from rollcorr.audit.collect import builtin_prompts, collect
from rollcorr.audit.localize import (
    REFINE,
    RESIDUAL,
    components,
    head_cost,
    layers_run,
    localize,
    probes,
    response_log_probs,
    swapped,
)
from rollcorr.engines import SamplingParams, make_learner, make_sampler

EPS64 = torch.finfo(torch.float64).eps


def _float64_pair():
    """The built-in model as a float64 learner, and a float32 sampler of it with four tensors moved (the tied
    embedding, an attention, an MLP, the final norm): every component's δ is non-zero (the float32 rounding at
    least; the embedding, a lookup, only where moved)."""
    learner, sampler = make_learner("hf:fp32"), make_sampler("hf:fp32")
    rollout = collect(sampler, learner, builtin_prompts(4), SamplingParams(max_new_tokens=8, seed=0), n=2, batch_size=8)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.o_proj.weight",
                     "model.layers.2.mlp.up_proj.weight", "model.norm.weight"):
            w = dict(sampler.model.named_parameters())[name]
            w.add_(1e-3 * torch.randn(w.shape, generator=g, dtype=w.dtype))
    learner.model.double()
    return learner, sampler, rollout


def _directional(learner_model, sampler_model, paths, tokens, signs):
    """Per response b, X_b = d/dα_b of Σ_t r_bt log p_bt at α = 0 (float64), the learner's forward with α_b·δ_b
    added where the component acts (δ: what ``swapped`` puts there minus the learner's own; for the residual
    stream, the rounding at every decoder layer's input and the last one's output); with, per response, Σ|∂/∂site
    · δ| over its elements (the scale of its rounding) and how many elements that sums. A reference independent of
    localize's backward to every site: a forward of its own per component, the gradient with respect to α."""
    ids, mask, p, targets, valid = tokens
    layers = learner_model.get_decoder().layers
    modules = dict(learner_model.named_modules())
    if paths == [RESIDUAL]:
        dtype = next(sampler_model.parameters()).dtype
        sites = [(layer, True) for layer in layers] + [(layers[-1], False)]

        def delta_of(h):
            return h.detach().to(dtype).to(h.dtype) - h.detach()
    else:
        seen = {}

        def record(swap):  # registered inside ``swapped``, so it runs after the swap's hook and sees its output
            return modules[paths[-1]].register_forward_hook(
                lambda m, a, out: seen.__setitem__(swap, (out[0] if isinstance(out, tuple) else out).clone()))

        with torch.no_grad():
            hook = record(False)
            response_log_probs(learner_model, ids, mask, p, targets, 1.0)
            hook.remove()
            with swapped(learner_model, sampler_model, paths):
                hook = record(True)
                response_log_probs(learner_model, ids, mask, p, targets, 1.0)
                hook.remove()
        sites, fixed = [(modules[paths[-1]], False)], seen[True] - seen[False]

        def delta_of(h):
            return fixed
    alpha = torch.zeros(ids.shape[0], dtype=torch.float64, requires_grad=True)
    handles, kept = [], []

    def moved(h):
        delta = delta_of(h)
        kept.append((h, delta))
        return h + alpha.view(-1, *[1] * (h.dim() - 1)) * delta

    for module, before in sites:
        if before:
            handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs: ((moved(args[0]), *args[1:]), kwargs) if args else
                (args, {**kwargs, "hidden_states": moved(kwargs["hidden_states"])}), with_kwargs=True))
        else:
            handles.append(module.register_forward_hook(
                lambda m, a, out: (moved(out[0]), *out[1:]) if isinstance(out, tuple) else moved(out)))
    try:
        with torch.enable_grad():
            log_p = response_log_probs(learner_model, ids, mask, p, targets, 1.0)
            metric = (signs * log_p)[valid].sum()
            grads = torch.autograd.grad(metric, [alpha, *(h for h, _ in kept)], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    scale = sum((grad * delta).abs().reshape(len(alpha), -1).sum(1) for (_, delta), grad in zip(kept, grads[1:])
                if grad is not None)
    return grads[0], scale, sum(delta[0].numel() for _, delta in kept)


def test_the_estimate_is_its_probes_arithmetic_in_float64():
    """Each component's estimate (localize's backward to every site per probe) against its definition computed
    another way in float64: ½ Σ_probes Σ_b X_b² / (N · probes), each X_b the derivative along that component's δ
    in response b alone. Equal within the rounding of the sums: each X_b within n·ε·Σ|terms| (n the elements it
    sums, the worst case), so X_b² within 2|X_b|·e + e²."""
    learner, sampler, rollout = _float64_pair()
    model = learner.model
    loc = localize(sampler, learner, rollout, responses=8)
    part = rollout.select(list(range(8)))
    ids = torch.cat([part.prompt_ids, part.response_ids], 1)
    tokens = (ids, part.attention_mask, part.prompt_ids.shape[1], part.response_ids, part.response_mask.bool())
    signs = probes(tokens[4])
    total, n_tokens = loc["full_forward"]["k3"], int(tokens[4].sum())
    assert total > 0 and loc["mode"] == "estimate" and signs.shape[0] >= 1
    by_name = {c["component"]: c for c in loc["components"]}
    for name, paths in components(model):
        want, bound = 0.0, 0.0
        for k in range(signs.shape[0]):
            x, scale, n = _directional(model, sampler.model, paths, tokens, signs[k])
            err = n * EPS64 * scale
            want += float((x**2).sum())
            bound += float((2 * x.abs() * err + err**2).sum())
        norm = 2 * n_tokens * signs.shape[0]
        got = by_name[name]["estimate"] * total
        assert want > 0, name  # every component moved something: none checked trivially
        assert abs(got - want / norm) <= bound / norm + 8 * EPS64 * want / norm, (name, got, want / norm)


def test_probes_are_fixed_signs_on_the_valid_tokens():
    valid = torch.tensor([[True, True, False], [True, False, False]])
    r = probes(valid, 3)
    assert r.shape == (3, 2, 3) and r.dtype == torch.float64
    assert torch.equal(r.abs(), valid.double().expand(3, -1, -1)) and torch.equal(r, probes(valid, 3))


@pytest.fixture(scope="module")
def learner():
    return make_learner("hf:fp32")


# one moved tensor per placement, and the component it belongs to (the tied embedding moves the lm-head too)
PLACEMENTS = [
    ("model.layers.0.self_attn.q_proj.weight", {"layer 0 attention"}),
    ("model.layers.1.self_attn.o_proj.weight", {"layer 1 attention"}),
    ("model.layers.3.self_attn.v_proj.weight", {"layer 3 attention"}),
    ("model.layers.1.input_layernorm.weight", {"layer 1 attention"}),
    ("model.layers.2.mlp.down_proj.weight", {"layer 2 mlp"}),
    ("model.layers.0.mlp.gate_proj.weight", {"layer 0 mlp"}),
    ("model.layers.3.post_attention_layernorm.weight", {"layer 3 mlp"}),
    ("model.norm.weight", {"final norm"}),
    ("model.embed_tokens.weight", {"embedding", "lm head"}),
]


@pytest.mark.parametrize("tensor, owners", PLACEMENTS, ids=[p[0].removeprefix("model.") for p in PLACEMENTS])
def test_the_default_and_the_exact_mode_name_the_moved_tensor_first(learner, tensor, owners):
    """An fp32 sampler with one tensor moved: the default names its component first, measured exactly, with the
    same share as --localize-exact's, bit for bit (the same swap from the same layer on, from the same recorded
    inputs); every other component computes
    exactly the learner's output, so it adds exactly nothing in both."""
    sampler = make_sampler("hf:fp32")
    with torch.no_grad():
        weight = dict(sampler.model.named_parameters())[tensor]
        noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
        weight.add_(0.05 * noise * (weight.abs().mean() if weight.dim() == 1 else 1))
    rollout = collect(sampler, learner, builtin_prompts(8), SamplingParams(max_new_tokens=12, seed=0), n=2,
                      batch_size=16)
    fast, exact = localize(sampler, learner, rollout), localize(sampler, learner, rollout, exact=True)
    assert fast["mode"] == "estimate" and exact["mode"] == "exact"
    top_fast = max(fast["components"], key=lambda c: c["share"])
    top_exact = max(exact["components"], key=lambda c: c["share"])
    assert top_fast["component"] == top_exact["component"] and top_fast["component"] in owners
    assert top_fast["method"] == "exact" and top_fast["share"] == top_exact["share"]
    for row in fast["components"]:
        if row["component"] not in owners:
            assert row["k3"] == 0.0 and row["method"] == "exact", row
    assert set(fast["refined"]) == owners and top_fast["component"] in fast["entry"]


def test_refinement_spends_its_budget_on_the_largest_estimates(learner):
    """A bf16 sampler (every component moved): the largest |estimate| is always measured; the measured ones cost
    at most the budget's forwards beyond that first; every other component keeps its estimate, labelled."""
    sampler = make_sampler("hf:bf16")
    rollout = collect(sampler, learner, builtin_prompts(8), SamplingParams(max_new_tokens=12, seed=0), n=2,
                      batch_size=16)
    model = learner.model
    paths = dict(components(model))
    for budget in (0.0, REFINE):
        loc = localize(sampler, learner, rollout, refine=budget)
        ranked = sorted(loc["components"], key=lambda c: -abs(c["estimate"]))
        assert ranked[0]["method"] == "exact" and ranked[0]["component"] in loc["refined"]
        end = head_cost(model, rollout.response_ids.shape[1], rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1])
        cost = sum(layers_run(model, paths[name]) + end for name in loc["refined"])
        first = layers_run(model, paths[ranked[0]["component"]]) + end
        assert cost <= first + budget * (model.config.num_hidden_layers + end)
        assert {c["component"] for c in loc["components"] if c["method"] == "estimate"} == \
            {c["component"] for c in loc["components"]} - set(loc["refined"])
        for c in loc["components"]:
            if c["method"] == "estimate":
                assert c["share"] == c["estimate"]
    assert len(loc["refined"]) > 1 and "estimated to first order" in loc["entry"]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_a_mixture_of_experts_is_estimated_and_refined(family):
    """transformers' MoE families (a router is a component too) go through the default: every component has an
    estimate, the largest are measured, the others labelled."""
    import copy

    from rollcorr.rollout import Rollout
    from test_moe import FAMILIES, tiny_moe  # tests/ is on sys.path (pytest rootdir)

    learner = tiny_moe(family, **FAMILIES[family])
    sampler = copy.deepcopy(learner).to(torch.bfloat16)
    ids = torch.randint(3, 40, (3, 12), generator=torch.Generator().manual_seed(0))
    prompt_mask = torch.ones(3, 4, dtype=torch.bool)
    prompt_mask[0, :2] = False
    rollout = Rollout(prompt_ids=ids[:, :4], prompt_mask=prompt_mask, response_ids=ids[:, 4:],
                      response_mask=torch.ones(3, 8, dtype=torch.bool), rollout_log_prob=None,
                      version=torch.zeros(3, 8, dtype=torch.long), group_ids=torch.arange(3))
    loc = localize(SimpleNamespace(model=sampler), SimpleNamespace(model=learner), rollout)
    names = [c["component"] for c in loc["components"]]
    assert names == [name for name, _ in components(learner)] and any(n.endswith("router") for n in names)
    assert all(c["estimate"] != 0 for c in loc["components"] if not c["component"].endswith("router"))
    assert loc["refined"] and {c["method"] for c in loc["components"]} == {"exact", "estimate"}


@pytest.mark.parametrize("spec", ["hf:int8", "hf:rtn4", "hf:fp16"])
def test_the_default_localises_quantised_and_fp16_samplers(learner, spec):
    """The samplers the page names besides bf16 — int8 (dynamically quantised Linear modules, computing in
    float32), rtn<k> (rounded weights) and fp16 — go through the default: every component is estimated or
    measured, the largest estimate is measured, and its share is the one --localize-exact measures for it, bit
    for bit (the same swap from the same layer on)."""
    sampler = make_sampler(spec)
    rollout = collect(sampler, learner, builtin_prompts(8), SamplingParams(max_new_tokens=12, seed=0), n=2,
                      batch_size=16)
    fast, exact = localize(sampler, learner, rollout), localize(sampler, learner, rollout, exact=True)
    assert fast["full_forward"]["k3"] > 0 and {c["method"] for c in fast["components"]} <= {"exact", "estimate"}
    assert all(c["estimate"] >= 0 for c in fast["components"])
    largest = max(fast["components"], key=lambda c: c["estimate"])
    assert largest["method"] == "exact" and largest["component"] in fast["refined"]
    measured = {c["component"]: c["share"] for c in exact["components"]}
    for c in fast["components"]:
        if c["method"] == "exact" and c["component"] in fast["refined"]:
            assert c["share"] == measured[c["component"]], c
