"""Mixture-of-experts routing: capture which experts a model chose, compare two choices, replay one.

A routed-experts tensor holds, per token position and MoE layer, the ids of the top-k experts the router
picked: shape (B, T, L, k), integer (``compact_expert_dtype``: uint8 below 256 experts). The order inside the
last dimension carries no meaning (a top-k *set*); comparisons sort it first.

Metrics (pure functions, ``mask`` (B, T) bool marks the valid tokens)::

    flipped[b, t, l]          = set(a[b, t, l]) ≠ set(b[b, t, l])
    routing_flip_share        = Σ_{valid t, l} flipped / (L · #valid)              (token × layer pairs)
    routing_flip_token_share  = #{valid t : ∃ l flipped} / #valid                  (tokens)
    layer_flip_rate[l]        = Σ_{valid t} flipped[·, ·, l] / #valid

Capture and replay hook into the router module of every MoE layer. transformers' MoE families (Qwen3-MoE,
Qwen2-MoE, OLMoE, Mixtral, ...) share one router surface: ``router(hidden (N, H)) → (router_logits (N, E),
gate_weights (N, k), expert_ids (N, k))`` — the module transformers' own output recorder names as the source of
``router_logits`` (``model._can_record_outputs``). ``find_routers`` returns them in layer order.

Replay (Rollout Routing Replay, R3): the router's choice is replaced by the given expert ids, and the gate
weights are recomputed from the router's *own* logits over those experts, with the router's own rule::

    p = softmax(router_logits)                     (over all E experts, float32, as the routers do)
    g_j = p[e_j]                  (norm_topk_prob False: Qwen3-MoE / Qwen2-MoE / OLMoE default)
    g_j = p[e_j] / Σ_i p[e_i] = softmax(router_logits[e])_j     (norm_topk_prob True; Mixtral always)

The second line is R3's "softmax over the replayed experts' logits". A router's rule is its ``norm_topk_prob``
attribute when it has one; otherwise (Mixtral) it is read off the router's own output in the same call (its
gate weights either sum to 1 over the top-k or equal the raw probabilities), so no per-family table is needed;
a router following neither rule (e.g. sigmoid gates) is refused. Gradients
flow into the router through the logits, as in R3.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from rollcorr.rollout import Rollout

ROUTING_REPLAY_MODES = (None, "r3")


# ---- the routers of a model ---------------------------------------------------------------------------


def _router_class(model: nn.Module) -> type | None:
    """The router module class transformers records ``router_logits`` from, or None for a dense model."""
    for module in (model, getattr(model, "model", None)):
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            return getattr(recorder, "target_class", recorder)
    return None


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The router of every MoE layer of a transformers model, in layer order ([] for a dense model).

    A router is a module of the class transformers' output recorder names for ``router_logits`` that also has
    the top-k surface (``top_k``, ``num_experts``); an int8-quantised copy keeps these modules.
    """
    cls = _router_class(model)
    if cls is None or not isinstance(cls, type):
        return []
    return [
        m for m in model.modules() if isinstance(m, cls) and hasattr(m, "top_k") and hasattr(m, "num_experts")
    ]


def is_moe(model: nn.Module) -> bool:
    return bool(find_routers(model))


def routing_shape(model: nn.Module) -> tuple[int, int, int]:
    """(MoE layers L, top-k, experts E) of a model; ValueError for a dense one."""
    routers = find_routers(model)
    if not routers:
        raise ValueError(
            f"{type(model).__name__} has no mixture-of-experts router: routing needs an MoE model"
        )
    return len(routers), int(routers[0].top_k), int(routers[0].num_experts)


def compact_expert_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype holding expert ids 0 … num_experts − 1 (uint8 below 256, else int16/int32)."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2**15 else torch.int32


# ---- metrics ------------------------------------------------------------------------------------------


def routing_flips(a: Tensor, b: Tensor) -> Tensor:
    """(B, T, L) bool: True where the top-k expert *sets* of ``a`` and ``b`` (B, T, L, k) differ."""
    if a.shape != b.shape:
        raise ValueError(f"routed experts of shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be compared")
    if a.dim() != 4:
        raise ValueError(f"routed experts must be (B, T, layers, top_k), got shape {tuple(a.shape)}")
    return (a.long().sort(-1).values != b.long().sort(-1).values).any(-1)


def routing_flip_metrics(a: Tensor, b: Tensor, mask: Tensor) -> dict[str, float | list[float]]:
    """Flip shares of two routed-experts tensors (B, T, L, k) over the valid tokens ``mask`` (B, T).

    routing_flip_share (token × layer pairs), routing_flip_token_share (tokens with ≥ 1 flipped layer),
    routing_layer_flip_rate (list, one per layer), routing_tokens (valid tokens compared); shares are 0.0
    when no token is valid.
    """
    flips = routing_flips(a, b)
    valid = mask.bool()
    if tuple(valid.shape) != tuple(flips.shape[:2]):
        raise ValueError(f"mask has shape {tuple(valid.shape)}, expected {tuple(flips.shape[:2])}")
    n = int(valid.sum())
    per_token = flips[valid].float()  # (n, L)
    per_layer = per_token.mean(0) if n else torch.zeros(flips.shape[-1])
    return {
        "routing_flip_share": float(per_token.mean()) if n else 0.0,
        "routing_flip_token_share": float(per_token.amax(-1).mean()) if n else 0.0,
        "routing_layer_flip_rate": [float(x) for x in per_layer],
        "routing_tokens": n,
    }


def delta_p_by_flip(delta_p: Tensor, flips: Tensor, mask: Tensor) -> dict[str, float | int | None]:
    """Mean and max |Δp| (``delta_p`` (B, T)) on valid tokens with ≥ 1 flipped layer (``flips`` (B, T, L)) and
    on the others; None where a group is empty, with the token count of each group."""
    token_flipped = flips.any(-1) & mask.bool()
    unflipped = ~flips.any(-1) & mask.bool()
    out: dict[str, float | int | None] = {}
    for name, group in (("flipped", token_flipped), ("unflipped", unflipped)):
        d = delta_p[group].abs().double()
        out[f"abs_dp_mean_{name}"] = float(d.mean()) if d.numel() else None
        out[f"abs_dp_max_{name}"] = float(d.max()) if d.numel() else None
        out[f"tokens_{name}"] = int(d.numel())
    return out


def routing_summary(
    sampler_experts: Tensor,
    learner_experts: Tensor,
    rollout_log_prob: Tensor,
    old_log_prob: Tensor,
    mask: Tensor,
) -> dict[str, float | int | list[float] | None]:
    """The audit's routing section: ``routing_flip_metrics`` of the sampler's vs the learner's own experts
    (B, T, L, k), and |Δp| = |exp(log μ) − exp(log π_old)| (B, T) split by tokens with / without a flipped
    layer (``delta_p_by_flip``), plus ``abs_dp_share_flipped``: the share of Σ|Δp| the flipped tokens carry."""
    flips = routing_flips(sampler_experts, learner_experts)
    delta_p = rollout_log_prob.double().exp() - old_log_prob.double().exp()
    valid = mask.bool()
    total = float(delta_p.abs()[valid].sum())
    on_flipped = float(delta_p.abs()[valid & flips.any(-1)].sum())
    return {
        **routing_flip_metrics(sampler_experts, learner_experts, valid),
        **delta_p_by_flip(delta_p, flips, valid),
        "abs_dp_share_flipped": on_flipped / total if total > 0 else 0.0,
    }


def routing_add(
    counts: dict | None,
    sampler_experts: Tensor,
    learner_experts: Tensor,
    rollout_log_prob: Tensor,
    old_log_prob: Tensor,
    mask: Tensor,
) -> dict:
    """``routing_summary``'s sums, chunk by chunk: add one chunk's flips and |Δp| (the arguments of
    ``routing_summary``) to the running ``counts`` (None at first) and return them; ``{"mismatch": True}`` once
    two chunks disagree on the number of MoE layers or top-k. ``routing_result`` turns the sums into the
    summary."""
    if counts is not None and counts.get("mismatch"):
        return counts
    if sampler_experts.shape != learner_experts.shape:  # another top-k or layer count
        return {"mismatch": True}
    flips = routing_flips(sampler_experts, learner_experts)  # (B, T, L)
    valid = mask.bool()
    dp = (rollout_log_prob.double().exp() - old_log_prob.double().exp()).abs()
    token_flipped = flips.any(-1)
    r = counts or {"tokens": 0, "layer": torch.zeros(flips.shape[-1], dtype=torch.float64), "any": 0,
                   "total": 0.0, "on_flipped": 0.0, "groups": {g: [0, 0.0, None] for g in ("flipped", "unflipped")}}
    if r["layer"].numel() != flips.shape[-1]:
        return {"mismatch": True}
    r["tokens"] += int(valid.sum())
    r["layer"] += flips[valid].double().sum(0)
    r["any"] += int((token_flipped & valid).sum())
    r["total"] += float(dp[valid].sum())
    r["on_flipped"] += float(dp[valid & token_flipped].sum())
    for g, sel in (("flipped", token_flipped & valid), ("unflipped", ~token_flipped & valid)):
        d = dp[sel]
        acc = r["groups"][g]
        acc[0] += int(d.numel())
        acc[1] += float(d.sum())
        if d.numel():
            acc[2] = float(d.max()) if acc[2] is None else max(acc[2], float(d.max()))
    return r


def routing_result(counts: dict) -> dict:
    """``routing_summary``'s dict from the sums of ``routing_add``."""
    n = counts["tokens"]
    layers = counts["layer"] / n if n else torch.zeros_like(counts["layer"])
    out: dict = {
        "routing_flip_share": float(counts["layer"].sum() / (n * counts["layer"].numel())) if n else 0.0,
        "routing_flip_token_share": counts["any"] / n if n else 0.0,
        "routing_layer_flip_rate": [float(x) for x in layers],
        "routing_tokens": n,
    }
    for g in ("flipped", "unflipped"):
        count, total, top = counts["groups"][g]
        out[f"abs_dp_mean_{g}"] = total / count if count else None
        out[f"abs_dp_max_{g}"] = top
        out[f"tokens_{g}"] = count
    out["abs_dp_share_flipped"] = counts["on_flipped"] / counts["total"] if counts["total"] > 0 else 0.0
    return out


ROUTING_DOMINATES = 0.5  # flipped tokens carry more than this share of Σ|Δp|: routing is the main gap


def routing_sentence(summary: dict) -> str | None:
    """The routing finding in words, from ``routing_summary``'s dict (the audit's verdict, analyze's notes): how
    often the two sides chose different experts, and, when the flipped tokens carry most of Σ|Δp|, that routing
    is the gap to fix first (replay, R3). None when every decision agreed."""
    if summary["routing_flip_share"] == 0:
        return None
    unflipped = summary["abs_dp_mean_unflipped"]  # None when every token has a flipped layer
    others = "no token unflipped" if unflipped is None else f"vs {unflipped:.3g} on the others"
    text = (
        f"Routing: {_percent(summary['routing_flip_share'])} of token × layer router decisions differ between the "
        f"sampler and the learner ({_percent(summary['routing_flip_token_share'])} of tokens have at least one "
        f"flipped layer); those tokens carry {_percent(summary['abs_dp_share_flipped'])} of Σ|Δp| (mean |Δp| "
        f"{summary['abs_dp_mean_flipped']:.3g}, {others})."
    )
    if summary["abs_dp_share_flipped"] > ROUTING_DOMINATES:
        text += (
            " Routing flips dominate the mismatch: replay the sampler's experts in the learner "
            "(model.routing_replay=r3, Rollout Routing Replay) before reweighting."
        )
    return text


def _percent(x: float) -> str:
    return f"{100 * x:.2g} %" if x < 0.1 else f"{100 * x:.1f} %"


# ---- capture --------------------------------------------------------------------------------------------


class RoutingRecorder:
    """What ``capture_routing`` saw: one (N, L, k) int64 tensor per model call, N = tokens of that call
    (the router's flattened batch × positions, row-major)."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._pending: list[Tensor] = []
        self.calls: list[Tensor] = []

    def _record(self, expert_ids: Tensor) -> None:
        self._pending.append(expert_ids.detach().to("cpu", torch.long))
        if len(self._pending) == self.layers:  # the last MoE layer of one model call
            self.calls.append(torch.stack(self._pending, 1))
            self._pending = []

    def take(self) -> list[Tensor]:
        """The calls recorded so far (then forgotten)."""
        calls, self.calls = self.calls, []
        return calls


def router_choice(router_logits: Tensor, top_k: int) -> Tensor:
    """(N, k) the experts a softmax top-k router picks from its ``router_logits`` (N, E): the top-k of
    softmax(logits) in float32, as transformers' routers compute it — the router's *own* choice, whatever a
    replay then makes the layer run."""
    return torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1).indices


@contextmanager
def capture_routing(model: nn.Module, own: bool = False) -> Iterator[RoutingRecorder]:
    """Record the experts every MoE router of ``model`` picks, per model call, while inside the block.

    ``own=False``: the experts each layer ran (under ``replay_routing``, the replayed ones). ``own=True``: the
    router's own choice from its logits (``router_choice``), which a replay leaves untouched — what the model
    would have picked at that position (for the flip metrics of a replayed forward)."""
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts router: nothing to capture")
    recorder = RoutingRecorder(len(routers))

    def hook(router: nn.Module, _inputs, out: tuple) -> None:
        recorder._record(router_choice(out[0], int(router.top_k)) if own else out[2])

    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        yield recorder
    finally:
        for h in handles:
            h.remove()


def response_routing(calls: list[Tensor], prompt_len: int, response_mask: Tensor) -> Tensor:
    """(B, T, L, k) the routing of the positions that predict the response tokens (input position P − 1 + t
    for y_t), from the ``capture_routing`` calls (N, L, k) of one scoring forward over (B, P + T) inputs,
    prompt + response, run whole or in row chunks in order; 0 on padding."""
    b, t = response_mask.shape
    routes = torch.cat(calls) if calls else torch.empty(0, 0, 0, dtype=torch.long)
    if routes.dim() != 3 or routes.shape[0] != b * (prompt_len + t):
        raise ValueError(
            f"captured routing of {routes.shape[0]} tokens does not match one forward over {b} rows × "
            f"{prompt_len} + {t} positions (prompt + response)"
        )
    routing = routes.view(b, prompt_len + t, *routes.shape[1:])[:, prompt_len - 1 : prompt_len - 1 + t]
    return routing.masked_fill(~response_mask.bool().to(routing.device)[..., None, None], 0)


# ---- replay ---------------------------------------------------------------------------------------------


def replay_gate_weights(router_logits: Tensor, expert_ids: Tensor, normalize: bool) -> Tensor:
    """Gate weights (N, k) float32 of the experts ``expert_ids`` (N, k) from ``router_logits`` (N, E): the
    softmax probabilities of those experts, renormalised over them when ``normalize`` (module docstring)."""
    probs = torch.softmax(router_logits.float(), dim=-1).gather(-1, expert_ids)
    return probs / probs.sum(-1, keepdim=True) if normalize else probs


def _gate_rule(logits: Tensor, weights: Tensor, ids: Tensor) -> bool:
    """Whether a router's own gate weights are renormalised over its top-k (True) or raw softmax (False)."""
    w = weights.float()
    raw = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
    tol = dict(atol=1e-2, rtol=1e-2)  # the gate weights may be bf16
    if torch.allclose(w, raw / raw.sum(-1, keepdim=True), **tol):
        return True
    if torch.allclose(w, raw, **tol):
        return False
    raise ValueError(
        "this router's gate weights are neither softmax probabilities nor their top-k renormalisation: "
        "routing replay supports softmax routers only"
    )


class RoutingReplay:
    """The experts to force on the next model call(s): ``expert_ids`` (B, S, L, k) for inputs (B, S), with
    −1 (any negative id) where the router keeps its own choice (padding, positions nobody recorded).

    A call over b < B rows takes the next b rows (a cursor that wraps at B), so a caller that scores the
    batch in row chunks, in order, replays each chunk's own routing; a call over all B rows takes them all.
    """

    def __init__(self, expert_ids: Tensor | None = None, layers: int = 1) -> None:
        self.expert_ids = expert_ids
        self.layers = layers
        self.forced_tokens = 0  # token × layer pairs whose experts were replaced, for checks and metrics
        self._cursor = 0
        self._handles: list = []

    def set(self, expert_ids: Tensor | None) -> None:
        """Replay ``expert_ids`` from the next call on (None: the routers choose), rows from the first."""
        self.expert_ids, self._cursor = expert_ids, 0

    def remove(self) -> None:
        """Take the replay hooks off the routers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _replace(self, layer: int, output: tuple, router: nn.Module) -> tuple:
        logits, weights, own = output[0], output[1], output[2]
        if self.expert_ids is None:
            return output
        rows, positions = self.expert_ids.shape[:2]
        n = own.shape[0] // positions
        if own.shape[0] % positions or self._cursor + n > rows or own.shape[-1] != self.expert_ids.shape[-1]:
            raise ValueError(
                f"routing replay holds {rows} rows × {positions} positions × top-{self.expert_ids.shape[-1]} but "
                f"the router of MoE layer {layer} sees {own.shape[0]} tokens × top-{own.shape[1]}: replay expert "
                "ids must be (B, S, layers, top_k) for inputs (B, S), scored whole or in row chunks in order"
            )
        chunk = self.expert_ids[self._cursor : self._cursor + n, :, layer]
        want = chunk.reshape(-1, own.shape[-1]).to(own.device, torch.long)
        if layer == self.layers - 1:
            self._cursor = (self._cursor + n) % rows
        keep_own = (want < 0).any(-1, keepdim=True)
        ids = torch.where(keep_own, own, want)
        normalize = getattr(router, "norm_topk_prob", None)
        if normalize is None:
            normalize = _gate_rule(logits, weights, own)
        gates = replay_gate_weights(logits, ids, bool(normalize)).to(weights.dtype)
        self.forced_tokens += int((~keep_own).sum())
        return (logits, gates, ids, *output[3:])


def attach_replay(model: nn.Module, expert_ids: Tensor | None = None) -> RoutingReplay:
    """Install routing replay on every router of ``model`` until ``replay.remove()`` (see ``replay_routing``,
    the scoped form). For a caller whose backward pass re-runs the forward (gradient checkpointing), where the
    replay must outlive the forward call."""
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts router: nothing to replay")
    if expert_ids is not None and expert_ids.dim() == 4 and expert_ids.shape[2] != len(routers):
        raise ValueError(f"routing replay holds {expert_ids.shape[2]} layers, the model has {len(routers)}")
    replay = RoutingReplay(expert_ids, layers=len(routers))
    replay._handles = [  # prepended: a capture_routing around or inside records the replayed experts
        r.register_forward_hook(lambda m, _i, out, layer=i: replay._replace(layer, out, m), prepend=True)
        for i, r in enumerate(routers)
    ]
    return replay


@contextmanager
def replay_routing(model: nn.Module, expert_ids: Tensor | None = None) -> Iterator[RoutingReplay]:
    """Force the experts ``expert_ids`` (B, S, L, k; −1 = the router's own choice) on every model call inside
    the block, gate weights recomputed from the model's own router logits (module docstring). Works on any
    transformers MoE whose routers return (logits, gate weights, expert ids); the yielded ``RoutingReplay``'s
    ``expert_ids`` may be changed between calls (None: no replay)."""
    replay = attach_replay(model, expert_ids)
    try:
        yield replay
    finally:
        replay.remove()


# ---- a rollout's routing over its full sequence ---------------------------------------------------------


def sequence_routing(
    prompt_mask: Tensor, response_mask: Tensor, routed_experts: Tensor, prompt_routed_experts: Tensor | None
) -> Tensor:
    """(B, P + T, L, k) int64 expert ids for a learner forward over prompt + response, −1 where the router
    keeps its own choice.

    ``routed_experts`` (B, T, L, k): entry t is the routing of the position that predicts y_t (input position
    P − 1 + t); ``prompt_routed_experts`` (B, P, L, k), optional: the routing of each prompt position. Padding
    and the last response position (it predicts nothing that is scored) get −1.
    """
    b, p = prompt_mask.shape
    t = response_mask.shape[1]
    layers, k = routed_experts.shape[2:]
    out = torch.full((b, p + t, layers, k), -1, dtype=torch.long)
    if prompt_routed_experts is not None:
        out[:, :p] = torch.where(prompt_mask.bool()[..., None, None], prompt_routed_experts.long(), -1)
    # position P − 1 + t predicts y_t: set where y_t is a valid token (the last prompt position for t = 0)
    predicts = torch.where(response_mask.bool()[..., None, None], routed_experts.long(), -1)
    window = out[:, p - 1 : p - 1 + t]
    out[:, p - 1 : p - 1 + t] = torch.where(predicts >= 0, predicts, window)
    return out


# ---- a training step's flips ------------------------------------------------------------------------------


class RoutingFlips:
    """``routing/flip_share`` and ``routing/flip_token_share`` of one training step (a mixture-of-experts model
    whose rollout carries the sampler's ``routed_experts``): how far ``model``'s own routers are from the
    sampler's choice, over the valid response tokens (``routing_flip_metrics``).

    Measured in the π_θ forwards of the first PPO epoch (each row scored once; no extra forward): a
    ``capture_routing(own=True)`` records the top-k of the learner's own router logits, so under
    ``routing_replay=r3`` — where the layers run the sampler's experts — it still describes the routers' own
    choice. Micro-batches are weighted by their valid tokens, which makes the shares exact over the batch;
    ``metrics(total)`` adds the sums over data-parallel ranks (``total=ranks.all_reduce``). Inactive (no metric)
    for a dense model or a rollout without routing."""

    def __init__(self, model: nn.Module, rollout: Rollout) -> None:
        self.model = model
        self.active = rollout.routed_experts is not None and is_moe(model)
        self.sums = torch.zeros(3, dtype=torch.float64)  # Σ flipped pairs / L, Σ flipped tokens, Σ valid tokens

    @contextmanager
    def scoring(self, part: Rollout, measure: bool) -> Iterator[None]:
        """Around the learner's forward over ``part``: adds its flips when ``measure`` (the first epoch)."""
        if not (self.active and measure):
            yield
            return
        with capture_routing(self.model, own=True) as recorder:
            yield
        own = response_routing(recorder.take(), part.prompt_ids.shape[1], part.response_mask)
        m = routing_flip_metrics(part.routed_experts, own, part.response_mask)
        n = float(m["routing_tokens"])
        self.sums += torch.tensor([m["routing_flip_share"] * n, m["routing_flip_token_share"] * n, n],
                                  dtype=torch.float64)

    def metrics(self, total: Callable[[Tensor], Tensor] = lambda sums: sums) -> dict[str, float]:
        """The two shares from ``total(sums)`` (the sums over every rank; default: this process's)."""
        if not self.active:
            return {}
        sums = total(self.sums)
        n = max(float(sums[2]), 1.0)
        return {"routing/flip_share": float(sums[0]) / n, "routing/flip_token_share": float(sums[1]) / n}
