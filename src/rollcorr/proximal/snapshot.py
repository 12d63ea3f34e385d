"""``snapshot``: exact old logits from stored copies of every live weight version (Guan et al., arXiv 2605.12070, exact route 1)."""

from __future__ import annotations

from torch import Tensor, nn

from rollcorr.proximal.base import ProximalStrategy
from rollcorr.proximal.store import SnapshotStore, score_by_version
from rollcorr.rollout import Rollout


class Snapshot(ProximalStrategy):
    """π_old = learner forward with the stored weights of each token's version v_gen (exact).

    ``on_publish(v, model)`` copies the weights to CPU and evicts versions older than v − max_staleness. A
    batch is scored once per distinct version present (a partial rollout that spans versions is scored once
    per version and each token takes the score of its own version). The stored weights are put into the
    learner's model for each forward and its own put back (``scoring.swapped_in``).

    Memory: ``store.nbytes`` (one weight copy per live version, ≤ max_staleness + 1); with a sharded learner
    this rank's shards of each, 1/N.
    """

    name = "snapshot"
    exact = True

    def __init__(self, max_staleness: int = 1, temperature: float = 1.0, measure_error: bool = False):
        super().__init__(temperature=temperature, max_staleness=max_staleness, measure_error=False)
        self.store = SnapshotStore(max_staleness)
        self._measure = measure_error
        self._distinct = 0

    def on_publish(self, version: int, model: nn.Module) -> None:
        self.store.put(version, model)

    def _old_log_prob(self, rollout: Rollout, learner, current_version: int) -> Tensor:
        self._distinct = len({int(v) for v in rollout.version[rollout.response_mask.bool()].tolist()})
        return score_by_version(self.store, learner, rollout, self.temperature)

    def old_log_prob(self, rollout: Rollout, learner, current_version: int):
        result = super().old_log_prob(rollout, learner, current_version)
        if self._measure:  # the snapshot *is* the reference: its error is zero by construction
            result.error = {"logp_abs_err_mean": 0.0, "logp_abs_err_max": 0.0, "p_abs_err_mean": 0.0}
        return result

    @property
    def extra_bytes(self) -> int:
        return self.store.nbytes

    def held_weights(self) -> dict[str, dict[str, Tensor]]:
        return {f"store/{v}": self.store.get(v) for v in self.store.versions}

    def metrics(self) -> dict[str, float]:
        return {
            "stored_versions": float(len(self.store)),
            "store_bytes": float(self.store.nbytes),
            "versions_scored": float(self._distinct),
        }

    def state_dict(self) -> dict:
        return {"name": self.name, "store": self.store.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        if d.get("name") != self.name:
            raise ValueError(f"state dict is for proximal strategy {d.get('name')!r}, not {self.name!r}")
        self.store.load_state_dict(d["store"])
