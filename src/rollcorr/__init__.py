"""rollcorr: measure and correct sampler/learner mismatch in LLM reinforcement learning.

The three policies (docs/spec.md §1): ``rollout_log_prob`` (μ, what the sampler drew from), ``old_log_prob``
(π_old, the learner at the generating version) and ``log_prob`` (π_θ, the learner now).
"""

__version__ = "0.1.0"
