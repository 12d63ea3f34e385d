"""Engine protocols: a ``Sampler`` draws responses (with their log μ), a ``Learner`` scores them (log π).

docs/spec.md §8: ``rollout_log_prob`` is log μ of the sampled token under the distribution the sampler really drew
from — logits / temperature, then top-k, then top-p, renormalised over the kept tokens — and
``log_kept_mass`` is log of the mass the kept tokens had under the tempered (untruncated) distribution, so
log π_full(y_t) = rollout_log_prob + log_kept_mass. With ``SamplingParams.record_kept_ids`` the sampler also
records the kept set itself (``Rollout.kept_ids``: the token ids top-k / top-p kept at each step), so a learner
can renormalise its own distribution over the same set (``sampler_distribution="keep_mask"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from rollcorr.rollout import Rollout

StateDict = dict[str, Tensor]  # parameter name → tensor: what a learner publishes and a sampler loads


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy (log μ = 0 on the chosen token: μ is a point mass).

    max_new_tokens  response length cap (tokens, EOS included)
    temperature     ≥ 0; logits are divided by it (0 → greedy)
    top_k           keep the k most likely tokens (0 = off)
    top_p           keep the smallest set of most likely tokens whose mass reaches top_p (1.0 = off)
    seed            seed of the sampler's torch.Generator (None: nondeterministic)
    record_kept_ids record each step's kept token ids (``Rollout.kept_ids``) when top-k / top-p truncate:
                    DeepSeek-V3.2's "keep sampling mask", vLLM's ``return_sampling_mask``
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    record_kept_ids: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and ≥ 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int ≥ 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.record_kept_ids, bool):
            raise ValueError(f"record_kept_ids must be a bool, got {self.record_kept_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncated(self) -> bool:
        """Top-k or top-p cuts the distribution drawn from (greedy draws the argmax: nothing is cut)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def records_kept_ids(self) -> bool:
        """Whether a sampler records ``Rollout.kept_ids``: asked for, and something is cut."""
        return self.record_kept_ids and self.truncated


@runtime_checkable
class Sampler(Protocol):
    """An inference engine holding one weight version.

    ``generate`` returns a Rollout with n consecutive responses per prompt (sharing a group id), their
    ``rollout_log_prob`` / ``log_kept_mass`` and per-token ``version``. ``meta[i]["finished"]`` tells whether
    row i ended with EOS or the token cap (False when ``max_steps`` stopped decoding first); ``resume=``
    continues the unfinished rows of such a Rollout with the current weights.

    can_resume  whether ``resume=`` / ``max_steps`` work (partial rollouts, ``trainer.partial_rollouts``); a
                class attribute, so the trainer asks it before building the sampler
    """

    version: int
    can_resume: bool

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams,
        *,
        n: int = 1,
        meta: list[dict[str, Any]] | None = None,
        group_ids: list[int] | Tensor | None = None,
        resume: Rollout | None = None,
        max_steps: int | None = None,
    ) -> Rollout: ...

    def load_weights(self, state_dict: StateDict, version: int) -> int: ...

    def close(self) -> None: ...


@runtime_checkable
class Learner(Protocol):
    """The training engine: scores response tokens with full-sequence forwards (prompt + response)."""

    model: nn.Module
    tokenizer: Any

    def log_prob(
        self,
        rollout_or_input: Rollout | tuple[Tensor, Tensor, Tensor, Tensor],
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        grad: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]: ...

    def state_dict(self) -> StateDict: ...

    def parameters(self): ...


def copy_weights(state_dict: StateDict, dtypes: dict[str, Any] | None = None) -> StateDict:
    """A detached CPU copy (the learner keeps training its own tensors), each tensor in ``dtypes[name]`` when
    given (else its own dtype); tensors that share memory (a tied embedding and lm-head) share their copy."""
    copies: dict[tuple, Any] = {}
    out = {}
    for name, value in state_dict.items():
        dtype = (dtypes or {}).get(name, value.dtype)
        key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
               value.stride(), dtype)
        if key not in copies:
            copies[key] = value.detach().to("cpu", dtype=dtype, copy=True)
        out[name] = copies[key]
    return out


def resume_seed(seed: int | None, tokens_so_far: int) -> int | None:
    """Seed for continuing a partial rollout: a fresh random stream, since re-using ``seed`` as-is would
    repeat the first call's draws at new positions (correlating early and late tokens)."""
    return None if seed is None else (seed * 1_000_003 + tokens_so_far) % 2**62


def draw(log_mu: Tensor, params: SamplingParams, generator: torch.Generator) -> Tensor:
    """One token per row (B,) from log μ (B, V): the argmax when greedy, else a draw from μ with ``generator``.

    A μ with NaN (logits that overflowed: the weights have diverged) raises a FloatingPointError saying so
    instead of torch.multinomial's bare "probability tensor contains either inf, nan or element < 0".
    """
    if params.greedy:
        return log_mu.argmax(dim=-1)
    try:
        return torch.multinomial(log_mu.exp(), 1, generator=generator).squeeze(-1)
    except RuntimeError as err:
        rows = torch.isnan(log_mu).any(-1).nonzero().flatten().tolist()
        if rows:
            raise FloatingPointError(
                f"sampler: the next-token distribution of {len(rows)} row(s) is NaN (rows {rows[:8]}): the model's "
                "logits are not finite, so its weights have diverged (a learning rate too large, e.g. optim.lr?)"
            ) from err
        raise


def kept_token_ids(log_mu: Tensor) -> Tensor:
    """The kept set of each row of a processed distribution log μ (B, V) (−inf outside it) → (B, K) int32 token
    ids, most likely first, −1 after a row's own count; K is the largest kept set of the batch."""
    kept = torch.isfinite(log_mu)
    width = max(int(kept.sum(-1).max()), 1) if log_mu.shape[0] else 1
    values, ids = log_mu.topk(width, dim=-1)
    return ids.to(torch.int32).masked_fill(~torch.isfinite(values), -1)


def process_logits(logits: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
    """Logits (B, V) → (log μ over the vocabulary (B, V), log kept mass (B,)).  docs/spec.md §8.

    log p   = log_softmax(logits / temperature)                  the tempered full distribution
    keep    = top-k ∩ top-p set of p (top-p: smallest prefix of the sorted p whose mass ≥ top_p;
              the most likely token is always kept)
    log μ_v = log p_v − log Σ_{u∈keep} p_u  for v ∈ keep, −inf otherwise
    Greedy (temperature 0) is μ = one-hot(argmax) with kept mass p(argmax) of the untempered distribution.
    Computed in float32 whatever the logits' dtype.
    """
    logits = logits.float()
    if params.greedy:
        log_p = torch.log_softmax(logits, dim=-1)
        top = log_p.argmax(dim=-1, keepdim=True)
        log_mu = torch.full_like(log_p, float("-inf")).scatter(-1, top, 0.0)
        return log_mu, log_p.gather(-1, top).squeeze(-1)
    log_p = torch.log_softmax(logits / params.temperature, dim=-1)
    if params.top_k == 0 and params.top_p >= 1.0:
        return log_p, torch.zeros(log_p.shape[0], dtype=log_p.dtype, device=log_p.device)
    keep = torch.ones_like(log_p, dtype=torch.bool)
    if params.top_k > 0 and params.top_k < log_p.shape[-1]:
        kth = log_p.topk(params.top_k, dim=-1).values[:, -1:]
        keep &= log_p >= kth
    if params.top_p < 1.0:
        sorted_lp, order = log_p.masked_fill(~keep, float("-inf")).sort(dim=-1, descending=True)
        mass_before = sorted_lp.exp().cumsum(dim=-1) - sorted_lp.exp()  # mass of strictly better tokens
        keep_sorted = mass_before < params.top_p
        keep_sorted[:, 0] = True
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    masked = log_p.masked_fill(~keep, float("-inf"))
    log_kept = torch.logsumexp(masked, dim=-1)
    return masked - log_kept.unsqueeze(-1), log_kept
