"""Models: the shipped built-in checkpoint and loading of any local Hugging Face model directory."""

from rollcorr.models.builtin import BUILTIN, BUILTIN_DIR, build_tokenizer, load_builtin, load_model

__all__ = ["BUILTIN", "BUILTIN_DIR", "build_tokenizer", "load_builtin", "load_model"]
