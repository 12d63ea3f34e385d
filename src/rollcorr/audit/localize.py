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
Cost: the learner's input to every decoder layer is kept from its one reference forward, so a component at layer
i runs only layers i … L−1, the final norm and the lm-head from there (``suffix_log_probs``) — the unchanged
prefix is reused, not recomputed; the embedding and the residual stream, which touch layer 0, run whole. On an
L-layer model the components cost L + 3 full forwards' worth of layers instead of 2L + 4 (30 layers: 33 against 64).
The sampler's *decode* (a KV cache, a batch of other rows) can differ from its full forward: the audit's own
k3 on the same tokens against the all-swapped forward's separates that part (``decode_and_batch``).

This needs both models in this process: the hf engines (any dtype, int8, rtn<k>). vLLM and llama.cpp run their
own kernels out of reach of these hooks; ``localize`` refuses them in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from rollcorr.engines.kvdecode import positions_from_mask
from rollcorr.rollout import Rollout

MAX_RESPONSES = 8  # responses localised by default (each component costs up to a full forward over them)


def _cast(x: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in ``x`` (nested tuples, lists, dicts) to ``dtype``; a float mask keeps its meaning (its
    most negative value becomes ``dtype``'s, not −inf)."""
    if isinstance(x, Tensor):
        if not x.is_floating_point() or x.dtype == dtype:
            return x
        low = torch.finfo(x.dtype).min / 2
        out = x.to(dtype)
        return out.masked_fill(x <= low, torch.finfo(dtype).min) if torch.finfo(dtype).max < torch.finfo(x.dtype).max else out
    if isinstance(x, tuple):
        return tuple(_cast(v, dtype) for v in x)
    if isinstance(x, list):
        return [_cast(v, dtype) for v in x]
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    return x


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
    logits = model.get_output_embeddings()(hidden[:, prompt_len - 1 : prompt_len - 1 + t])
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
    t = targets.shape[1]
    logits = model.get_output_embeddings()(hidden[:, prompt_len - 1 : prompt_len - 1 + t])
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    return log_p.gather(-1, targets[..., None]).squeeze(-1)


def _k3_and_dp(log_p: Tensor, ref: Tensor, valid: Tensor) -> dict[str, float]:
    """k3 of KL(p ‖ ref) (p the perturbed side, as the audit's μ) and mean |Δp| over ``valid`` tokens."""
    lr = (ref - log_p)[valid]
    return {"k3": float((lr.exp() - 1 - lr).mean()), "prob_diff_mean": float((log_p.exp() - ref.exp()).abs()[valid].mean())}


@contextmanager
def _capture(model: nn.Module, sites: list[tuple[str, str, bool]]) -> Iterator[dict[str, Tensor]]:
    """Record, per (name, module path, input?) site, the module's first input (True) or its output."""
    modules, store, handles = dict(model.named_modules()), {}, []
    for name, path, is_input in sites:
        def keep(_m, args, out, name=name, is_input=is_input):
            value = args[0] if is_input else (out[0] if isinstance(out, tuple) else out)
            store[name] = value.detach().double()

        if is_input:
            handles.append(modules[path].register_forward_pre_hook(lambda m, a, name=name: store.__setitem__(name, a[0].detach().double())))
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


@torch.no_grad()
def localize(sampler, learner, rollout: Rollout, *, temperature: float = 1.0, responses: int = MAX_RESPONSES,
             audit_log_mu: Tensor | None = None, on_component: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The module docstring's two measurements on ``responses`` of ``rollout``'s rows. ``audit_log_mu``: the
    audit's log μ of the same tokens (its decode), to separate the decode-and-batch part. ValueError for a sampler
    whose modules are not in this process."""
    sampler_model = getattr(sampler, "model", None)
    if not isinstance(sampler_model, nn.Module) or not hasattr(learner, "model"):
        raise ValueError(f"--localize compares the two models module by module, so both must run in this process "
                         f"(the hf engines); {type(sampler).__name__} runs its own kernels out of reach")
    learner_model = learner.model
    temp = 1.0 if temperature == 0 else float(temperature)
    abs_diff = None
    if audit_log_mu is not None and rollout.old_log_prob is not None:
        abs_diff = (audit_log_mu.exp() - rollout.old_log_prob.exp()).abs()
    rows = pick_rows(rollout, abs_diff, responses)
    part = rollout.select(rows)
    device = next(learner_model.parameters()).device
    ids = torch.cat([part.prompt_ids, part.response_ids], 1).to(device)
    mask = part.attention_mask.to(device)  # the environment's tokens of a trajectory attended, as the learner does
    targets, valid = part.response_ids.to(device), part.response_mask.bool().to(device)
    p = part.prompt_ids.shape[1]
    sampler_device = next(sampler_model.parameters()).device
    # divergence by depth: the two full forwards, hooked
    with _capture(learner_model, _sites(learner_model)) as ref_sites, _layer_calls(learner_model) as calls:
        ref = response_log_probs(learner_model, ids, mask, p, targets, temp)
    with _capture(sampler_model, _sites(sampler_model)) as smp_sites:
        full = response_log_probs(sampler_model, ids.to(sampler_device), mask.to(sampler_device), p,
                                  targets.to(sampler_device), temp).to(device)
    positions = mask if mask.shape[1] == next(iter(ref_sites.values())).shape[1] else None
    sites = []
    for name in ref_sites:
        a, b = smp_sites[name].to(device), ref_sites[name]
        keep = (valid if name == "logits" else positions)
        diff, base = (a - b), b
        if keep is not None:
            diff, base = diff[keep], base[keep]
        layer, _, site = name.partition("/")
        sites.append({"layer": int(layer) if site else None, "site": site or layer,
                      "rel_error": float(diff.norm() / base.norm().clamp(min=1e-300))})
    # what each component adds
    total = _k3_and_dp(full, ref, valid)
    rows_out = []
    for name, paths in components(learner_model):
        if on_component is not None:
            on_component(name)
        start = start_layer(learner_model, paths)  # the unchanged prefix is not run again
        with swapped(learner_model, sampler_model, paths):
            got = (response_log_probs(learner_model, ids, mask, p, targets, temp) if start is None
                   else suffix_log_probs(learner_model, calls, start, p, targets, temp))
        rows_out.append({"component": name, **_k3_and_dp(got, ref, valid)})
    for row in rows_out:
        row["share"] = row["k3"] / total["k3"] if total["k3"] > 0 else 0.0
    out: dict[str, Any] = {"responses": len(rows), "tokens": int(valid.sum()), "rows": rows, "full_forward": total,
                           "components": rows_out, "sites": sites,
                           "share_sum": sum(r["share"] for r in rows_out if not r["component"].endswith("router"))}
    # (a router's share is inside its layer's MLP's, so it is left out of the sum)
    if audit_log_mu is not None:
        audited = audit_log_mu[rows].to(device).double()
        out["audited"] = _k3_and_dp(audited, ref, valid)
        out["decode_and_batch"] = _k3_and_dp(audited, full, valid)  # the decode against the sampler's forward
    out["entry"] = entry_sentence(out)
    return out


def entry_sentence(loc: dict[str, Any]) -> str:
    """One sentence: where the divergence enters, and how much each part explains."""
    total = loc["full_forward"]["k3"]
    if total <= 0 or all(r["k3"] <= 0 for r in loc["components"]):
        return ("Nothing to localise: the sampler's forward gives the learner's log-probs on these tokens "
                "(k3 0).")
    ranked = sorted(loc["components"], key=lambda r: -r["share"])
    top = ranked[0]
    parts = ", ".join(f"{r['component']} {100 * r['share']:.0f} %" for r in ranked[:3])
    text = (f"The divergence enters mostly at the {top['component']}: swapping it alone into the fp32 learner gives "
            f"{100 * top['share']:.0f} % of the k3 of the sampler's whole forward (largest shares: {parts}; "
            f"sum of all shares {100 * loc['share_sum']:.0f} %")
    text += ")." if 0.5 <= loc["share_sum"] <= 1.5 else "; far from 100 %, so the components' errors interact)."
    if "decode_and_batch" in loc and "audited" in loc:
        text += (f" The audit's own decode has k3 {loc['audited']['k3']:.3g} on these tokens against "
                 f"{total:.3g} for the sampler's full forward; between the decode and that forward: "
                 f"{loc['decode_and_batch']['k3']:.3g} (the KV cache and the batch's other rows).")
    return text
