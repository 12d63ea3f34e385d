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
    """What a checkpoint's training state keeps of the model: every tensor (the model's own, not copied: a tied
    one under both names, one storage), or with LoRA the adapters only."""
    if is_lora(model):
        return adapter_state_dict(model)
    return model.state_dict()


def load_trainable_state_dict(model: nn.Module, state: dict[str, Any]) -> None:
    """The inverse of ``trainable_state_dict`` (a LoRA run's base is the run's model.path, loaded already). A full
    model's weights may name a tied tensor once (a Hugging Face export drops the tied lm-head); any other name
    missing or extra is a ValueError."""
    if is_lora(model):
        load_adapter_state_dict(model, state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    own = model.state_dict()
    loaded = {own[name].data_ptr() for name in state if name in own}
    untied = [name for name in missing if own[name].data_ptr() not in loaded]
    if untied or unexpected:
        raise ValueError(f"the checkpoint's weights do not fit the model: missing {untied[:3]}, unexpected "
                         f"{list(unexpected)[:3]}")


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # PEFT's file names
PEFT_PREFIX = "base_model.model."  # PEFT's prefix of a saved adapter's tensor names


def save_adapters(model: nn.Module, folder, tokenizer=None) -> None:
    """The adapters into ``folder`` as PEFT saves them — ``adapter_config.json`` and ``adapter_model.safetensors``,
    so ``PeftModel.from_pretrained(base_model, folder)`` loads them — with the tokenizer's files (the base model
    is the run's ``model.path``; no name of it is recorded, so nothing would look it up)."""
    import copy
    from pathlib import Path

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.peft_config[ADAPTER])
    config.base_model_name_or_path = None
    config.save_pretrained(folder)
    weights = {PEFT_PREFIX + k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    save_file(weights, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def read_adapters(folder) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(LoRA settings for ``apply_lora``, adapter tensors named as an adapted model holds them) from PEFT's files in
    ``folder``, read as data (JSON and safetensors: no code); ValueError naming what does not fit."""
    import json
    from pathlib import Path

    from safetensors import SafetensorError
    from safetensors.torch import load

    from rollcorr.safe_io import UnsafePathError, read_bytes_inside

    folder = Path(folder)
    try:  # regular files only (a link is refused), the config's size bounded
        config = json.loads(read_bytes_inside(folder / ADAPTER_CONFIG, limit=1 << 20))
        r, alpha, targets = config["r"], config["lora_alpha"], config["target_modules"]
        weights = load(read_bytes_inside(folder / ADAPTER_WEIGHTS))
    except (OSError, ValueError, KeyError, TypeError, SafetensorError, UnsafePathError) as err:
        raise ValueError(f"{folder}: not LoRA adapters as PEFT saves them ({type(err).__name__}: {err})") from None
    targets = sorted(targets) if isinstance(targets, (list, tuple)) else targets
    if (type(r) is not int or r < 1 or not isinstance(alpha, (int, float))
            or not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets))):
        raise ValueError(f"{folder / ADAPTER_CONFIG}: r, lora_alpha and target_modules are not a LoRA setting")
    named = {}
    for key, value in weights.items():
        stem, dot, leaf = key.removeprefix(PEFT_PREFIX).rpartition(".")
        named[f"{stem}.{ADAPTER}{dot}{leaf}"] = value  # ...lora_A.weight → ...lora_A.default.weight
    return {"r": r, "alpha": float(alpha), "dropout": 0.0, "target_modules": targets}, named


def merge_adapters(base, folder, out):
    """A plain Hugging Face folder at ``out`` (returned): the model at ``base`` with the adapters PEFT saved in
    ``folder`` merged in, W + (α / r) · B A, as ``merged_state_dict`` gives them — what a LoRA run's checkpoint is
    for a tool that loads one model folder (``rollcorr audit --from-run``)."""
    from rollcorr.models.builtin import load_model

    settings, weights = read_adapters(folder)
    model, tokenizer = load_model(base)
    apply_lora(model, **settings)
    load_adapter_state_dict(model, weights)
    merged = merged_state_dict(model)
    plain, _ = load_model(base)
    plain.load_state_dict(merged)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
