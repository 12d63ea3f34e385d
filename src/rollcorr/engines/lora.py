"""LoRA learners through PEFT: low-rank adapters trained on a frozen base, merged weights for everyone else.

``apply_lora(model, r, alpha, dropout, target_modules)`` injects PEFT's LoRA layers into the model in place
(``peft.inject_adapter_in_model``: the model keeps its class and structure, so every learner path — the
shared-prompt forward, routing replay, the π_old strategies — runs it unchanged), with only the adapters
trainable. Each targeted ``nn.Linear`` W becomes W + (α / r) · B A with A (r × in) random and B (out × r) zero, so
training starts from the base model exactly.

What leaves the learner is always a plain model's weights: ``merged_state_dict`` gives the base's names with
W + (α / r) · B A in place of W — what a sampler loads at each publish, what greedy evaluation scores, and what a
checkpoint's ``model/`` folder holds (``from_pretrained`` loads it with no PEFT). A checkpoint's training state
holds only the adapters (``adapter_state_dict``): the base is the run's ``model.path``, rebuilt on resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

ADAPTER = "default"  # PEFT's adapter name
BASE_SUFFIX = ".base_layer"


def apply_lora(model: nn.Module, r: int, alpha: float, dropout: float = 0.0,
               target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place (base frozen, adapters trainable); returns the model.
    ValueError when a target module name matches nothing."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise ValueError('model.lora needs the peft package: pip install -e ".[lora]"') from None
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    missing = sorted(set(target_modules) - names)
    if missing:
        raise ValueError(f"model.lora.target_modules: {missing} match no linear layer of this model "
                         f"(its linear layers: {sorted(names)})")
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules))
    inject_adapter_in_model(config, model)
    return model


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{module name: PEFT LoRA layer} of a model (empty without LoRA)."""
    return {name: module for name, module in model.named_modules()
            if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")}


def is_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The plain model's state dict: base names, W + (α / r) · B A for every adapted layer, no adapter keys."""
    layers = lora_layers(model)
    if not layers:
        return model.state_dict()
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if ".lora_" in key:
                continue
            owner = key.rsplit(".", 1)[0].removesuffix(BASE_SUFFIX)
            plain = key.replace(BASE_SUFFIX + ".", ".")
            if owner in layers and key.endswith(BASE_SUFFIX + ".weight"):
                delta = layers[owner].get_delta_weight(ADAPTER)
                value = value + delta.to(value.dtype)
            out[plain] = value
    return out


def adapter_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors (the trainable state of a LoRA learner), detached copies."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if ".lora_" in k}


def load_adapter_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    """Load adapters saved by ``adapter_state_dict``; ValueError when they do not fit the model's adapters."""
    own = {k for k in model.state_dict() if ".lora_" in k}
    if set(state) != own:
        raise ValueError(f"the checkpoint's LoRA adapters do not fit this run's (model.lora): missing "
                         f"{sorted(own - set(state))[:3]}, unexpected {sorted(set(state) - own)[:3]}")
    model.load_state_dict(state, strict=False)


def trainable_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """What a checkpoint's training state keeps of the model: every tensor, or with LoRA the adapters only."""
    if is_lora(model):
        return adapter_state_dict(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def load_trainable_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    """The inverse of ``trainable_state_dict`` (a LoRA run's base is the run's model.path, loaded already)."""
    if is_lora(model):
        load_adapter_state_dict(model, state)
    else:
        model.load_state_dict(state)
