"""The ``llamacpp`` sampler: a GGUF export of the model run by llama.cpp (through llama-cpp-python).

How μ is obtained (docs/spec.md §8). llama.cpp computes the logits only; temperature, top-k, top-p and the draw
happen here, with ``process_logits`` and a seeded ``torch.Generator`` — the same code as the hf sampler.
So ``rollout_log_prob`` is exactly log μ of the distribution the token was drawn from and ``log_kept_mass``
is recorded, which llama.cpp's own sampler chain would not report. The mismatch this engine measures is then
purely the forward pass: GGUF quantisation (f32 / f16 / q8_0 / q4_0) and ggml's CPU kernels.

Decoding is batched: the rows of a call share one llama.cpp context, one sequence id (and KV stream)
each; the prompts are prefilled in one pass, then each step decodes one token for every active row.
The model is loaded through the C API (``llama_model_load_from_file``) so the model parameters can be set:
on CPUs with AMX, quantised models crash unless ``use_extra_bufts`` is off, so it is turned off there
(``extra_bufts=None`` auto-detects from ``/proc/cpuinfo``).

Weights: ``load_weights(state_dict, version)`` writes a new GGUF (atomically, ``engines.gguf``) and reloads.
Token ids are the HF tokenizer's (the GGUF vocabulary is the same list, so llama.cpp agrees, but prompts
are tokenized and responses decoded with the HF tokenizer so sampler and learner share one tokenization).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rollcorr.engines.base import SamplingParams, draw, kept_token_ids, process_logits
from rollcorr.engines.decoding import DecodingSampler, stack_kept
from rollcorr.engines.gguf import QUANT_TYPES, SUPPORTED_ARCHITECTURES, mapped_safetensors, write_gguf
from rollcorr.engines.preflight import install_hint
from rollcorr.engines.spec import Backend, EngineSpec, register_backend
from rollcorr.models.builtin import BUILTIN, builtin_path

INSTALL_HINT = f"llama-cpp-python is not installed; {install_hint('llamacpp')}"


_LOG_CALLBACK = None  # keeps the ctypes callback alive while llama.cpp holds it


def import_llama_cpp():
    """``import llama_cpp`` with llama.cpp's log limited to errors, or RuntimeError with the install hint."""
    global _LOG_CALLBACK
    try:
        import llama_cpp
    except ImportError as err:
        raise RuntimeError(INSTALL_HINT) from err
    if _LOG_CALLBACK is None:

        def log(level: int, text: bytes, user_data: Any) -> None:
            # errors only; llama.cpp reports its 256-cell minimum per sequence (above a small model's
            # training context) as an error, while rollcorr itself enforces n_ctx per row
            if level == 3 and not text.startswith(b"llama_context: n_ctx"):  # GGML_LOG_LEVEL_ERROR
                print(text.decode("utf-8", errors="replace"), end="", file=sys.stderr)

        _LOG_CALLBACK = llama_cpp.llama_log_callback(log)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    return llama_cpp


@cache
def cpu_has_amx() -> bool:
    """True if /proc/cpuinfo lists an AMX flag (amx_tile / amx_int8 / amx_bf16)."""
    try:
        return " amx_" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _resolve_model_dir(model_path: str | os.PathLike) -> Path:
    path = Path(builtin_path(model_path))
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} is not a Hugging Face model directory")
    for required in ("config.json", "tokenizer.json"):
        if not (path / required).exists():
            raise FileNotFoundError(f"{str(path)!r} has no {required}")
    if not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{str(path)!r} has no *.safetensors weights")
    return path


class LlamaCppSampler(DecodingSampler):
    """Sampler on llama.cpp. ``version`` is the weight version it holds (starts at ``version``).

    model_path   local HF directory (config.json, *.safetensors, tokenizer.json) or "builtin"
    quant        GGUF weight type: "f32" | "f16" | "q8_0" | "q4_0", or "file" to serve ``gguf_file`` as it is
    gguf_file    a GGUF file to load as shipped (any type llama.cpp reads, e.g. Q4_1) with quant="file";
                 ``model_path`` then only supplies config.json and the tokenizer, and the sampler cannot take
                 new weights (``load_weights`` raises)
    max_batch    rows decoded together (llama.cpp sequences); larger calls run in chunks of this size
    n_ctx        tokens per row (prompt + response); default the model's max_position_embeddings. The KV cache
                 for max_batch × n_ctx tokens is allocated up front (SmolLM2-135M: 32 × 8192 tokens × 23 KB
                 in f16 = 6 GB), so pass what the prompts and max_new_tokens need (``rollcorr audit`` does)
    n_threads    CPU threads for llama.cpp (default min(4, cpu count))
    extra_bufts  llama.cpp extra buffer types (weight repacking); None = off on AMX CPUs, on otherwise
    kv_cache     KV cache type "f16" (llama.cpp's default) or "f32"; None = f32 for quant "f32", else f16
    flash_attn   True / False / None (llama.cpp decides); "auto" = off for quant "f32", else None.
                 llama.cpp's CPU flash attention works in f16, so "f32" is the exact-fp32 reference only
                 with it off and an f32 KV cache; the other types run llama.cpp's defaults
    work_dir     where GGUF files are written (default a fresh temp dir, removed by ``close``)
    """

    def __init__(
        self,
        model_path: str | os.PathLike = BUILTIN,
        quant: str = "q8_0",
        *,
        max_batch: int = 32,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        extra_bufts: bool | None = None,
        kv_cache: str | None = None,
        flash_attn: bool | None | str = "auto",
        work_dir: str | os.PathLike | None = None,
        version: int = 0,
        gguf_file: str | os.PathLike | None = None,
    ) -> None:
        if quant not in (*QUANT_TYPES, "file"):
            raise ValueError(f"unknown quant type {quant!r}; use one of {(*QUANT_TYPES, 'file')}")
        if (quant == "file") != (gguf_file is not None):
            raise ValueError("quant='file' and gguf_file= go together: the file is served as it is")
        if gguf_file is not None and not Path(gguf_file).is_file():
            raise FileNotFoundError(f"gguf_file {str(gguf_file)!r} does not exist")
        if max_batch < 1:
            raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
        self._llama = import_llama_cpp()
        from safetensors import safe_open
        from transformers import AutoConfig, AutoTokenizer

        self.model_dir = _resolve_model_dir(model_path)
        self.quant = quant
        self.config = AutoConfig.from_pretrained(self.model_dir, local_files_only=True, trust_remote_code=False)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True, trust_remote_code=False)
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            raise ValueError("tokenizer has no eos_token: generation could never stop")
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.eos_id)
        self.vocab_size = int(self.config.vocab_size)
        self.max_batch = int(max_batch)
        self.n_ctx = int(n_ctx or self.config.max_position_embeddings)
        self.n_threads = int(n_threads or min(4, os.cpu_count() or 1))
        self.extra_bufts = (not cpu_has_amx()) if extra_bufts is None else bool(extra_bufts)
        if kv_cache not in (None, "f16", "f32"):
            raise ValueError(f"kv_cache must be 'f16', 'f32' or None, got {kv_cache!r}")
        self.kv_cache = kv_cache or ("f32" if quant == "f32" else "f16")
        self.flash_attn = (False if quant == "f32" else None) if flash_attn == "auto" else flash_attn
        self._own_dir = work_dir is None
        self.work_dir = Path(tempfile.mkdtemp(prefix="rollcorr-gguf-") if work_dir is None else work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._model = self._ctx = self._batch = self._vocab = None
        self.gguf_path: Path | None = None

        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        self._shapes = {}  # read from the safetensors headers: a served file needs no float copy in memory
        for file in sorted(self.model_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                self._shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        if tied:
            self._shapes.pop("lm_head.weight", None)
        self.version = int(version)
        self.fixed_file = None if gguf_file is None else Path(gguf_file)
        try:
            if self.fixed_file is not None:
                self._model, self._ctx, self._batch, self._vocab = self._load(self.fixed_file)
            else:
                # memory-mapped: the export reads each tensor from the file's pages, no float copy is made
                self._export_and_load(mapped_safetensors(sorted(self.model_dir.glob("*.safetensors"))))
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"LlamaCppSampler({str(self.model_dir)!r}, {self.quant}, version={self.version})"

    # ---- model lifetime -----------------------------------------------------------------------------

    def _export_and_load(self, state_dict: dict[str, Tensor]) -> None:
        """Write ``state_dict`` as this version's GGUF, load it, and only then drop the previous model."""
        path = self.work_dir / f"model-v{self.version}-{self.quant}.gguf"
        # the vocabulary comes from tokenizer.json itself: AutoTokenizer may rebuild the pipeline around it
        write_gguf(path, state_dict, self.config, self.model_dir / "tokenizer.json", self.quant)
        try:
            handles = self._load(path)
        except BaseException:
            if path != self.gguf_path:
                path.unlink(missing_ok=True)
            raise
        old = self.gguf_path
        self._free()
        self._model, self._ctx, self._batch, self._vocab = handles
        self.gguf_path = path
        if old is not None and old != path:
            old.unlink(missing_ok=True)

    def _load(self, path: Path) -> tuple[Any, Any, Any, Any]:
        """llama.cpp model, context (max_batch sequences of n_ctx tokens), batch and vocab for ``path``."""
        ll = self._llama
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        if hasattr(mparams, "use_extra_bufts"):
            mparams.use_extra_bufts = self.extra_bufts
        model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        vocab = ll.llama_model_get_vocab(model)
        n_vocab = ll.llama_vocab_n_tokens(vocab)
        if n_vocab != self.vocab_size:
            ll.llama_model_free(model)
            raise RuntimeError(f"GGUF vocabulary has {n_vocab} tokens, the config says {self.vocab_size}")
        cparams = ll.llama_context_default_params()
        cparams.n_seq_max = self.max_batch
        cparams.n_ctx = self.max_batch * -(-self.n_ctx // 256) * 256  # llama.cpp pads sequences to 256
        cparams.n_batch = cparams.n_ubatch = self._n_batch = min(max(512, self.max_batch), cparams.n_ctx)
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        cparams.type_k = cparams.type_v = ll.GGML_TYPE_F32 if self.kv_cache == "f32" else ll.GGML_TYPE_F16
        cparams.flash_attn_type = {
            None: ll.LLAMA_FLASH_ATTN_TYPE_AUTO,
            False: ll.LLAMA_FLASH_ATTN_TYPE_DISABLED,
            True: ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
        }[self.flash_attn]
        cparams.kv_unified = False  # one KV stream of n_ctx cells per sequence
        cparams.no_perf = True
        ctx = ll.llama_init_from_model(model, cparams)
        if not ctx:
            ll.llama_model_free(model)
            raise RuntimeError("llama.cpp could not create a context")
        return model, ctx, ll.llama_batch_init(self._n_batch, 0, 1), vocab

    def _free(self) -> None:
        ll = self._llama
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
        if self._ctx is not None:
            ll.llama_free(self._ctx)
        if self._model is not None:
            ll.llama_model_free(self._model)
        self._model = self._ctx = self._batch = None

    def load_weights(self, state_dict: dict[str, Tensor], version: int) -> int:
        """Write the new weights as a GGUF (atomic rename), reload llama.cpp from it; returns ``version``.

        The old model keeps serving if anything fails (bad names / shapes, NaN weights, load error).
        """
        if self.fixed_file is not None:
            raise ValueError(
                f"this sampler serves {self.fixed_file.name} as shipped and cannot take new weights; "
                "use quant='f32'|'f16'|'q8_0'|'q4_0' to have rollcorr write (and re-write) the GGUF"
            )
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        names = {k for k in state_dict if not (tied and k == "lm_head.weight")}
        missing, unexpected = sorted(set(self._shapes) - names), sorted(names - set(self._shapes))
        if missing or unexpected:
            raise ValueError(
                f"state_dict does not fit the sampler's model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name in names:
            if tuple(state_dict[name].shape) != self._shapes[name]:
                raise ValueError(
                    f"{name}: shape {tuple(state_dict[name].shape)} does not match {self._shapes[name]}"
                )
        previous = self.version
        self.version = int(version)
        try:
            self._export_and_load(dict(state_dict))
        except BaseException:
            self.version = previous
            raise
        return self.version

    def close(self) -> None:
        self._free()
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        elif self.gguf_path is not None:
            self.gguf_path.unlink(missing_ok=True)
        self.gguf_path = None

    def __del__(self) -> None:  # a sampler dropped without close() still frees llama.cpp and its files
        try:
            self.close()
        except Exception:
            pass

    # ---- llama.cpp calls ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._ctx is None:
            raise RuntimeError("LlamaCppSampler is closed")

    def _decode_batch(self, entries: Sequence[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Run one llama_decode over (token, position, sequence, want_logits) entries ≤ n_batch.

        Returns the (V,) float32 logits of the entries that asked for them, in order.
        """
        ll, batch = self._llama, self._batch
        for i, (token, pos, seq, want) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = want
        batch.n_tokens = len(entries)
        status = ll.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} (KV cache full or bad batch)")
        out = []
        for i, (*_, want) in enumerate(entries):
            if want:
                ptr = ll.llama_get_logits_ith(self._ctx, i)
                out.append(np.ctypeslib.as_array(ptr, shape=(self.vocab_size,)).copy())
        return out

    def _prefill(self, contexts: Sequence[Sequence[int]], all_logits: bool = False) -> list[np.ndarray]:
        """Clear the KV cache and feed ``contexts[i]`` as sequence i.

        Returns per row the logits of its last token (V,), or of every token (L_i, V) if ``all_logits``.
        """
        ll = self._llama
        ll.llama_memory_clear(ll.llama_get_memory(self._ctx), True)
        entries = [
            (tok, pos, seq, all_logits or pos == len(ctx) - 1)
            for seq, ctx in enumerate(contexts)
            for pos, tok in enumerate(ctx)
        ]
        logits: list[np.ndarray] = []
        for start in range(0, len(entries), self._n_batch):
            logits += self._decode_batch(entries[start : start + self._n_batch])
        if not all_logits:
            return logits
        out, at = [], 0
        for ctx in contexts:
            out.append(np.stack(logits[at : at + len(ctx)]))
            at += len(ctx)
        return out

    def _check_rows(self, rows: Sequence[Sequence[int]], budgets: Sequence[int] | None = None) -> None:
        for i, r in enumerate(rows):
            if not r:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in r if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})"
                )
            need = len(r) + (budgets[i] if budgets is not None else 0)
            if need > self.n_ctx:
                raise ValueError(f"row {i} needs {need} positions but n_ctx is {self.n_ctx}; raise n_ctx")

    @torch.no_grad()
    def logits(self, sequences: Sequence[Sequence[int]]) -> list[Tensor]:
        """Teacher-forced logits: for each token list, (L, V) float32 where row j predicts token j + 1."""
        self._check_open()
        self._check_rows(sequences)
        out = []
        for start in range(0, len(sequences), self.max_batch):
            chunk = [list(map(int, s)) for s in sequences[start : start + self.max_batch]]
            out += [torch.from_numpy(x) for x in self._prefill(chunk, all_logits=True)]
        return out

    def tokenize_native(self, text: str) -> list[int]:
        """llama.cpp's own tokenization of ``text`` from the GGUF vocabulary (no BOS added)."""
        self._check_open()
        ll, raw = self._llama, text.encode("utf-8")
        buf = (ll.llama_token * (len(raw) + 8))()
        n = ll.llama_tokenize(self._vocab, raw, len(raw), buf, len(buf), False, True)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens")
        return list(buf[:n])

    def detokenize_native(self, ids: Sequence[int]) -> str:
        """llama.cpp's own detokenization (special tokens rendered as text)."""
        self._check_open()
        ll, out = self._llama, b""
        buf = ctypes.create_string_buffer(256)
        for t in ids:
            n = ll.llama_token_to_piece(self._vocab, int(t), buf, len(buf), 0, True)
            if n < 0:
                raise RuntimeError(f"token {t} has a piece longer than {len(buf)} bytes")
            out += buf.raw[:n]
        return out.decode("utf-8", errors="replace")

    # ---- sampling -----------------------------------------------------------------------------------

    def encode(self, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        rows = [
            self.tokenizer(p, add_special_tokens=False)["input_ids"]
            if isinstance(p, str)
            else [int(t) for t in p]
            for p in prompts
        ]
        self._check_rows(rows)
        return rows

    @torch.no_grad()
    def _decode(
        self, contexts: list[list[int]], budgets: list[int], params: SamplingParams, max_steps: int | None
    ) -> tuple[list[list[int]], list[list[float]], list[list[float]], list[bool]]:
        """Per row: sampled tokens, their log μ, log kept mass, and whether it finished (EOS or budget)."""
        self._check_rows(contexts, budgets)
        gen = torch.Generator()
        if params.seed is not None:
            gen.manual_seed(params.seed)
        else:
            gen.seed()
        out: tuple[list, list, list, list] = ([], [], [], [])
        self._kept = [] if params.records_kept_ids else None
        for start in range(0, len(contexts), self.max_batch):
            part = self._decode_chunk(
                contexts[start : start + self.max_batch],
                budgets[start : start + self.max_batch],
                params,
                max_steps,
                gen,
            )
            for acc, new in zip(out, part):
                acc += new
        return out

    def _take_kept_ids(self) -> list[Tensor] | None:
        kept, self._kept = getattr(self, "_kept", None), None
        return kept

    def _decode_chunk(
        self,
        contexts: list[list[int]],
        budgets: list[int],
        params: SamplingParams,
        max_steps: int | None,
        gen: torch.Generator,
    ) -> tuple[list[list[int]], list[list[float]], list[list[float]], list[bool]]:
        b = len(contexts)
        logits = torch.from_numpy(np.stack(self._prefill(contexts)))  # (b, V): next-token logits per row
        rows = list(range(b))  # rows still generating, in the order of ``logits``
        tokens: list[list[int]] = [[] for _ in range(b)]
        log_mu_out: list[list[float]] = [[] for _ in range(b)]
        log_kept_out: list[list[float]] = [[] for _ in range(b)]
        finished = [False] * b
        kept_out: list[list[Tensor]] = [[] for _ in range(b)]  # per row, each token's kept set (K,)
        limit = max(budgets) if max_steps is None else min(max(budgets), max_steps)
        for step in range(limit):
            log_mu, log_kept = process_logits(logits, params)
            kept = kept_token_ids(log_mu) if params.records_kept_ids else None
            tok = draw(log_mu, params, gen)
            lp = log_mu.gather(-1, tok[:, None]).squeeze(-1)
            still = []
            for j, row in enumerate(rows):
                t = int(tok[j])
                tokens[row].append(t)
                log_mu_out[row].append(float(lp[j]))
                log_kept_out[row].append(float(log_kept[j]))
                if kept is not None:
                    kept_out[row].append(kept[j])
                if t == self.eos_id or len(tokens[row]) >= budgets[row]:
                    finished[row] = True
                else:
                    still.append(row)
            rows = still
            if not rows or step + 1 == limit:
                break
            entries = [(tokens[r][-1], len(contexts[r]) + len(tokens[r]) - 1, r, True) for r in rows]
            logits = torch.from_numpy(np.stack(self._decode_batch(entries)))
        if self._kept is not None:
            self._kept += [stack_kept(row) for row in kept_out]
        return tokens, log_mu_out, log_kept_out, finished


# ---- the backend: the llamacpp spec grammar, its refusals and its sampler ------------------------------------

FILE = "file"  # llamacpp:file: a GGUF file served as shipped (its type is whatever the file holds)
GGUF_TYPE = {"fp32": "f32", "fp16": "f16"}  # the GGUF weight type of a dtype (``--whatif fp32``)


class LlamaCppBackend(Backend):
    """``llamacpp[:f32|f16|q8_0|q4_0|file]``: rollcorr writes the model as a GGUF of that type (default q8_0), or
    ``file`` serves a GGUF file as shipped. Samplers only, with llama.cpp's own kernels and thread pool."""

    name = "llamacpp"
    extra = "llamacpp"
    precisions = tuple(GGUF_TYPE)

    def parse(self, spec: str, options: list[str]) -> EngineSpec:
        if len(options) > 1:
            raise ValueError(f"llamacpp takes one option (the GGUF quantisation), got {spec!r}")
        return EngineSpec("llamacpp", quant=options[0] if options and options[0] else None)

    def check_spec(self, parsed: EngineSpec, spec: str, role: str) -> None:
        super().check_spec(parsed, spec, role)
        if parsed.quant is not None and parsed.quant not in (*QUANT_TYPES, FILE):
            raise ValueError(f"{spec!r}: rollcorr writes GGUF weights as {', '.join(QUANT_TYPES)} "
                             "(or llamacpp:file serves a GGUF file as shipped)")

    def check_model(self, parsed: EngineSpec, spec: str, model_path, gguf_file: str | None) -> None:
        """llamacpp:file needs a GGUF file; otherwise rollcorr writes the GGUF, for the architectures it knows."""
        if parsed.quant == FILE and gguf_file is None:
            raise ValueError(f"{spec!r} serves a GGUF file as shipped: give one (audit --gguf-file); to have "
                             "rollcorr write the GGUF use llamacpp:q8_0 (or f32, f16, q4_0)")
        if gguf_file is not None or model_path is None or str(model_path).startswith(BUILTIN):
            return
        arch = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8")).get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{spec!r}: the GGUF writer handles {', '.join(SUPPORTED_ARCHITECTURES)} models; "
                             f"{str(model_path)!r} is {arch!r} (use an hf or vllm sampler)")

    def sampler_class(self, parsed: EngineSpec) -> type:
        return LlamaCppSampler

    def make_sampler(self, parsed: EngineSpec, model_path, *, threads: int = 0, **kwargs) -> LlamaCppSampler:
        """``threads`` > 0 is llama.cpp's ``n_threads`` (unless given)."""
        if parsed.quant is not None:
            kwargs["quant"] = parsed.quant
        if threads > 0:
            kwargs.setdefault("n_threads", threads)
        return LlamaCppSampler(builtin_path(model_path), **kwargs)

    def with_dtype(self, parsed: EngineSpec, dtype: str) -> str:
        """A dtype is a GGUF weight type here: fp32 → llamacpp:f32, fp16 → llamacpp:f16 (rollcorr writes no bf16)."""
        if dtype not in self.precisions:
            raise ValueError(f"llamacpp samplers are chosen by GGUF weight type, and rollcorr writes none in {dtype} "
                             "(compare llamacpp:f32 or llamacpp:f16 as the sampler instead)")
        return f"llamacpp:{GGUF_TYPE[dtype]}"

    def audit_kwargs(self, parsed: EngineSpec, *, rows: int, tokens: int, gguf_file: str | None) -> dict[str, Any]:
        """llama.cpp allocates its KV cache for max_batch rows × n_ctx tokens up front; the model's own context
        (8192 for SmolLM2) would cost GBs, so it is sized to what the audit needs. llamacpp:file serves the
        audit's GGUF file as shipped (e.g. Q4_1)."""
        kwargs: dict[str, Any] = {"max_batch": rows, "n_ctx": tokens}
        if parsed.quant == FILE:
            kwargs["gguf_file"] = gguf_file
        return kwargs


register_backend(LlamaCppBackend())

__all__ = ["LlamaCppBackend", "LlamaCppSampler"]
