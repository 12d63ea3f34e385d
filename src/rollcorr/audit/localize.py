"""Where the mismatch enters: the sampler's and the learner's forwards of the same tokens, compared component
by component (``rollcorr audit --localize``).

Two measurements on the audited tokens (prompt + response ids, a few responses — the ones holding the worst
tokens — since each costs full forwards):

- **Divergence by depth** (``sites``): one forward of each model, hooked at every decoder layer's input, its
  attention output and MLP output, the final norm's output and the logits; at each site the relative error
  ‖h_sampler − h_learner‖ / ‖h_learner‖ over the valid positions. It shows where the two hidden states drift
  apart, but an error there includes everything upstream.
- **What each component adds** (``components``): the learner's forward with one component swapped for the
  sampler's — the sampler's module (its dtype, its quantised or rounded weights) applied to the *learner's*
  input at that point, its output cast back — and fp32 everywhere else. The k3 of KL(swapped ‖ learner) over the
  response tokens is that component's own contribution, propagated through the rest of the network; its
  ``share`` is that k3 over the k3 with every component swapped at once (the sampler's full forward). For small
  independent errors k3 ≈ ½ Var(Δ log p), and variances add, so the shares add up to about 1; a sum well above
  or below 1 says the errors interact, and the report says so.

Components: the token embedding; per decoder layer its attention (with the input norm before it) and its MLP
(with the post-attention norm; a mixture-of-experts block includes its router, and the router alone is listed
too — its share, inside the MLP's, is what the sampler's router precision changes: its logits and so the
experts it picks); the final norm; the lm-head;
and the residual stream — a bf16 or fp16 model also carries the hidden state between layers in its dtype, so
this component rounds every decoder layer's input and output to the sampler's dtype (nothing for int8 and rtn<k>,
which compute in float32).
The default estimates every component's k3 before measuring any (``estimate_k3``): the sampler's modules of a
component applied to the learner's recorded input there give its error δ at its output (``sampler_output``), and a
backward of the learner's forward gives, at every component's output at once, the gradient of Σ_t r_t log p_t for
random signs r; its dot product with δ is, per response, a random-sign sum of the component's linearised change of
each token's log-prob Δ_t, whose square has the expectation Σ_t Δ_t² — so ½ mean Δ², the k3 that component adds
alone to first order, for every component from one forward with its graph and ``PROBES`` backwards (attribution
patching, with Hutchinson's estimator in place of a backward per token). The largest estimates are then measured
exactly as above (``REFINE`` forwards' worth beyond the largest); each row says ``method``: "exact" or
"estimate". ``exact=True`` (``--localize-exact``) measures every component.
Cost of a measurement: the learner's input to every decoder layer is kept from its one reference forward, so a
component at layer i runs only layers i … L−1, the final norm and the lm-head from there (``suffix_log_probs``) —
the unchanged prefix is reused, not recomputed; the embedding and the residual stream, which touch layer 0, run
whole. On an L-layer model measuring every component costs L + 3 full forwards' worth of layers instead of
2L + 4 (30 layers: 33 against 64); the default, a forward with its graph, a backward and the sampler's modules
for the estimate, then the largest estimate's run and a quarter of a forward's worth of the next.
The sampler's *decode* (a KV cache, a batch of other rows) can differ from its full forward: the audit's own
k3 on the same tokens against the all-swapped forward's separates that part (``decode_and_batch``).

This needs both models in this process: the hf engines (any dtype, int8, rtn<k>). vLLM and llama.cpp run their
own kernels out of reach of these hooks; ``localize`` refuses them in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from rollcorr.engines.kvdecode import positions_from_mask
from rollcorr.rollout import Rollout

MAX_RESPONSES = 8  # responses localised by default (each component costs up to a full forward over them)
REFINE = 0.25  # forwards' worth of exact measurement by default beyond the largest estimate's, on the next largest
PROBES = 1  # random-sign probes of the default's estimate (one backward of the learner each)


def _map_tensors(x: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``x`` (a tensor, or tensors nested in tuples, lists and dicts) with ``fn`` applied to each tensor; anything
    else as it is."""
    if isinstance(x, Tensor):
        return fn(x)
    if isinstance(x, tuple):
        return tuple(_map_tensors(v, fn) for v in x)
    if isinstance(x, list):
        return [_map_tensors(v, fn) for v in x]
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    return x


def _cast(x: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in ``x`` (nested tuples, lists, dicts) to ``dtype``; a float mask keeps its meaning (its
    most negative value becomes ``dtype``'s, not −inf)."""

    def cast(t: Tensor) -> Tensor:
        if not t.is_floating_point() or t.dtype == dtype:
            return t
        out = t.to(dtype)
        if torch.finfo(dtype).max < torch.finfo(t.dtype).max:
            return out.masked_fill(t <= torch.finfo(t.dtype).min / 2, torch.finfo(dtype).min)
        return out

    return _map_tensors(x, cast)


def _dtype_of(module: nn.Module) -> torch.dtype:
    """The dtype a module computes in: its first floating parameter's (float32 for int8-quantised modules)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def components(model: nn.Module) -> list[tuple[str, list[str]]]:
    """[(name, [module paths])] of the components ``localize`` swaps, in forward order."""
    decoder = model.get_decoder()
    prefix = next(name for name, m in model.named_modules() if m is decoder)
    out = [("embedding", [f"{prefix}.embed_tokens"])]
    for i, layer in enumerate(decoder.layers):
        mlp = "mlp" if hasattr(layer, "mlp") else "block_sparse_moe"
        out.append((f"layer {i} attention", [f"{prefix}.layers.{i}.input_layernorm", f"{prefix}.layers.{i}.self_attn"]))
        out.append((f"layer {i} mlp", [f"{prefix}.layers.{i}.post_attention_layernorm", f"{prefix}.layers.{i}.{mlp}"]))
        if isinstance(getattr(getattr(layer, mlp), "gate", None), nn.Module) and hasattr(layer, mlp) and \
                hasattr(getattr(layer, mlp), "experts"):  # a mixture of experts: its router alone too (part of the mlp)
            out.append((f"layer {i} router", [f"{prefix}.layers.{i}.{mlp}.gate"]))
    out.append(("final norm", [f"{prefix}.norm"]))
    head = next(name for name, m in model.named_modules() if m is model.get_output_embeddings())
    out.append(("lm head", [head]))
    out.append((RESIDUAL, [RESIDUAL]))
    return out


RESIDUAL = "residual stream"


def start_layer(model: nn.Module, paths: list[str]) -> int | None:
    """The first decoder layer a swap of ``paths`` changes: i for modules inside layer i, L (the layer count) for
    the final norm or the lm-head; None for the embedding and the residual stream, which change layer 0's input
    (a full forward)."""
    decoder = model.get_decoder()
    prefix = next(name for name, m in model.named_modules() if m is decoder)
    head = next(name for name, m in model.named_modules() if m is model.get_output_embeddings())
    starts = []
    for path in paths:
        inside = path.removeprefix(f"{prefix}.layers.")
        if inside != path and inside.split(".")[0].isdigit():
            starts.append(int(inside.split(".")[0]))
        elif path in (f"{prefix}.norm", head):
            starts.append(len(decoder.layers))
        else:
            return None
    return min(starts)


@contextmanager
def rounded_residual(learner_model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Inside, every decoder layer's input and output hidden state is rounded to ``dtype`` (and back)."""

    def round_trip(x: Any) -> Any:
        return x.to(dtype).to(x.dtype) if isinstance(x, Tensor) and x.is_floating_point() else x

    handles = []
    for layer in learner_model.get_decoder().layers:
        handles.append(layer.register_forward_pre_hook(
            lambda m, args, kwargs: ((round_trip(args[0]), *args[1:]), kwargs) if args else
            (args, {**kwargs, "hidden_states": round_trip(kwargs["hidden_states"])}), with_kwargs=True))
        handles.append(layer.register_forward_hook(
            lambda m, a, out: (round_trip(out[0]), *out[1:]) if isinstance(out, tuple) else round_trip(out)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def swapped(learner_model: nn.Module, sampler_model: nn.Module, paths: list[str]) -> Iterator[None]:
    """Inside, each module of ``paths`` in the learner's model returns what the sampler's module of the same
    path computes from the same inputs (cast to its dtype), cast back to the learner's dtype; the path
    ``RESIDUAL`` rounds the residual stream to the sampler's dtype instead (``rounded_residual``)."""
    if paths == [RESIDUAL]:
        with rounded_residual(learner_model, _dtype_of(sampler_model)):
            yield
        return
    own, theirs = dict(learner_model.named_modules()), dict(sampler_model.named_modules())
    handles = []

    def hook_for(target: nn.Module) -> Callable:
        dtype = _dtype_of(target)

        def hook(module, args, kwargs, output):
            result = target(*_cast(args, dtype), **_cast(kwargs, dtype))
            like = output[0] if isinstance(output, tuple) else output
            return _cast(result, like.dtype)

        return hook

    try:
        for path in paths:
            handles.append(own[path].register_forward_hook(hook_for(theirs[path]), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def response_log_probs(model: nn.Module, ids: Tensor, mask: Tensor, prompt_len: int, targets: Tensor,
                       temperature: float) -> Tensor:
    """(B, T) float64 log p of ``targets`` from one full forward of ``model`` (its lm-head module called, so a
    hook on it fires); the softmax in float64, so only the logits carry each model's precision."""
    body = model.get_decoder()
    hidden = body(input_ids=ids, attention_mask=mask.long(), position_ids=positions_from_mask(mask),
                  use_cache=False).last_hidden_state
    t = targets.shape[1]
    # contiguous: a strided slice takes another GEMM with autograd on than off, and on some CPUs (Intel's MKL)
    # the two round differently; the estimate's graph forward must score as the plain forwards do, bit for bit
    logits = model.get_output_embeddings()(hidden[:, prompt_len - 1 : prompt_len - 1 + t].contiguous())
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    return log_p.gather(-1, targets[..., None]).squeeze(-1)


@contextmanager
def _layer_calls(model: nn.Module) -> Iterator[list[tuple[tuple, dict]]]:
    """Inside, each decoder layer's call (args, kwargs) of the forward run there is recorded, in layer order — the
    hidden state entering it and what the model passes beside (position embeddings, attention mask) — and last,
    as ((h,), {}), the hidden state leaving the last layer: L + 1 entries."""
    calls: list[tuple[tuple, dict]] = []
    layers = model.get_decoder().layers
    handles = [layer.register_forward_pre_hook(lambda m, args, kwargs: calls.append((args, dict(kwargs))),
                                               with_kwargs=True) for layer in layers]
    handles.append(layers[-1].register_forward_hook(
        lambda m, args, out: calls.append(((out[0] if isinstance(out, tuple) else out,), {}))))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _with_hidden(call: tuple[tuple, dict], hidden: Tensor) -> tuple[tuple, dict]:
    """A recorded layer call with its hidden state replaced by ``hidden``."""
    args, kwargs = call
    return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})


def suffix_log_probs(model: nn.Module, calls: list[tuple[tuple, dict]], start: int, prompt_len: int,
                     targets: Tensor, temperature: float) -> Tensor:
    """(B, T) float64 log p of ``targets`` from decoder layer ``start`` on: its recorded input (``calls``, from
    ``_layer_calls`` around a forward of the same tokens) through layers start … L−1, the final norm and the
    lm-head — ``response_log_probs`` with the layers before ``start`` not run again (``start`` = L: the norm and
    the head alone). Hooks on the modules run fire as in a full forward."""
    layers = model.get_decoder().layers
    args, kwargs = calls[start]
    hidden = args[0] if args else kwargs["hidden_states"]
    for j in range(start, len(layers)):
        args, kwargs = _with_hidden(calls[j], hidden)
        out = layers[j](*args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
    hidden = model.get_decoder().norm(hidden)
    t = targets.shape[1]  # the head on a contiguous slice, as in ``response_log_probs``
    logits = model.get_output_embeddings()(hidden[:, prompt_len - 1 : prompt_len - 1 + t].contiguous())
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    return log_p.gather(-1, targets[..., None]).squeeze(-1)


def _k3_and_dp(log_p: Tensor, ref: Tensor, valid: Tensor) -> dict[str, float]:
    """k3 of KL(p ‖ ref) (p the perturbed side, as the audit's μ) and mean |Δp| over ``valid`` tokens."""
    lr = (ref - log_p)[valid]
    return {"k3": float((lr.exp() - 1 - lr).mean()), "prob_diff_mean": float((log_p.exp() - ref.exp()).abs()[valid].mean())}


@contextmanager
def _capture(model: nn.Module, sites: list[tuple[str, str, bool]]) -> Iterator[dict[str, Tensor]]:
    """Record, per (name, module path, input?) site, the module's first input (True) or its output (detached, not
    copied)."""
    modules, store, handles = dict(model.named_modules()), {}, []
    for name, path, is_input in sites:
        def keep(_m, args, out, name=name, is_input=is_input):
            value = args[0] if is_input else (out[0] if isinstance(out, tuple) else out)
            store[name] = value.detach()

        if is_input:
            handles.append(modules[path].register_forward_pre_hook(lambda m, a, name=name: store.__setitem__(name, a[0].detach())))
        else:
            handles.append(modules[path].register_forward_hook(keep))
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


def _sites(model: nn.Module) -> list[tuple[str, str, bool]]:
    decoder = model.get_decoder()
    prefix = next(name for name, m in model.named_modules() if m is decoder)
    out = []
    for i, layer in enumerate(decoder.layers):
        mlp = "mlp" if hasattr(layer, "mlp") else "block_sparse_moe"
        out += [(f"{i}/input", f"{prefix}.layers.{i}", True), (f"{i}/attention", f"{prefix}.layers.{i}.self_attn", False),
                (f"{i}/mlp", f"{prefix}.layers.{i}.{mlp}", False)]
    out.append(("final norm", f"{prefix}.norm", False))
    head = next(name for name, m in model.named_modules() if m is model.get_output_embeddings())
    out.append(("logits", head, False))
    return out


def pick_rows(rollout: Rollout, abs_diff: Tensor | None, n: int) -> list[int]:
    """The ``n`` responses holding the largest |Δp| of the audit (the first ``n`` without it)."""
    rows = rollout.response_ids.shape[0]
    if abs_diff is None or n >= rows:
        return list(range(min(n, rows)))
    worst = abs_diff.masked_fill(~rollout.response_mask.bool(), -1).amax(dim=1)
    return sorted(worst.topk(n).indices.tolist())


def _aliased(x: Any) -> Any:
    """``x`` with each tensor that requires grad replaced by a new view of itself: a gradient with respect to the view
    counts only what uses it from there on — not, for a module returning several tensors (attention: its output
    and the weights that made it), one output's use inside the module to make another."""
    return _map_tensors(x, lambda t: t.view_as(t) if t.requires_grad else t)


@contextmanager
def _module_calls(model: nn.Module, paths: list[str]) -> Iterator[dict[str, tuple[tuple, dict, Any]]]:
    """Inside, each module of ``paths`` records its last call: path → (args, kwargs, output), the output ``_aliased``
    (and returned so: what the model goes on with)."""
    modules, store = dict(model.named_modules()), {}

    def keep(path: str) -> Callable:
        def hook(module, args, kwargs, out):
            out = _aliased(out)
            store[path] = (args, dict(kwargs), out)
            return out

        return hook

    handles = [modules[path].register_forward_hook(keep(path), with_kwargs=True) for path in paths]
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _graph_from_embedding(model: nn.Module) -> Iterator[None]:
    """Inside, a forward of ``model`` builds the autograd graph from the token embedding's output on — what a
    gradient with respect to the hidden states needs — and none for the weights (frozen meanwhile)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    for p in trained:
        p.requires_grad_(False)
    handle = model.get_input_embeddings().register_forward_hook(lambda m, a, out: out.detach().requires_grad_(True))
    try:
        with torch.enable_grad():
            yield
    finally:
        handle.remove()
        for p in trained:
            p.requires_grad_(True)


def _floats(x: Any) -> list[Tensor]:
    """The floating tensors in ``x`` (nested tuples, lists, dicts), in order."""
    if isinstance(x, Tensor):
        return [x] if x.is_floating_point() else []
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _floats(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _floats(v)]
    return []


def _replaced(x: Any, swaps: list[tuple[Tensor, Tensor]]) -> Any:
    """``x`` with each tensor that *is* (by identity) the first of a pair in ``swaps`` replaced by the second."""
    return _map_tensors(x, lambda t: next((new for old, new in swaps if t is old), t))


def sampler_output(sampler_model: nn.Module, paths: list[str], record: dict[str, tuple[tuple, dict, Any]]) -> Any:
    """What ``swapped`` makes the last module of ``paths`` return in the learner's forward recorded in ``record``
    (``_module_calls``), without running the rest of the model: each of the sampler's modules applied to the
    learner's recorded inputs — an earlier module's output among them replaced by the sampler's — cast to its
    dtype, its result cast back to the learner's."""
    theirs, swaps, result = dict(sampler_model.named_modules()), [], None
    for path in paths:
        args, kwargs, output = record[path]
        args, kwargs = _replaced(args, swaps), _replaced(kwargs, swaps)
        target = theirs[path]
        dtype = _dtype_of(target)
        result = target(*_cast(args, dtype), **_cast(kwargs, dtype))
        result = _cast(result, (output[0] if isinstance(output, tuple) else output).dtype)
        swaps += list(zip(_floats(output), _floats(result)))
    return result


def probes(valid: Tensor, count: int = PROBES) -> Tensor:
    """(count, B, T) float64 independent random signs ±1 on the ``valid`` (B, T) tokens, 0 elsewhere; a fixed seed,
    so an audit's estimate is the same every run."""
    generator = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (count, *valid.shape), generator=generator, dtype=torch.float64) * 2 - 1
    return signs.to(valid.device) * valid


def estimate_k3(log_p: Tensor, valid: Tensor, pairs: dict[str, list[tuple[Tensor, Tensor]]],
                count: int = PROBES) -> dict[str, float]:
    """Per component, the k3 it adds alone, to first order: ½ · mean over the valid tokens of Δ_t², Δ_t = ⟨∂ log p_t /
    ∂ site, δ⟩ its linearised change of token t's log-prob (k3 ≈ ½ Δ² for a small Δ). Without a backward per token:
    for random signs r (``probes``), X_b = Σ_t r_bt Δ_bt = ⟨∂(Σ_t r_bt log p_bt) / ∂ site_b, δ_b⟩ has E[X_b²] = Σ_t
    Δ_bt² for each response b (responses do not mix in a forward), so ``count`` backwards give every component's
    estimate at once, unbiased (Hutchinson's estimator, one sample per response and probe). ``log_p``: (B, T) the
    learner's log-probs with their graph; ``pairs``: name → [(site tensor of that forward, whose first dimension
    runs over the responses — or over the tokens, response-major —, δ = what the sampler's component puts there
    − the learner's)]; a site the log-probs do not depend on contributes 0."""
    sites = list({id(t): t for items in pairs.values() for t, _ in items if t.requires_grad}.values())
    rows, signs = valid.shape[0], probes(valid, count)
    sums = dict.fromkeys(pairs, 0.0)
    for k in range(count if sites else 0):
        with torch.enable_grad():
            metric = (signs[k] * log_p).sum()
        grads = dict(zip(map(id, sites), torch.autograd.grad(metric, sites, retain_graph=k < count - 1,
                                                              allow_unused=True)))
        for name, items in pairs.items():
            x = torch.zeros(rows, dtype=torch.float64, device=valid.device)
            for site, delta in items:
                grad = grads.get(id(site))
                if grad is not None:
                    x += (grad.double() * delta.double()).reshape(rows, -1).sum(1)
            sums[name] += float((x**2).sum())
    return {name: total / (2 * int(valid.sum()) * count) for name, total in sums.items()}


def _site_deltas(sampler_model: nn.Module, comps: list[tuple[str, list[str]]], record: dict, boundaries: list[Tensor],
                 on_component: Callable[[str], None] | None) -> dict[str, list[tuple[Tensor, Tensor]]]:
    """Per component, its sites in the learner's forward and the δ the sampler's component puts there: its last
    module's output (the sampler's modules on the learner's inputs, ``sampler_output``); for the residual stream,
    every decoder layer's input and the last one's output, rounded to the sampler's dtype."""
    pairs = {}
    with torch.no_grad():
        for name, paths in comps:
            if on_component is not None:
                on_component(name)
            if paths == [RESIDUAL]:
                dtype = _dtype_of(sampler_model)
                pairs[name] = [(h, h.detach().to(dtype).to(h.dtype) - h.detach()) for h in boundaries]
                continue
            mine = _floats(record[paths[-1]][2])
            pairs[name] = [(a, b - a.detach()) for a, b in zip(mine, _floats(sampler_output(sampler_model, paths, record)))]
    return pairs


def _hidden(call: tuple[tuple, dict]) -> Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def _detached(calls: list[tuple[tuple, dict]]) -> list[tuple[tuple, dict]]:
    """Recorded layer calls without their autograd graph."""
    def cut(x: Any) -> Any:
        if isinstance(x, Tensor):
            return x.detach()
        if isinstance(x, (tuple, list)):
            return type(x)(cut(v) for v in x)
        return {k: cut(v) for k, v in x.items()} if isinstance(x, dict) else x

    return [(cut(args), cut(kwargs)) for args, kwargs in calls]


class _Tokens:
    """The localised tokens: ``ids`` (B, P+T), ``mask`` (B, P+T) bool, ``prompt_len`` P, ``targets`` (B, T),
    ``valid`` (B, T) bool, the sampling ``temperature``."""

    def __init__(self, ids: Tensor, mask: Tensor, prompt_len: int, targets: Tensor, valid: Tensor, temperature: float):
        self.ids, self.mask, self.prompt_len = ids, mask, prompt_len
        self.targets, self.valid, self.temperature = targets, valid, temperature

    def log_probs(self, model: nn.Module) -> Tensor:
        return response_log_probs(model, self.ids, self.mask, self.prompt_len, self.targets, self.temperature)


def _swap_row(learner_model: nn.Module, sampler_model: nn.Module, name: str, paths: list[str], calls: list,
              tok: _Tokens, ref: Tensor) -> dict[str, Any]:
    """The exact measurement of one component: the learner with it swapped for the sampler's, run from the first
    layer it changes (``start_layer``; the unchanged prefix from ``calls``), its k3 against ``ref``."""
    start = start_layer(learner_model, paths)
    with swapped(learner_model, sampler_model, paths):
        got = (tok.log_probs(learner_model) if start is None
               else suffix_log_probs(learner_model, calls, start, tok.prompt_len, tok.targets, tok.temperature))
    return {"component": name, **_k3_and_dp(got, ref, tok.valid), "method": "exact"}


def _estimated_rows(sampler_model: nn.Module, comps: list, record: dict, calls: list, ref: Tensor, tok: _Tokens, on_component: Callable[[str], None] | None) -> list[dict]:
    """Every component's first-order k3 (``estimate_k3``), from the learner's forward recorded with its graph
    (``ref``, ``record``, ``calls``); a component whose sampler's output equals the learner's exactly adds exactly
    nothing (k3 0, exact)."""
    boundaries = [_hidden(call) for call in calls]
    pairs = _site_deltas(sampler_model, comps, record, boundaries, on_component)
    estimates = estimate_k3(ref, tok.valid, pairs)
    rows = []
    for name, _ in comps:
        changed = any(bool((delta != 0).any()) for _, delta in pairs[name])
        rows.append({"component": name, "k3": estimates[name] if changed else 0.0, "estimate": estimates[name],
                     "method": "estimate" if changed else "exact"})
    return rows


@torch.no_grad()
def localize(sampler, learner, rollout: Rollout, *, temperature: float = 1.0, responses: int = MAX_RESPONSES,
             audit_log_mu: Tensor | None = None, on_component: Callable[[str], None] | None = None,
             exact: bool = False, refine: float = REFINE) -> dict[str, Any]:
    """The module docstring's measurements on ``responses`` of ``rollout``'s rows: every component estimated to
    first order, and the largest estimates measured exactly in ``refine`` forwards' worth of layers (``_refine``);
    ``exact``: every component measured.
    ``audit_log_mu``: the audit's log μ of the same tokens (its decode), to separate the decode-and-batch part.
    ValueError for a sampler whose modules are not in this process."""
    sampler_model = getattr(sampler, "model", None)
    if not isinstance(sampler_model, nn.Module) or not hasattr(learner, "model"):
        raise ValueError(f"--localize compares the two models module by module, so both must run in this process "
                         f"(the hf engines); {type(sampler).__name__} runs its own kernels out of reach")
    learner_model = learner.model
    abs_diff = None
    if audit_log_mu is not None and rollout.old_log_prob is not None:
        abs_diff = (audit_log_mu.exp() - rollout.old_log_prob.exp()).abs()
    rows = pick_rows(rollout, abs_diff, responses)
    part = rollout.select(rows)
    device = next(learner_model.parameters()).device
    tok = _Tokens(torch.cat([part.prompt_ids, part.response_ids], 1).to(device),
                  part.attention_mask.to(device),  # the environment's tokens of a trajectory attended, as the learner does
                  part.prompt_ids.shape[1], part.response_ids.to(device), part.response_mask.bool().to(device),
                  1.0 if temperature == 0 else float(temperature))
    comps = components(learner_model)
    recorded = [] if exact else [path for _, paths in comps for path in paths if path != RESIDUAL]
    with ExitStack() as hooks:  # the learner's reference forward, hooked (with its graph for the estimate)
        if not exact:
            hooks.enter_context(_graph_from_embedding(learner_model))
        ref_sites = hooks.enter_context(_capture(learner_model, _sites(learner_model)))
        calls = hooks.enter_context(_layer_calls(learner_model))
        record = hooks.enter_context(_module_calls(learner_model, recorded))
        ref = tok.log_probs(learner_model)
    sampler_device = next(sampler_model.parameters()).device
    with _capture(sampler_model, _sites(sampler_model)) as smp_sites:
        full = response_log_probs(sampler_model, tok.ids.to(sampler_device), tok.mask.to(sampler_device),
                                  tok.prompt_len, tok.targets.to(sampler_device), tok.temperature).to(device)
    sites = _depth_sites(ref_sites, smp_sites, tok, device)
    total = _k3_and_dp(full, ref.detach(), tok.valid)
    refined: list[str] = []
    if exact:
        rows_out = []
        for name, paths in comps:
            if on_component is not None:
                on_component(name)
            rows_out.append(_swap_row(learner_model, sampler_model, name, paths, calls, tok, ref))
    else:
        rows_out = _estimated_rows(sampler_model, comps, record, calls, ref, tok, on_component)
        del record
        ref, calls = ref.detach(), _detached(calls)
        rows_out = _refine(rows_out, learner_model, sampler_model, dict(comps), calls, tok, ref, refine, on_component)
        refined = [r["component"] for r in rows_out if r.get("refined")]
    for row in rows_out:
        row["share"] = row["k3"] / total["k3"] if total["k3"] > 0 else 0.0
        if "estimate" in row:
            row["estimate"] = row["estimate"] / total["k3"] if total["k3"] > 0 else 0.0
    out: dict[str, Any] = {"responses": len(rows), "tokens": int(tok.valid.sum()), "rows": rows, "full_forward": total,
                           "mode": "exact" if exact else "estimate", "refined": refined, "components": rows_out,
                           "sites": sites,
                           "share_sum": sum(r["share"] for r in rows_out if not r["component"].endswith("router"))}
    # (a router's share is inside its layer's MLP's, so it is left out of the sum)
    if audit_log_mu is not None:
        audited = audit_log_mu[rows].to(device).double()
        out["audited"] = _k3_and_dp(audited, ref, tok.valid)
        out["decode_and_batch"] = _k3_and_dp(audited, full, tok.valid)  # the decode against the sampler's forward
    out["entry"] = entry_sentence(out)
    return out


def layers_run(model: nn.Module, paths: list[str]) -> int:
    """Decoder layers the exact measurement of a component runs: from its layer on (``start_layer``), or all L for
    the embedding and the residual stream."""
    layers = len(model.get_decoder().layers)
    start = start_layer(model, paths)
    return layers - (0 if start is None else start)


def head_cost(model: nn.Module, response_len: int, total_len: int) -> float:
    """What the end of every exact run costs, in decoder layers' multiply-adds: the lm-head over the response
    positions, and about one layer more for the final norm and the float64 log-softmax over the vocabulary (on
    SmolLM2-135M about 4.6: its head's 49,152 × 576 weights against a layer's 3.5 M, on the ``response_len`` of
    ``total_len`` positions, 32 of 72 there)."""
    head = model.get_output_embeddings().weight
    layer = sum(p.numel() for p in model.get_decoder().layers[0].parameters())
    return 1 + head.numel() * response_len / (layer * total_len)


def _refine(rows: list[dict], learner_model: nn.Module, sampler_model: nn.Module, paths_of: dict[str, list[str]],
            calls: list, tok: _Tokens, ref: Tensor, budget: float,
            on_component: Callable[[str], None] | None) -> list[dict]:
    """``rows`` with the largest first-order estimates measured exactly, their estimate kept beside: the largest
    always, then each of the next that fits in ``budget`` forwards beyond it — a run costing the decoder layers it
    runs (``layers_run``) and ``head_cost``, a forward L of them and one head — so that a late layer's short run
    may follow where an early one's would not fit."""
    end = head_cost(learner_model, tok.targets.shape[1], tok.ids.shape[1])
    limit, spent, first = budget * (len(learner_model.get_decoder().layers) + end), 0.0, True
    for row in sorted((r for r in rows if r["method"] == "estimate"), key=lambda r: -r["estimate"]):
        cost = layers_run(learner_model, paths_of[row["component"]]) + end
        if not first and spent + cost > limit:
            continue
        spent += 0 if first else cost
        first = False
        if on_component is not None:
            on_component(row["component"])
        row.update(_swap_row(learner_model, sampler_model, row["component"], paths_of[row["component"]], calls, tok,
                             ref), refined=True)
    return rows


def _depth_sites(ref_sites: dict[str, Tensor], smp_sites: dict[str, Tensor], tok: _Tokens,
                 device: torch.device) -> list[dict[str, Any]]:
    """The relative error ‖h_sampler − h_learner‖ / ‖h_learner‖ at each hooked site, over the valid positions: the
    difference in the learner's dtype (the sampler's values cast to it exactly, from a narrower one), the norms
    summed in float64."""
    positions = tok.mask if tok.mask.shape[1] == next(iter(ref_sites.values())).shape[1] else None
    sites = []
    for name in ref_sites:
        b = ref_sites[name]
        a = smp_sites[name].to(device=device, dtype=b.dtype)
        keep = (tok.valid if name == "logits" else positions)
        diff, base = (a - b), b
        if keep is not None:
            diff, base = diff[keep], base[keep]
        layer, _, site = name.partition("/")
        norms = [float(torch.linalg.vector_norm(x, dtype=torch.float64)) for x in (diff, base)]
        sites.append({"layer": int(layer) if site else None, "site": site or layer,
                      "rel_error": norms[0] / max(norms[1], 1e-300)})
    return sites


def entry_sentence(loc: dict[str, Any]) -> str:
    """One sentence: where the divergence enters, and how much each part explains (an estimated share marked)."""
    total = loc["full_forward"]["k3"]
    if total <= 0 or all(r["k3"] <= 0 for r in loc["components"]):
        return ("Nothing to localise: the sampler's forward gives the learner's log-probs on these tokens "
                "(k3 0).")
    ranked = sorted(loc["components"], key=lambda r: -r["share"])
    top = ranked[0]

    def said(row: dict[str, Any]) -> str:
        return f"{row['component']} {100 * row['share']:.0f} %" + (" (estimate)" if row["method"] == "estimate" else "")

    parts = ", ".join(said(r) for r in ranked[:3])
    how = ("swapping it alone into the fp32 learner gives" if top["method"] == "exact" else
           "swapped alone into the fp32 learner, to first order, it gives")
    text = (f"The divergence enters mostly at the {top['component']}: {how} {100 * top['share']:.0f} % of the k3 of "
            f"the sampler's whole forward (largest shares: {parts}; ")
    if loc.get("mode", "exact") == "estimate":
        estimated = sum(r["method"] == "estimate" for r in loc["components"])
        same = len(loc["components"]) - estimated - len(loc["refined"])
        counts = [f"{len(loc['refined'])} measured exactly (the largest estimates)",
                  f"{estimated} estimated to first order (--localize-exact measures every one)" if estimated else "",
                  f"{same} computing exactly the learner's output" if same else ""]
        text += "components: " + ", ".join(c for c in counts if c) + "; "
    text += f"sum of all shares {100 * loc['share_sum']:.0f} %"
    text += ")." if 0.5 <= loc["share_sum"] <= 1.5 else "; far from 100 %, so the components' errors interact)."
    if "decode_and_batch" in loc and "audited" in loc:
        text += (f" The audit's own decode has k3 {loc['audited']['k3']:.3g} on these tokens against "
                 f"{total:.3g} for the sampler's full forward; between the decode and that forward: "
                 f"{loc['decode_and_batch']['k3']:.3g} (the KV cache and the batch's other rows).")
    return text
