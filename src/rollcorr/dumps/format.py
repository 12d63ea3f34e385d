"""The dump format: what a row holds and under which names (``FIELD_ALIASES``), the ``Dump`` a reader returns, and
``write_dump``, which writes it (the TRL drop-in, a verl run). See the package's docstring."""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# role -> names tried in order when the default name is absent from the file (first is rollcorr's default).
FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    "rollout": (
        "rollout_log_probs",  # verl, slime, SkyRL
        "rollout_log_prob",  # rollcorr
        "generation_logprobs",  # NeMo-RL
        "sampling_per_token_logps",  # TRL
        "inference_logprobs",  # prime-rl
        "infer_logprobs",
        "rollout_logprobs",
        "logprobs",  # AReaL (the inference engine's log-probs, beside prox_logp)
        "response_logprobs",  # verl's AgentLoopOutput (rollout_log_probs once in the batch)
    ),
    "learner": (
        "old_log_probs",  # verl, slime, SkyRL, OpenRLHF
        "old_log_prob",  # rollcorr
        "prev_logprobs",  # NeMo-RL
        "old_per_token_logps",  # TRL
        "prox_logp",  # AReaL
        "trainer_logprobs",  # prime-rl
    ),
    "mask": ("response_mask", "token_mask", "loss_mask", "completion_mask", "mask"),
    "advantages": ("advantages", "advantage"),
    "tokens": ("responses", "response_ids", "completion_ids", "token_ids"),
    "token_text": ("token_text", "token_texts", "response_tokens_text"),
    "text": ("response_text", "response", "completion"),
    "version": ("version", "versions", "token_versions"),
    # multi-turn: the model turn each token belongs to (rollcorr's Rollout.turn); without it a turn is a run of
    # mask-1 tokens (rollcorr.turns)
    "turn": ("turn", "turns"),
    # mixture of experts: per token, per MoE layer, the top-k expert ids (rollcorr.moe)
    "routed_experts": (
        "routed_experts",  # rollcorr, verl (router_replay R3), NeMo-RL, vLLM's enable_return_routed_experts
        "rollout_expert_indices",  # SkyRL
    ),
    "learner_routed_experts": ("learner_routed_experts",),  # rollcorr: the learner's own choice
}

DEFAULT_FIELDS = {role: names[0] for role, names in FIELD_ALIASES.items()}
CORRECTION_FIELD = "correction"  # the CorrectionConfig that produced the row (keys differing from the default)
PER_TOKEN = ("advantages", "tokens", "version", "turn")  # optional per-token numeric fields (``Dump.partial``)
ROUTED = ("routed_experts", "learner_routed_experts")
STDIN = "-"



@dataclass(frozen=True)
class MalformedRow:
    """A skipped row: its 1-based line (JSONL) or row (Parquet) number and why it was skipped."""

    line: int
    reason: str


@dataclass
class Dump:
    """Valid rows of a dump (or of one chunk of it), right-padded to (B, T).

    rollout_log_prob  (B, T) float64, log μ of each response token, 0 on padding
    learner_log_prob  (B, T) float64, the learner's log-prob of each response token, 0 on padding: π_old in
                      decoupled mode; in bypass mode it stands in for π_θ (files name it old_log_probs, ...)
    response_mask     (B, T) bool, True on valid tokens (from the mask field, else from list lengths)
    advantages        (B, T) float64 or None (a scalar per row is broadcast over its tokens)
    tokens            (B, T) int64 response token ids or None
    token_text        per-row lists of per-token strings, or None
    text              per-row response strings, or None
    version           (B, T) int64 weight version per token, or None
    turn              (B, T) int64 the model turn of each token (multi-turn trajectories), or None
    routed_experts    (B, T, L, k) int64 the sampler's experts per response token and MoE layer, or None
    learner_routed_experts  (B, T, L, k) int64 the learner's own experts for the same tokens, or None
    line_numbers      source line (JSONL) / row (Parquet) of each of the B rows, 1-based
    extras            extra field name -> per-row values (None where a row lacks it)
    malformed         skipped rows with line numbers and reasons
    fields            role -> field name actually read ("rollout", "learner", "mask", ...)
    partial           role -> lines lacking a per-token field other rows have (that field is then None)
    correction        the CorrectionConfig keys the writer recorded (``CORRECTION_FIELD``; the keys that differ
                      from ``CorrectionConfig()``), when every row that records one records the same; else None
    corrections_seen  how many different correction configs the rows record (0: none recorded)
    row_index         (B,) int64: each row's place among the dump's valid rows in file order (a chunk's rows
                      are grouped by length, not in file order); None means 0 … B − 1
    """

    path: Path
    rollout_log_prob: Tensor
    learner_log_prob: Tensor
    response_mask: Tensor
    line_numbers: list[int]
    fields: dict[str, str]
    malformed: list[MalformedRow] = field(default_factory=list)
    advantages: Tensor | None = None
    tokens: Tensor | None = None
    token_text: list[list[str]] | None = None
    text: list[str] | None = None
    version: Tensor | None = None
    routed_experts: Tensor | None = None
    learner_routed_experts: Tensor | None = None
    extras: dict[str, list[Any]] = field(default_factory=dict)
    turn: Tensor | None = None
    total_rows: int = 0
    partial: dict[str, list[int]] = field(default_factory=dict)
    correction: dict[str, Any] | None = None
    corrections_seen: int = 0
    row_index: Tensor | None = None

    def __len__(self) -> int:
        return self.rollout_log_prob.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())

    def to_rollout(self):
        """The dump as a :class:`rollcorr.rollout.Rollout` (float32 log-probs; no prompts, one group per row)."""
        from rollcorr.rollout import Rollout

        b, t = self.rollout_log_prob.shape
        tokens = self.tokens if self.tokens is not None else torch.zeros(b, t, dtype=torch.long)
        version = self.version if self.version is not None else torch.zeros(b, t, dtype=torch.long)
        meta = [{"line": line} for line in self.line_numbers]
        if self.text is not None:
            for m, text in zip(meta, self.text):
                m["response_text"] = text
        return Rollout(
            prompt_ids=torch.zeros(b, 0, dtype=torch.long),
            prompt_mask=torch.zeros(b, 0, dtype=torch.bool),
            response_ids=tokens,
            response_mask=self.response_mask,
            rollout_log_prob=self.rollout_log_prob.float(),
            version=version,
            group_ids=torch.arange(b),
            meta=meta,
            old_log_prob=self.learner_log_prob.float(),
            advantages=None if self.advantages is None else self.advantages.float(),
            routed_experts=self.routed_experts,
        )


@dataclass
class DumpInfo:
    """What a ``DumpReader`` learned about the whole dump once every block was read (``Dump``'s names for
    the same facts): rows read, usable rows and tokens, malformed rows, fields, partial per-token fields, the
    recorded correction, and which optional fields every usable row has."""

    path: Path
    fields: dict[str, str]
    malformed: list[MalformedRow]
    total_rows: int
    rows: int
    num_tokens: int
    partial: dict[str, list[int]]
    correction: dict[str, Any] | None
    corrections_seen: int
    complete: dict[str, bool]  # role -> every usable row has it (token_text, text, tokens, advantages, ...)
    extra_fields: tuple[str, ...] = ()
    routing_note: str | None = None  # why the routing of the dump cannot be compared (or None when it can)

    def __len__(self) -> int:
        return self.rows


class _BadRow(Exception):
    """Raised while parsing one row; the message is the reason reported to the user."""


def display_name(path: Path) -> str:
    """How a dump is named in reports: its file name, or "stdin" for ``-``."""
    return "stdin" if str(path) == STDIN else path.name


# ---- writing ----------------------------------------------------------------------------------------
def write_dump(
    path: str | Path,
    rollout_log_prob: Tensor,
    learner_log_prob: Tensor,
    response_mask: Tensor,
    *,
    advantages: Tensor | None = None,
    tokens: Tensor | None = None,
    version: Tensor | None = None,
    turn: Tensor | None = None,
    routed_experts: Tensor | None = None,
    learner_routed_experts: Tensor | None = None,
    extras: dict[str, Sequence[Any]] | None = None,
    tokenizer: Any = None,
    correction: Any = None,
    append: bool = True,
) -> int:
    """Write a (B, T) right-padded batch as JSONL rows that ``read_dump`` / ``rollcorr analyze`` read.

    One row per response, under rollcorr's default field names (``rollout_log_probs``, ``old_log_probs`` for
    ``learner_log_prob``,
    ``response_mask`` and, when given, ``advantages`` ((B,) or (B, T)), ``responses`` (token ids),
    ``version``, ``turn``, ``routed_experts`` and ``learner_routed_experts`` ((B, T, L, k), one (L, k) list per
    token)), each list cut after the row's last valid token; a multi-turn rollout is written as it is, the
    environment's tokens kept in ``responses`` at mask-0 positions between the model's turns (verl's agent-loop
    layout) and ``turn`` the model turn of each token (``Rollout.turn``); ``extras`` maps a field name to one value
    per row (e.g. ``{"step": [3] * B, "reward": rewards}``). With ``tokenizer`` (and ``tokens``) each row also
    gets ``token_text`` (every token decoded alone) and ``response_text`` (the row decoded), so a reader needs
    no tokenizer; with ``correction`` (a ``CorrectionConfig``) each row records under ``correction`` the keys
    that differ from ``CorrectionConfig()``, which ``rollcorr analyze`` applies by default. ``.gz`` paths are
    gzip-compressed. With
    ``append`` the rows are added to an existing file (one file per run), else the file is replaced. The
    rows are encoded first and written in one call, so a bad input leaves the file untouched. Returns the
    number of rows written."""
    path = Path(path)
    shape = tuple(rollout_log_prob.shape)
    named = {"learner_log_prob": learner_log_prob, "response_mask": response_mask, "tokens": tokens, "version": version,
             "turn": turn}
    routes = {"routed_experts": routed_experts, "learner_routed_experts": learner_routed_experts}
    _check_shapes(shape, named, routes, advantages, extras)
    if tokenizer is not None and tokens is None:
        raise ValueError("write_dump: tokenizer= decodes the token ids, so tokens= must be given too")
    recorded = None if correction is None else correction_record(correction)
    mask = response_mask.detach().bool().cpu()
    lengths = torch.where(mask.any(-1), shape[1] - mask.flip(-1).int().argmax(-1), 0).tolist()

    cpu = {k: None if v is None else v.detach().cpu() for k, v in named.items()}
    columns = {**cpu, "rollout": rollout_log_prob.detach().double().cpu(), "learner": cpu["learner_log_prob"].double(),
               "mask": mask, "advantages": None if advantages is None else advantages.detach().cpu()}
    lines = [json.dumps(_row(b, lengths[b], columns, routes, extras, tokenizer, recorded), allow_nan=False)
             for b in range(shape[0])]
    text = "".join(line + "\n" for line in lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    with opener(path, "at" if append else "wt", encoding="utf-8") as f:
        f.write(text)
    return len(lines)


def _row(b: int, length: int, columns: dict[str, Tensor | None], routes: dict[str, Tensor | None],
         extras: dict[str, Sequence[Any]] | None, tokenizer: Any, recorded: dict[str, Any] | None) -> dict[str, Any]:
    """Row ``b`` of a dump, every per-token list cut to ``length`` (after its last valid token)."""

    def cut(x: Tensor | None) -> list | None:
        return None if x is None else x[b, :length].tolist()

    adv = columns["advantages"]
    row: dict[str, Any] = {
        "rollout_log_probs": cut(columns["rollout"]),
        "old_log_probs": cut(columns["learner"]),
        "response_mask": [int(v) for v in columns["mask"][b, :length].tolist()],
    }
    if adv is not None:
        row["advantages"] = float(adv[b]) if adv.dim() == 1 else cut(adv.double())
    if columns["tokens"] is not None:
        row["responses"] = cut(columns["tokens"])
        if tokenizer is not None:
            ids = row["responses"]
            row["token_text"] = list(tokenizer.batch_decode([[i] for i in ids])) if ids else []
            row["response_text"] = tokenizer.decode(ids)
    if recorded is not None:
        row[CORRECTION_FIELD] = recorded
    for name in ("version", "turn"):
        if columns[name] is not None:
            row[name] = cut(columns[name])
    for name, value in routes.items():
        if value is not None:
            row[name] = value[b, :length].detach().long().cpu().tolist()
    for name, values in (extras or {}).items():
        value = values[b]
        row[name] = value.item() if isinstance(value, Tensor) else value
    return row


def _check_shapes(shape: tuple[int, ...], named: dict[str, Tensor | None], routes: dict[str, Tensor | None],
                  advantages: Tensor | None, extras: dict[str, Sequence[Any]] | None) -> None:
    """ValueError naming the first input of ``write_dump`` whose shape does not fit the (B, T) batch ``shape``."""
    if len(shape) != 2:
        raise ValueError(f"rollout_log_prob must be (B, T), got shape {shape}")
    for name, value in named.items():
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")
    for name, value in routes.items():
        if value is not None and (value.dim() != 4 or tuple(value.shape[:2]) != shape):
            raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape} × (layers, top_k)")
    if advantages is not None and tuple(advantages.shape) not in (shape, shape[:1]):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected {shape[:1]} or {shape}")
    for name, values in (extras or {}).items():
        if len(values) != shape[0]:
            raise ValueError(f"extras[{name!r}] has {len(values)} values, expected one per row ({shape[0]})")


def correction_record(config: Any) -> dict[str, Any]:
    """The keys of a ``CorrectionConfig`` that differ from ``CorrectionConfig()`` (plain JSON data);
    ``CorrectionConfig.from_dict`` of it rebuilds the config."""
    from rollcorr.config.correction import CorrectionConfig

    if not isinstance(config, CorrectionConfig):
        raise ValueError(f"correction must be a CorrectionConfig, got {type(config).__name__}")
    default = CorrectionConfig().to_dict()
    return {k: v for k, v in config.to_dict().items() if v != default[k]}
