"""A bounded store of past weight versions and exact per-version scoring (the snapshot mechanism).

Used by the ``snapshot`` strategy and, when ``measure_error=True``, by every strategy as the reference
that gives exact old logits π_train(v_gen).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rollcorr.proximal.scoring import copy_state, masked_versions, score, scores_together, tensor_bytes
from rollcorr.rollout import Rollout


class SnapshotStore:
    """CPU copies of the learner's published weights, keyed by version.

    ``put(v, model)`` keeps versions ≥ v − max_staleness and evicts older ones, so a token generated at
    most ``max_staleness`` versions ago can always be scored exactly. Tied weights are stored once.
    """

    def __init__(self, max_staleness: int, device: str | torch.device = "cpu"):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = int(max_staleness)
        self.device = torch.device(device)
        self._states: dict[int, dict[str, Tensor]] = {}

    def put(self, version: int, model: nn.Module) -> None:
        """Store a copy of ``model``'s weights as ``version`` and evict versions older than the window (a
        sharded model: this rank's shards)."""
        self._states[int(version)] = copy_state(model, self.device)
        self.evict(int(version) - self.max_staleness)

    def evict(self, oldest_kept: int) -> None:
        for v in [v for v in self._states if v < oldest_kept]:
            del self._states[v]

    def get(self, version: int) -> dict[str, Tensor]:
        if version not in self._states:
            raise KeyError(
                f"weights of version {version} are not stored (stored: {self.versions}, "
                f"max_staleness={self.max_staleness}); was on_publish({version}, model) called, "
                "or is the token older than the staleness window?"
            )
        return self._states[version]

    @property
    def versions(self) -> list[int]:
        return sorted(self._states)

    @property
    def nbytes(self) -> int:
        """Bytes held by all stored versions (each tied tensor counted once)."""
        return sum(tensor_bytes(s.values()) for s in self._states.values())

    def __contains__(self, version: int) -> bool:
        return version in self._states

    def __len__(self) -> int:
        return len(self._states)

    def state_dict(self) -> dict:
        return {"max_staleness": self.max_staleness, "states": dict(self._states)}

    def load_state_dict(self, d: dict) -> None:
        self.max_staleness = int(d["max_staleness"])
        self._states = {int(v): {k: t.to(self.device) for k, t in s.items()} for v, s in d["states"].items()}


@torch.no_grad()
def score_by_version(store: SnapshotStore, learner, rollout: Rollout, temperature: float = 1.0) -> Tensor:
    """(B, T) log π_train(v_gen)(y_t): each token scored with the stored weights of its own version.

    A row that spans versions (partial rollout) is scored once per distinct version present and each token
    picks the score of its version. The stored weights are put into the learner's model for each forward
    (``scoring.swapped_in``). A learner that scores together with other ranks (``scores_together``) runs one
    forward per *stored* version, rows or not: the store is the same on every rank, the versions in each
    rank's rows are not.
    """
    versions = masked_versions(rollout)
    for v in versions:  # fail before any forward if a version is missing
        store.get(v)
    mask = rollout.response_mask.bool()
    out = torch.zeros(rollout.response_ids.shape, dtype=torch.float32, device=rollout.response_ids.device)
    for v in store.versions if scores_together(learner) else versions:
        rows = (mask & (rollout.version == v)).any(dim=1).nonzero().squeeze(1)
        log_prob = score(learner, rollout.select(rows), temperature, weights=store.get(v)).to(out.device)
        pick = mask[rows] & (rollout.version[rows] == v)
        out[rows] = torch.where(pick, log_prob, out[rows])
    return out


def prefix_keys(rollout: Rollout) -> list[list[int]]:
    """Per row, one hash per valid response token t of (prompt tokens, response[: t + 1]).

    The old log-prob of a token is a function of exactly (prompt, response prefix, weights), so these keys
    identify a token across re-batching, padding changes and partial → finished rollouts. Hashes of int
    tuples are deterministic across processes (no hash randomisation), so keys survive checkpoints.
    """
    prompts, pmask = rollout.prompt_ids.tolist(), rollout.prompt_mask.bool().tolist()
    responses, lengths = rollout.response_ids.tolist(), rollout.response_mask.bool().sum(dim=1).tolist()
    out = []
    for prompt, pm, response, n in zip(prompts, pmask, responses, lengths):
        h = hash(tuple(tok for tok, keep in zip(prompt, pm) if keep))
        keys = []
        for tok in response[:n]:
            h = hash((h, tok))
            keys.append(h)
        out.append(keys)
    return out


class TokenStore:
    """Exact old log-probs of individual tokens, keyed by (prefix hash, position, version).

    Filled while the weights of a version are still available (``interrupt``: the learner before it moves
    on; ``old_logit_model``: the dedicated model before it loads the next version), read when the finished
    rollout is trained on. Identical prefixes generated at the same version share one entry.
    """

    BYTES_PER_ENTRY = 4  # the float32 payload of one stored log-prob (dict bookkeeping not counted)

    def __init__(self):
        self.values: dict[tuple[int, int, int], float] = {}

    def missing_rows(self, rollout: Rollout, version: int) -> list[int]:
        """Rows with a valid token generated at ``version`` whose log-prob is not stored yet."""
        keys, versions = prefix_keys(rollout), rollout.version.tolist()
        return [
            i
            for i, row in enumerate(keys)
            if any(
                versions[i][t] == version and (h, t, version) not in self.values for t, h in enumerate(row)
            )
        ]

    def save(self, rollout: Rollout, log_prob: Tensor, version: int) -> int:
        """Store ``log_prob`` (B, T) for the valid tokens generated at ``version``; returns how many."""
        keys, versions, values = prefix_keys(rollout), rollout.version.tolist(), log_prob.tolist()
        n = 0
        for i, row in enumerate(keys):
            for t, h in enumerate(row):
                if versions[i][t] == version:
                    self.values[(h, t, version)] = values[i][t]
                    n += 1
        return n

    def lookup(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """(values (B, T) float32, found (B, T) bool) for every valid token whose log-prob is stored."""
        keys, versions = prefix_keys(rollout), rollout.version.tolist()
        values = torch.zeros(rollout.response_ids.shape, dtype=torch.float32)
        found = torch.zeros(rollout.response_ids.shape, dtype=torch.bool)
        for i, row in enumerate(keys):
            for t, h in enumerate(row):
                value = self.values.get((h, t, versions[i][t]))
                if value is not None:
                    values[i, t], found[i, t] = value, True
        return values, found

    def evict(self, oldest_kept: int) -> None:
        self.values = {k: v for k, v in self.values.items() if k[2] >= oldest_kept}

    @property
    def nbytes(self) -> int:
        return self.BYTES_PER_ENTRY * len(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def state_dict(self) -> dict:
        return {"values": dict(self.values)}

    def load_state_dict(self, d: dict) -> None:
        self.values = dict(d["values"])
