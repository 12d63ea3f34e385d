"""Drop-in replacements for verl's rollout-correction and policy-loss functions (same signatures, same
numbers on ``tests/data/verl_vectors.json``), backed by rollcorr's math."""

from rollcorr.compat.verl_correction import compute_rollout_correction_and_rejection_mask  # noqa: F401
from rollcorr.compat.verl_losses import compute_policy_loss  # noqa: F401
