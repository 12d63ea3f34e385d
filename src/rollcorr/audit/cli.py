"""``rollcorr audit``: sample responses, score the same tokens with the learner, write a mismatch report.

    rollcorr audit                                   # built-in model, hf:bf16 sampler vs hf:fp32 learner
    rollcorr audit --sampler llamacpp:q4_0 --model DIR -n 128 --prompts prompts.jsonl
    rollcorr audit --from-log dump.jsonl             # a rollout dump from any framework (verl field names; - or a FIFO too)

Every input is checked before any long work: the prompts file (line numbers), sampling parameters, the model
path and GGUF file, engine specs. Errors print one line naming the problem and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_SAMPLER = "hf:bf16"
DEFAULT_LEARNER = "hf:fp32"
LIVE_ONLY = ("sampler", "learner", "model", "gguf_file", "prompts", "chat", "routing_replay")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    live = parser.add_argument_group("sampling (default: built-in model and addition prompts)")
    live.add_argument(
        "--sampler", help=f"sampler engine spec (default {DEFAULT_SAMPLER}), e.g. llamacpp:q4_0"
    )
    live.add_argument("--learner", help=f"learner engine spec (default {DEFAULT_LEARNER})")
    live.add_argument("--model", help="local Hugging Face model directory (default: the built-in model)")
    live.add_argument(
        "--gguf-file", help="GGUF file inside --model (or a path to one) to load the model from"
    )
    live.add_argument("--prompts", help='prompts: JSONL ({"prompt": ...} per line) or one prompt per line')
    live.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    live.add_argument(
        "--routing-replay",
        choices=("r3",),
        help="mixture-of-experts models: the learner replays the sampler's routed experts (R3)",
    )
    live.add_argument("-n", "--num-responses", type=int, default=64, help="responses to sample (default 64)")
    live.add_argument("--max-new-tokens", type=int, default=64, help="response length cap (default 64)")
    live.add_argument("--temperature", type=float, default=1.0)
    live.add_argument("--top-k", type=int, default=0, help="0 = off")
    live.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    live.add_argument("--seed", type=int, default=0)
    live.add_argument("--batch-size", type=int, default=8, help="prompts per sampling batch (default 8)")
    live.add_argument(
        "--sampler-dist",
        choices=("full", "processed"),
        default="full",
        help="compare the learner with the sampler's distribution before top-k/top-p truncation (full, "
        "default: truncation is not mismatch) or with the renormalised one it drew from (processed)",
    )
    log = parser.add_argument_group("from a rollout dump")
    log.add_argument(
        "--from-log", help="rollout dump (JSONL / Parquet) with per-token rollout and learner log-probs"
    )
    log.add_argument("--rollout-field", default="rollout_log_probs", help="sampler log-prob field")
    log.add_argument("--learner-field", default="old_log_probs", help="learner log-prob field")
    log.add_argument("--mask-field", default="response_mask", help="response mask field")
    parser.add_argument("--out", help="report folder (default: a new runs/audit-<time> folder)")
    parser.add_argument("--worst", type=int, default=10, help="worst tokens to list (default 10)")


def _fail(message: str) -> int:
    print(f"rollcorr audit: error: {message}", file=sys.stderr)
    return 2


def _check_engines(args) -> tuple[str, str, str | None, str | None]:
    """(sampler spec, learner spec, model folder, GGUF file name) once everything that can be checked without
    loading is fine (``rollcorr.engines.preflight``): a --gguf-file path without --model names its own folder."""
    from rollcorr.engines.preflight import PreflightError, preflight

    sampler_spec, learner_spec = args.sampler or DEFAULT_SAMPLER, args.learner or DEFAULT_LEARNER
    model, gguf_file = args.model, args.gguf_file
    if gguf_file and model is None:
        if not Path(gguf_file).is_file():
            raise FileNotFoundError(
                f"--gguf-file {gguf_file!r} does not exist (or pass the folder with --model)"
            )
        model, gguf_file = str(Path(gguf_file).parent), Path(gguf_file).name
    if model and str(model).lower().endswith(".gguf") and gguf_file is None:
        raise ValueError(
            f"--model {model!r} is a GGUF file; give it with --gguf-file {model} (the folder with --model, "
            "or the file alone)"
        )
    for role, spec in (("sampler", sampler_spec), ("learner", learner_spec)):
        try:
            preflight(spec, model, role=role, gguf_file=gguf_file)
        except PreflightError as err:
            flag = {"spec": f"--{role}", "extra": f"--{role}", "path": "--model"}.get(err.field, "--gguf-file")
            raise ValueError(f"{flag}: {err}") from None
    # defaults said out loud: "vllm" runs bf16, so the report and the terminal say "vllm:bf16"
    from rollcorr.engines import parse_spec

    if parse_spec(sampler_spec).backend == "vllm":
        sampler_spec = str(parse_spec(sampler_spec))
    if gguf_file and not (Path(model) / gguf_file).is_file():
        found = sorted(p.name for p in Path(model).glob("*.gguf"))
        raise FileNotFoundError(f"--gguf-file {gguf_file!r} not found in {model!r}; GGUF files there: {found}")
    if sampler_spec == "llamacpp:file" and not gguf_file:
        raise ValueError("--sampler llamacpp:file serves a shipped GGUF file as it is: give --gguf-file")
    return sampler_spec, learner_spec, model, gguf_file


def materialise_gguf(model_dir: str, gguf_file: str, into: Path) -> Path:
    """Dequantise a GGUF model into a Hugging Face folder both engines can load (``gguf_to_hf``).

    The hf engines then see exactly the weights the GGUF holds; a llamacpp sampler re-exports that folder to
    its own quantisation. Tensors are dequantised one at a time, so this holds one float32 copy at most.
    """
    from rollcorr.engines.gguf import gguf_to_hf

    return gguf_to_hf(Path(model_dir) / gguf_file, into)


def _out_dir(out: str | None) -> Path:
    if out:
        return Path(out)
    return Path("runs") / time.strftime("audit-%Y%m%d-%H%M%S")


def _prepare_prompts(prompts: list[str], args, tokenizer) -> list[str | list[int]]:
    """What the sampler gets for each prompt — token ids through the chat template with ``--chat``, applied once
    as the trainer applies it (``rollcorr.tasks.chat.model_input``), else the text — cycled until there are N."""
    if args.chat:
        from rollcorr.tasks.chat import has_template, model_input

        if not has_template(tokenizer):
            raise ValueError("--chat: the model's tokenizer has no chat template")
        try:
            prompts = [model_input(tokenizer, p, chat=True) for p in prompts]
        except ValueError as err:  # a template that fails to render (or tries to escape its sandbox)
            raise ValueError(f"--chat: {err}") from None
    reps = -(-args.num_responses // len(prompts))  # cycle through the prompts until N responses
    return (prompts * reps)[: args.num_responses]


def _length(tokenizer, prompt: str | list[int]) -> int:
    return len(prompt) if not isinstance(prompt, str) else len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _collect_live(args, console, workdir: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rollcorr.audit.collect import builtin_prompts, collect, from_rollout, learner_routing, load_prompts
    from rollcorr.engines import SamplingParams, make_learner, make_sampler, parse_spec

    if args.num_responses < 1 or args.batch_size < 1:
        raise ValueError(f"-n and --batch-size must be >= 1, got {args.num_responses} and {args.batch_size}")
    # line-numbered prompt errors before anything is loaded
    prompts = (
        load_prompts(args.prompts) if args.prompts else builtin_prompts(args.num_responses, seed=args.seed)
    )
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    sampler_spec, learner_spec, model, gguf_file = _check_engines(args)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # rollcorr's own progress bars are the ones to read
    with console.status(f"loading learner {learner_spec} and sampler {sampler_spec} ..."):
        model_path = model
        if gguf_file:
            model_path = materialise_gguf(model, gguf_file, Path(workdir) / "model")
        learner = make_learner(learner_spec, model_path=model_path, routing_replay=args.routing_replay)
        prompts = _prepare_prompts(prompts, args, learner.tokenizer)
        from rollcorr.engines.preflight import check_prompts

        positions = getattr(learner.model.config, "max_position_embeddings", None)
        distinct = list({p if isinstance(p, str) else tuple(p): p for p in prompts}.values())
        check_prompts(learner.tokenizer, distinct, params.max_new_tokens, positions, "prompt")
        sampler_kw = {}
        if parse_spec(sampler_spec).backend == "llamacpp":
            # llama.cpp allocates its KV cache for max_batch rows × n_ctx tokens up front; the model's own
            # context (8192 for SmolLM2) would cost GBs, so size it to what this audit needs
            longest = max(_length(learner.tokenizer, p) for p in prompts)
            sampler_kw = {"max_batch": args.batch_size, "n_ctx": longest + args.max_new_tokens}
        if sampler_spec == "llamacpp:file":  # serve the user's GGUF as shipped (e.g. Q4_1)
            sampler_kw["gguf_file"] = str(Path(model) / gguf_file)
        sampler = make_sampler(sampler_spec, model_path=model_path, **sampler_kw)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    started = time.perf_counter()
    try:
        with Progress(*columns, console=console) as progress:
            tasks = {
                "sample": progress.add_task(f"sampling ({sampler_spec})", total=len(prompts)),
                "score": progress.add_task(f"scoring  ({learner_spec})", total=len(prompts)),
            }
            rollout = collect(
                sampler,
                learner,
                prompts,
                params,
                batch_size=args.batch_size,
                on_batch=lambda stage, rows: progress.advance(tasks[stage], rows),
            )
    finally:
        close = getattr(sampler, "close", None)
        if close:
            close()
    if args.routing_replay and rollout.routed_experts is None:
        raise ValueError(f"--routing-replay: sampler {sampler_spec} returned no routed experts to replay")
    learner_routes = learner_routing(learner, rollout, args.batch_size)
    source = {
        "sampler": sampler_spec,
        "learner": learner_spec,
        "model": model or "builtin",
        **({"gguf_file": gguf_file} if gguf_file else {}),
        "prompts": args.prompts or "builtin addition task (test split)",
        "chat_template": args.chat,
        **({"routing_replay": args.routing_replay} if args.routing_replay else {}),
        "responses": len(prompts),
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "seed": params.seed,
        "seconds": round(time.perf_counter() - started, 2),
    }
    return from_rollout(rollout, learner.tokenizer, sampler_dist=args.sampler_dist, source=source,
                        learner_routed_experts=learner_routes)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rollcorr.audit.dump_audit import audit_log
    from rollcorr.audit.report import print_summary, write_report

    console = Console()
    if args.worst < 0:
        return _fail(f"--worst must be >= 0, got {args.worst}")
    out = _out_dir(args.out)
    if out.exists() and not out.is_dir():  # e.g. `--from-log F --out F`: checked before any work
        return _fail(f"--out {out}: exists and is not a folder (the report is a folder of files); choose another")
    try:
        if args.from_log:
            given = [f"--{name.replace('_', '-')}" for name in LIVE_ONLY if getattr(args, name, None)]
            if given:
                return _fail(f"--from-log reads log-probs from the file; {', '.join(given)} do(es) not apply")
            # read chunk by chunk: a dump too large to hold padded is summed as it is read (audit.dump_audit)
            log = audit_log(args.from_log, rollout_field=args.rollout_field, learner_field=args.learner_field,
                            mask_field=args.mask_field, worst_k=args.worst)  # fmt: skip
        else:
            log = None
            with tempfile.TemporaryDirectory(prefix="rollcorr-audit-") as workdir:
                data = _collect_live(args, console, workdir)
    except (ValueError, FileNotFoundError, ImportError, NotImplementedError) as err:
        return _fail(str(err))
    try:
        summary = log.write(out, worst_k=args.worst) if log is not None else write_report(data, out, worst_k=args.worst)
    except OSError as err:  # a read-only place (/proc, /sys), a full disk: one line
        from rollcorr.safe_io import describe_os_error

        return _fail(f"--out {out}: cannot write the report ({describe_os_error(err)})")
    print_summary(summary, console)
    malformed = summary["source"].get("malformed_rows")
    if malformed:
        console.print(f"[yellow]{len(malformed)} malformed row(s) skipped:[/] " + "; ".join(malformed[:5]))
    console.print(f"report: {out / 'report.html'}  (summary.json and PNGs beside it)")
    return 0
