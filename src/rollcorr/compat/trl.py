"""rollcorr inside TRL's ``GRPOTrainer`` (TRL 1.16).

``RollcorrGRPOTrainer`` is ``GRPOTrainer`` with one change: after TRL generates and scores a batch, the
sampler's log-probs (``sampling_per_token_logps``: vLLM's, or a ``rollout_func``'s ``logprobs``) and the
learner's (``old_per_token_logps``, computed here when TRL skipped it) go through
``rollcorr.correction.compute_correction`` with any rollcorr preset or ``CorrectionConfig``. The
resulting weights replace TRL's ``importance_sampling_ratio`` (TRL's ``vllm_importance_sampling_*`` options
are not used), rejected tokens leave ``completion_mask`` (or, with ``denominator="original"``, keep their
place in the denominator with weight 0, as TRL's mask modes do), the ``rollout_corr/*`` metrics go through
TRL's own logger, and with ``dump_path`` every batch is appended to a dump that ``rollcorr analyze`` reads.

    trainer = RollcorrGRPOTrainer(model, reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                                  correction="decoupled_token_is", dump_path="runs/trl/rollouts.jsonl")

The learner (π_old and the loss) runs at ``learner_precision``: fp32 unless told otherwise (TRL's
``GRPOConfig`` turns bf16 autocast on by default, which would put a bf16 gap between π_old and an fp32
sampler); the trainer prints which precision it uses when it starts.

``SamplerRollout(spec)`` is a TRL ``rollout_func`` backed by any rollcorr sampler (``hf:*``, ``vllm:*``,
``llamacpp:*``): it samples one completion per prompt TRL hands it, reports log μ of every token, and loads
the trainer's weights into the sampler whenever the optimiser has stepped. TRL's own colocated vLLM
(``use_vllm=True, vllm_mode="colocate"``) fails at its first weight sync on vLLM's CPU build and is refused
there with a pointer to it.

Mixture-of-experts models: ``routing_replay="r3"`` replays the sampler's experts in every forward of the policy
(π_old and the loss's π_θ, through the backward pass's recomputation under gradient checkpointing;
rollcorr.moe.attach_replay). The ``rollout_func`` returns them per completion as ``routed_experts`` (one
(layers, top_k) list per completion token: the routing of the position that predicts it) and, optionally,
``prompt_routed_experts`` (one per prompt token), as rollcorr's hf sampler records them; ``SamplerRollout``
passes them on. With ``dump_path`` (replay or not) the dump gets them as ``routed_experts`` and, as
``learner_routed_experts``, the learner's own router choice in its π_old forward (``capture_routing(own=True)``,
unchanged by a replay), so ``rollcorr analyze`` reports the routing flips.

Top-k / top-p (the keep mask, docs/three-policies.md): TRL scores the policy over the whole vocabulary, so
against a truncated sampler every ratio would carry the kept mass (TRL issue #6789). When the ``rollout_func``
returns ``kept_ids`` (per completion, one list of kept token ids per token: ``SamplerRollout`` does under top-k /
top-p), the policy's π_old and π_θ are renormalised over those sets: the backbone's last hidden states of TRL's
own scoring forward are taken (a forward hook) and scored over the kept ids (``rollcorr.logprobs.logprobs_over_kept``);
TRL's full-vocabulary entropy is kept, and the frozen reference (``beta`` > 0) stays full-vocabulary.

A token whose sampling log-prob is NaN (vLLM reports None) gets ratio 1 (its learner log-prob stands in),
as TRL does. TRL's ``vespo`` loss reads the ratio its own way and is refused.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch

with warnings.catch_warnings():  # TRL 1.16 warns once per module that imports vLLM when vLLM is newer than 0.31
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
    from trl import GRPOConfig, GRPOTrainer

from rollcorr.config.correction import CorrectionConfig
from rollcorr.config.presets import preset
from rollcorr.correction.api import compute_correction
from rollcorr.correction.metrics import metrics_to_floats
from rollcorr.dumps import write_dump
from rollcorr.logprobs import logprobs_over_kept
from rollcorr.moe import attach_replay, capture_routing, response_routing, sequence_routing

__all__ = ["LEARNER_PRECISIONS", "RollcorrGRPOTrainer", "SamplerRollout", "correct_trl_batch", "trl_kept_ids"]

# learner precision -> (GRPOConfig.bf16, GRPOConfig.fp16, accelerate's mixed_precision)
LEARNER_PRECISIONS = {
    "fp32": (False, False, "no"),
    "bf16": (True, False, "bf16"),
    "fp16": (False, True, "fp16"),
}


def correct_trl_batch(
    old_per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    config: CorrectionConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(importance_sampling_ratio (B, T), completion_mask after rejection, ``rollout_corr/*`` floats) for
    TRL's tensors. Weights are 1 where the config applies none; with ``denominator="original"`` rejected
    tokens keep the mask and get weight 0 (TRL's convention), otherwise they leave the mask."""
    sampling = torch.where(
        torch.isnan(sampling_per_token_logps), old_per_token_logps, sampling_per_token_logps
    )
    result = compute_correction(old_per_token_logps, sampling, completion_mask, config)
    keep = result.kept_mask.bool()
    valid = completion_mask.bool()
    weights = torch.ones_like(old_per_token_logps) if result.is_weights is None else result.is_weights
    weights = weights.to(old_per_token_logps.dtype)
    if config.denominator == "original":
        weights = torch.where(keep, weights, 0.0)
        mask = completion_mask
    else:
        mask = completion_mask * keep.to(completion_mask.dtype)
    return torch.where(valid, weights, 0.0), mask, metrics_to_floats(result.metrics)


class RollcorrGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose off-policy correction is rollcorr's (see the module docstring).

    correction         a preset name (``rollcorr.config.presets``) or a ``CorrectionConfig`` (decoupled mode)
    dump_path          JSONL file that every generated batch is appended to (None: no dump); on an MoE model
                       whose rollout_func returns ``routed_experts``, with them and the learner's own routing
    learner_precision  "fp32" (default), "bf16" or "fp16": the learner's autocast; replaces GRPOConfig's
                       bf16 / fp16 flags (TRL defaults to bf16)
    routing_replay     None, or "r3": replay the rollout_func's ``routed_experts`` (module docstring)
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any,
        args: GRPOConfig | None = None,
        *rest: Any,
        correction: str | CorrectionConfig = "decoupled_token_is",
        dump_path: str | Path | None = None,
        learner_precision: str = "fp32",
        routing_replay: str | None = None,
        **kwargs: Any,
    ) -> None:
        if routing_replay not in (None, "r3"):
            raise ValueError(f"routing_replay must be None or 'r3', got {routing_replay!r}")
        self.routing_replay, self._replay = routing_replay, None
        self._kept: torch.Tensor | None = None  # (B, T, K) kept sets of the batch being scored (the keep mask)
        self._sampler_routes: torch.Tensor | None = None  # (B, P + T, L, k) of the batch being scored
        self._own_routing: list[torch.Tensor] | None = None  # the learner's own routing, captured for the dump
        self.correction = preset(correction) if isinstance(correction, str) else correction
        if not isinstance(self.correction, CorrectionConfig):
            raise ValueError(f"correction must be a preset name or a CorrectionConfig, got {correction!r}")
        if self.correction.mode != "decoupled":
            raise ValueError(
                "RollcorrGRPOTrainer: TRL's old_per_token_logps is π_old; use a decoupled correction"
            )
        if learner_precision not in LEARNER_PRECISIONS:
            raise ValueError(
                f"learner_precision must be one of {sorted(LEARNER_PRECISIONS)}, got {learner_precision!r}"
            )
        if args is None:  # TRL's own default config, at the precision asked for
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = GRPOConfig(f"{str(name).rstrip('/').split('/')[-1]}-GRPO")
        refuse_colocated_vllm_on_cpu(args)
        args = copy.copy(args)  # the caller's config is left as it was
        args.bf16, args.fp16, args.mixed_precision = LEARNER_PRECISIONS[learner_precision]
        self.learner_precision = learner_precision
        self.dump_path = None if dump_path is None else Path(dump_path)
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        if self.loss_type == "vespo":
            raise ValueError(
                "RollcorrGRPOTrainer: loss_type='vespo' reads TRL's own ratio; choose another loss"
            )
        weights = next(self.model.parameters()).dtype
        autocast = "no autocast" if learner_precision == "fp32" else f"{learner_precision} autocast"
        print(
            f"RollcorrGRPOTrainer: learner in {learner_precision} (weights {str(weights).removeprefix('torch.')}, "
            f"{autocast}; learner_precision= to change), correction {self._correction_name(correction)}"
        )
        self._rollcorr_step = 0

    @staticmethod
    def _correction_name(correction: str | CorrectionConfig) -> str:
        return correction if isinstance(correction, str) else "custom CorrectionConfig"

    def _generate(self, prompts: list):
        result = super()._generate(prompts)
        prompt_ids, completion_ids, extra = result[0], result[1], result[5]
        kept = extra.pop("kept_ids", None)
        self._kept = None if kept is None else trl_kept_ids(completion_ids, kept, self._policy())  # for π_old
        if self.routing_replay:  # from here on, TRL's scoring forwards replay the sampler's experts
            self._sampler_routes = trl_routing(prompt_ids, completion_ids, extra.pop("routed_experts", None),
                                               extra.pop("prompt_routed_experts", None))
            self._replay.set(self._sampler_routes)
        elif self.dump_path is not None and extra.get("routed_experts") is not None:  # for the dump only
            self._sampler_routes = trl_routing(prompt_ids, completion_ids, extra["routed_experts"],
                                               extra.get("prompt_routed_experts"))
        return result

    def _generate_and_score_completions(self, inputs):
        if not self.routing_replay:
            return self._score_and_correct(inputs)
        if self._replay is None:  # installed once, kept for the backward passes' recomputed forwards
            self._replay = attach_replay(self.accelerator.unwrap_model(self.model))
        self._replay.set(None)  # generation routes freely; _generate hands the sampler's routing over
        out = self._score_and_correct(inputs)
        out["routed_experts"] = self._replay.expert_ids  # (B, P + T, L, k), for the loss's forward
        return out

    def _score_and_correct(self, inputs):
        # with a dump: the sampler's routing (``_generate``) and the learner's own, from its π_old forward
        self._sampler_routes, self._own_routing = None, [] if self.dump_path is not None else None
        try:
            out = self._score_and_correct_batch(inputs)
            if self._kept is not None:  # split with the batch, for the loss's forwards of π_θ
                out["kept_ids"] = self._kept
            return out
        finally:
            self._sampler_routes = self._own_routing = self._kept = None

    def _policy(self) -> Any:
        """The transformers model TRL's fused head scores (under any accelerate / PEFT wrapper)."""
        model = self.accelerator.unwrap_model(self.model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def _score_and_correct_batch(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        sampling = out.get("sampling_per_token_logps")
        if sampling is None:  # no sampler log-probs (plain HF generation): nothing to correct
            return out
        old = out.get("old_per_token_logps")
        if old is None:
            if self._own_routing:  # TRL scored no π_old, so what was captured is another forward (PEFT's ref)
                self._own_routing.clear()
            old = self._learner_logps(out)
            out["old_per_token_logps"] = old
        mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
        weights, kept, metrics = correct_trl_batch(old, sampling, mask, self.correction)
        out["importance_sampling_ratio"] = weights
        if "tool_mask" in out:
            out["tool_mask"] = out["tool_mask"] * kept
        else:
            out["completion_mask"] = kept
        mode = "train" if self.model.training else "eval"
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)
        if self.dump_path is not None and self.accelerator.is_main_process:
            b = mask.shape[0]
            write_dump(
                self.dump_path, sampling, old, mask, advantages=out["advantages"], tokens=out["completion_ids"],
                extras={"step": [self.state.global_step] * b, "batch": [self._rollcorr_step] * b},
                tokenizer=self.processing_class, correction=self.correction, **self._dump_routing(out, mask),
            )
        self._rollcorr_step += 1
        return out

    def _dump_routing(self, out: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """``routed_experts`` (the rollout_func's) and ``learner_routed_experts`` (the learner's own routers in
        its π_old forward, inside any replay), (B, T, L, k) per completion token, when the batch has both."""
        if self._sampler_routes is None or not self._own_routing:
            return {}
        p, t = out["prompt_ids"].shape[1], out["completion_ids"].shape[1]
        valid = mask.bool().cpu()[..., None, None]
        sampler = self._sampler_routes[:, p - 1 : p - 1 + t].masked_fill(~valid, 0)
        return {"routed_experts": sampler, "learner_routed_experts": response_routing(self._own_routing, p, mask.cpu())}

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        """TRL's scoring forward; with the sampler's kept sets (``self._kept``: π_old's batch, or the loss's
        micro-batch) the policy's log-probs renormalised over them (module docstring)."""
        kept = self._kept
        if kept is None or model is not self.model:  # no keep mask, or the frozen reference
            return self._scored(model, *args, **kwargs)
        policy = self._policy()
        hidden: list[torch.Tensor] = []
        hook = policy.base_model.register_forward_hook(lambda m, i, out: hidden.append(out.last_hidden_state))
        try:
            _, entropies, aux = self._scored(model, *args, **kwargs)
        finally:
            hook.remove()
        input_ids = args[0] if args else kwargs["input_ids"]
        keep = args[2] if len(args) > 2 else kwargs["logits_to_keep"]
        states = torch.cat([h[:, -keep - 1 : -1] for h in hidden])  # (B, T, H): the states predicting the completion
        weight = policy.get_output_embeddings().weight.to(states.dtype)
        ids = torch.nn.functional.pad(kept, [0, 0, 0, max(keep - kept.shape[1], 0)], value=-1)[:, :keep]
        logps = logprobs_over_kept(states.flatten(0, 1), weight, input_ids[:, -keep:].flatten(),
                                   ids.to(states.device).flatten(0, 1), temperature=self.temperature)
        return logps.view(states.shape[:2]), entropies, aux

    def _scored(self, model, *args, **kwargs):
        """TRL's scoring forward; with a dump and sampler routing, the first no-grad forward of the policy in a
        batch (π_old) also records its routers' own choice (``capture_routing(own=True)``)."""
        collect = self._own_routing
        if (collect is None or collect or self._sampler_routes is None or torch.is_grad_enabled()
                or model is not self.model):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        with capture_routing(self.accelerator.unwrap_model(model), own=True) as recorder:
            result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        collect.extend(recorder.take())
        return result

    @torch.no_grad()
    def _learner_logps(self, out: dict[str, torch.Tensor]) -> torch.Tensor:
        """log π_old of the completion tokens, scored by the current model (TRL skips this when it needs
        no ratio: no vLLM, generation aligned with the optimizer step)."""
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.model, ids, attention, out["completion_ids"].size(1),
            batch_size=self.args.per_device_train_batch_size,
        )
        return logps

    def _compute_loss(self, model, inputs):
        if "routed_experts" in inputs:  # stays set through the backward pass (gradient checkpointing re-runs it)
            self._replay.set(inputs["routed_experts"])
        self._kept = inputs.get("kept_ids")  # this micro-batch's kept sets: π_θ over them
        try:
            return self._corrected_loss(model, inputs)
        finally:
            self._kept = None

    def _corrected_loss(self, model, inputs):
        # TRL multiplies the per-token loss by inputs["importance_sampling_ratio"] only on its vLLM path
        # (use_vllm and vllm_importance_sampling_correction); open that path for rollcorr's weights.
        if "importance_sampling_ratio" not in inputs:
            return super()._compute_loss(model, inputs)
        saved = self.use_vllm, self.vllm_importance_sampling_correction
        self.use_vllm = self.vllm_importance_sampling_correction = True
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.use_vllm, self.vllm_importance_sampling_correction = saved


def refuse_colocated_vllm_on_cpu(args: Any) -> None:
    """TRL's colocated vLLM loads weights through ``Parameter.weight_loader``, which vLLM's CPU build does not
    give its parameters: the run would crash at the first weight sync, after the engine has started."""
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "colocate":
        if not torch.cuda.is_available():
            raise ValueError(
                "TRL's colocated vLLM (use_vllm=True, vllm_mode='colocate') crashes at its first weight sync on "
                "vLLM's CPU build; use rollout_func=SamplerRollout('vllm:fp32') (rollcorr.compat.trl) instead"
            )


class SamplerRollout:
    """A TRL ``rollout_func`` backed by a rollcorr sampler (``rollcorr.engines.make_sampler``).

    spec        sampler spec: ``hf[:fp32|bf16|fp16|int8]``, ``vllm[:fp32|bf16|fp16]``, ``llamacpp[:<quant>]``
    model_path  the sampler's model (None: the trainer model's ``name_or_path``)
    seed        seed of the first call's draw (call i uses seed + i); None: nondeterministic
    top_k       sampler top-k (0 = off); temperature, top-p and the length cap come from the GRPOConfig
    keep_mask   under top-k / top-p, also return each token's kept set (``kept_ids``), which
                ``RollcorrGRPOTrainer`` replays in the policy (default True; False: the kept mass stays in
                every ratio, as in TRL)

    Called by TRL as ``rollout_func(prompts, trainer)`` with one prompt per completion (TRL's sampler has
    already repeated each prompt ``num_generations`` times). Before sampling it loads the trainer's weights
    into the sampler when the optimiser has stepped since the last load (``trainer.state.global_step``).
    Returns TRL's ``prompt_ids``, ``completion_ids`` and ``logprobs`` (log μ of each sampled token, after
    temperature / top-k / top-p: what the sampler drew from)."""

    def __init__(
        self, spec: str, model_path: str | Path | None = None, *, seed: int | None = 0, top_k: int = 0,
        keep_mask: bool = True, **sampler_kwargs: Any,
    ) -> None:
        from rollcorr.engines import parse_spec

        self.spec = str(parse_spec(spec))  # a bad spec fails here, before TRL starts
        self.model_path, self.seed, self.top_k, self.sampler_kwargs = model_path, seed, top_k, sampler_kwargs
        self.keep_mask = keep_mask
        self.sampler: Any = None
        self.loaded_step: int | None = None
        self.calls = 0

    def _ensure_sampler(self, trainer: Any) -> Any:
        if self.sampler is None:
            from rollcorr.engines import make_sampler

            path = self.model_path
            if path is None:
                path = getattr(trainer.model.config, "_name_or_path", None) or None
            self.sampler = make_sampler(self.spec, path, **self.sampler_kwargs)
            print(f"SamplerRollout: sampler {self.spec} on {path or 'the built-in model'}")
        return self.sampler

    @torch.no_grad()
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        from rollcorr.engines import SamplingParams

        sampler = self._ensure_sampler(trainer)
        step = int(trainer.state.global_step)
        if step != self.loaded_step:
            model = trainer.accelerator.unwrap_model(trainer.model)
            sampler.load_weights({k: v.detach() for k, v in model.state_dict().items()}, version=step)
            self.loaded_step = step
        tokenizer = trainer.processing_class
        prompt_ids = [_prompt_ids(tokenizer, p) for p in prompts]
        args = trainer.args
        params = SamplingParams(
            max_new_tokens=int(args.max_completion_length),
            temperature=float(args.temperature),
            top_k=self.top_k,
            top_p=float(getattr(args, "top_p", 1.0) or 1.0),
            seed=None if self.seed is None else self.seed + self.calls,
            record_kept_ids=self.keep_mask,
        )
        if params.records_kept_ids:  # a sampler that cannot record its kept sets: one line, before sampling
            from rollcorr.engines.spec import check_kept_ids

            check_kept_ids(self.spec, True, "SamplerRollout", "pass keep_mask=False (the kept mass then stays in "
                           "every ratio)")
        self.calls += 1
        rollout = sampler.generate(prompt_ids, params)
        mask = rollout.response_mask.bool()
        ids, logps = rollout.response_ids, rollout.rollout_log_prob
        out = {
            "prompt_ids": prompt_ids,
            "completion_ids": [ids[b][mask[b]].tolist() for b in range(len(prompt_ids))],
            "logprobs": [logps[b][mask[b]].float().tolist() for b in range(len(prompt_ids))],
        }
        if rollout.kept_ids is not None:  # the keep mask: each token's kept set, −1 padding dropped
            out["kept_ids"] = [[[t for t in ids if t >= 0] for ids in rollout.kept_ids[b][mask[b]].tolist()]
                               for b in range(len(prompt_ids))]
        if rollout.routed_experts is not None:  # a mixture of experts: its routing, for routing_replay="r3"
            prompt_mask = rollout.prompt_mask.bool()
            out["routed_experts"] = [rollout.routed_experts[b][mask[b]].tolist() for b in range(len(prompt_ids))]
            out["prompt_routed_experts"] = [
                rollout.prompt_routed_experts[b][prompt_mask[b]].tolist() for b in range(len(prompt_ids))
            ]
        return out

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None


def _prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    """Token ids of a TRL prompt: a string, or a conversation (list of messages) through the chat template."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def trl_routing(prompt_ids: list[list[int]], completion_ids: list[list[int]], routed, prompt_routed) -> torch.Tensor:
    """A ``rollout_func``'s per-completion routing → (B, P + T, L, k) int64 expert ids over TRL's layout
    (prompts left-padded to P, completions right-padded to T), −1 where the router keeps its own choice."""
    if routed is None:
        raise ValueError("routing_replay='r3' needs the rollout_func to return routed_experts per completion")
    routes = [torch.as_tensor(r, dtype=torch.long) for r in routed]
    p, t = max(map(len, prompt_ids)), max(map(len, completion_ids))
    layers, k = routes[0].shape[1:]
    prompt_mask = torch.tensor([[i >= p - len(ids) for i in range(p)] for ids in prompt_ids])
    response_mask = torch.tensor([[i < len(ids) for i in range(t)] for ids in completion_ids])
    response = torch.zeros(len(routes), t, layers, k, dtype=torch.long)
    for i, r in enumerate(routes):
        response[i, : len(r)] = r[: t]
    prompt = None
    if prompt_routed is not None:
        prompt = torch.zeros(len(routes), p, layers, k, dtype=torch.long)
        for i, r in enumerate(prompt_routed):
            r = torch.as_tensor(r, dtype=torch.long)
            prompt[i, p - len(r) :] = r
    return sequence_routing(prompt_mask, response_mask, response, prompt)


def trl_kept_ids(completion_ids: list[list[int]], kept: list, model: Any) -> torch.Tensor:
    """A ``rollout_func``'s per-completion kept sets (one list of token ids per completion token) → (B, T, K) int32
    over TRL's right-padded completions, −1 padded. ValueError for a model whose head scales or caps its logits
    (the renormalisation scores the plain head) or sets that do not match the completions."""
    text = model.config.get_text_config()
    if getattr(text, "final_logit_softcapping", None) or getattr(text, "logit_scale", None) not in (None, 1, 1.0):
        raise ValueError("kept_ids: the keep mask scores the plain lm-head, and this model scales or caps its logits; "
                         "pass keep_mask=False to the rollout_func")
    if len(kept) != len(completion_ids) or any(len(k) != len(c) for k, c in zip(kept, completion_ids)):
        raise ValueError("kept_ids: the rollout_func must return one kept set per completion token")
    width = max([len(ids) for sets in kept for ids in sets] + [1])
    out = torch.full((len(kept), max(map(len, completion_ids)), width), -1, dtype=torch.int32)
    for b, sets in enumerate(kept):
        for t, ids in enumerate(sets):
            out[b, t, : len(ids)] = torch.as_tensor(ids, dtype=torch.int32)
    return out
