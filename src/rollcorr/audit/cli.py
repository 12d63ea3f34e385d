"""``rollcorr audit``: sample responses, score the same tokens with the learner, write a mismatch report.

    rollcorr audit                                   # built-in model, hf:bf16 sampler vs hf:fp32 learner
    rollcorr audit --sampler llamacpp:q4_0 --model DIR -n 128 --prompts prompts.jsonl
    rollcorr audit --from-log dump.jsonl             # a rollout dump from any framework (verl field names; - or a FIFO too)
    rollcorr audit --localize --whatif               # where the mismatch enters, and what would remove it
    rollcorr audit --from-run runs/RUN --step 200    # what a training run samples and scores, at a checkpoint
    rollcorr audit --model builtin:chain --env checkpoints   # trajectories through an environment, per turn

Every input is checked before any long work: the prompts file (line numbers), sampling parameters, the model
path and GGUF file, engine specs. Errors print one line naming the problem and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_SAMPLER = "hf:bf16"
DEFAULT_LEARNER = "hf:fp32"
LIVE_ONLY = ("sampler", "learner", "model", "gguf_file", "prompts", "chat", "routing_replay", "localize",
             "localize_exact", "whatif", "from_run", "step", "env", "task", "reward")


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
    live.add_argument("--max-new-tokens", type=int, default=None, help="response length cap (default 64)")
    live.add_argument("--temperature", type=float, default=None, help="default 1.0")
    live.add_argument("--top-k", type=int, default=None, help="0 = off (default)")
    live.add_argument("--top-p", type=float, default=None, help="1.0 = off (default)")
    live.add_argument("--seed", type=int, default=0)
    live.add_argument("--batch-size", type=int, default=8, help="prompts per sampling batch (default 8)")
    live.add_argument(
        "--sampler-dist",
        choices=("full", "processed", "keep_mask"),
        default="full",
        help="compare the learner with the sampler's distribution before top-k/top-p truncation (full, "
        "default: truncation is not mismatch), with the renormalised one it drew from (processed), or both "
        "renormalised over the sampler's kept sets (keep_mask: what training compares by default)",
    )
    env = parser.add_argument_group("through an environment (multi-turn trajectories; docs/multi-turn.md)")
    env.add_argument(
        "--env", metavar="SPEC",
        help="play each item's episode through an environment, as task.env names it: its name (checkpoints) or a "
        "mapping with its options and limits ('{name: checkpoints, every: 7, max_turns: 2}'); the report adds the "
        "mismatch per turn and the token-in-token-out check",
    )
    env.add_argument("--task", help="the task whose items are played (a built-in task or a data set, as task.name; "
                     "default: the built-in model's own task); without --env each item is a one-turn episode")
    env.add_argument("--reward", help="--task's reward, as task.reward: a data set's verifier (exact, last_number, "
                     "boxed, ...; default exact) or module:function; the report gives the trajectories' mean")
    run = parser.add_argument_group("from a training run")
    run.add_argument(
        "--from-run", metavar="RUN",
        help="audit what a `rollcorr train` run samples and scores: its model at a checkpoint, its sampler and "
        "learner (--sampler / --learner override them), its task's training prompts through its chat template, "
        "its temperature, top-k, top-p and response length",
    )
    run.add_argument("--step", type=int, help="with --from-run: the checkpoint's step (default: the newest; the "
                     "run's starting model when it has none); 0: the run's starting model")
    diagnosis = parser.add_argument_group("diagnosis (hf engines; docs/audit.md)")
    diagnosis.add_argument(
        "--localize", nargs="?", type=int, const=8, default=None, metavar="N",
        help="where the mismatch enters: the two forwards of the same tokens compared layer by layer and component "
        "by component, on the N responses holding the largest |Δp| (default 8): every component's share estimated "
        "to first order from one backward, the largest measured exactly",
    )
    diagnosis.add_argument(
        "--localize-exact", action="store_true",
        help="with --localize: measure every component exactly (each swapped alone into the learner, run from its "
        "layer on; about L + 3 forwards on an L-layer model, against about 3 and a backward for the default)",
    )
    diagnosis.add_argument(
        "--whatif", nargs="?", const="", default=None, metavar="CHANGES",
        help="rerun the sampler with one change each and report what mismatch it leaves: a comma list of fp16, "
        "bf16, fp32, lm_head_fp32, batch (default: the changes that apply to the sampler)",
    )
    log = parser.add_argument_group("from a rollout dump")
    log.add_argument(
        "--from-log", help="rollout dump (JSONL / Parquet) with per-token rollout and learner log-probs"
    )
    log.add_argument("--rollout-field", default="rollout_log_probs", help="sampler log-prob field")
    log.add_argument("--learner-field", default="old_log_probs", help="learner log-prob field")
    log.add_argument("--mask-field", default="response_mask", help="response mask field")
    parser.add_argument("--out", help="report folder, new or empty (default: a new runs/audit-<time>-<suffix> folder)")
    parser.add_argument("--overwrite", action="store_true", help="replace the report in a non-empty --out folder")
    parser.add_argument("--worst", type=int, default=10, help="worst tokens to list (default 10)")


SAMPLING_DEFAULTS = {"max_new_tokens": 64, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
FROM_RUN_CONFLICTS = ("model", "gguf_file", "prompts", "chat", "env", "task", "reward")


def _run_plan(args) -> dict:
    """--from-run: what the run trains — the model folder at ``--step`` (default the newest checkpoint, else the
    run's starting model), its engines, its task and chat setting, its sampling settings — checked before anything
    loads (a missing run, config or step is one line naming it)."""
    from rollcorr.checkpoint import checkpoint_dir, checkpoint_step, list_checkpoints
    from rollcorr.engines.lora import ADAPTER_CONFIG
    from rollcorr.train.config import ConfigError, load_config, missing_keys

    given = [f"--{name.replace('_', '-')}" for name in FROM_RUN_CONFLICTS if getattr(args, name, None) not in (None, False)]
    if given:
        raise ValueError(f"--from-run takes the model, prompts and chat template from the run (and its environment); "
                         f"{', '.join(given)} do(es) not apply")
    run = Path(args.from_run)
    if not (run / "config.yaml").is_file():
        raise FileNotFoundError(f"--from-run {run}: not a run folder (no config.yaml); give the folder `rollcorr "
                                "train` wrote (runs/<timestamp>-<suffix>)")
    try:
        config = load_config(run / "config.yaml", inside_run=True)
    except ConfigError as err:
        raise ValueError(f"--from-run {run}: its config.yaml cannot be read ({err})") from None
    missing = missing_keys(run / "config.yaml")
    note = missing and (f"--from-run {run}: its config.yaml has no {', '.join(missing[:6])}"
                        f"{f' (and {len(missing) - 6} more)' if len(missing) > 6 else ''}: cut short, edited or "
                        "written by an older rollcorr; their defaults are used")
    steps = {checkpoint_step(p): p for p in list_checkpoints(run)}
    if args.step is not None and args.step not in steps and args.step != 0:
        raise FileNotFoundError(f"--step {args.step}: {run} has no checkpoint of that step (it has: "
                                f"{sorted(steps) or 'none'}; --step 0 is the run's starting model)")
    if args.step is not None and args.step in steps:
        model, step = str(checkpoint_dir(run, args.step) / "model"), args.step
    elif args.step == 0:  # the run's starting model: its model.path (a LoRA run's base, adapters off)
        model, step = config.model.path, 0
    elif steps:
        step = max(steps)
        model = str(checkpoint_dir(run, step) / "model")
    else:
        model, step = config.model.path, 0
    adapters = None
    if step and (Path(model) / ADAPTER_CONFIG).is_file():  # a LoRA run: its base, the checkpoint's adapters merged in
        adapters, model = model, config.model.path
    if model.startswith("builtin"):
        model = None if model == "builtin" else model
    elif not Path(model).is_dir():
        raise FileNotFoundError(f"--from-run {run}: the model folder {model} is missing")
    from rollcorr.tasks.verifiers import check_named_reward, reward_module

    module = reward_module(config.task.reward)
    check_named_reward(config.task.reward, f"--from-run {run}: its config.yaml",
                       f"name it yourself: rollcorr audit --plugins {module} --from-run ... (docs/security.md)")
    try:
        task = config.task.build()
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"--from-run {run}: its task cannot be rebuilt here ({err})") from None
    r = config.rollout
    return {"run": str(run), "step": step, "model": model, "adapters": adapters, "task": task, "chat": config.task.chat, "note": note,
            "task_config": config.task,
            "sampler": config.model.sampler, "learner": config.model.learner,
            "sampling": {"max_new_tokens": r.max_new_tokens, "temperature": r.temperature, "top_k": r.top_k,
                         "top_p": r.top_p}}


def _env_plan(args, plan: dict | None) -> dict | None:
    """The environment the audit plays — ``--env`` / ``--task``, or a --from-run run's ``task.env`` —, its items
    (one trajectory each) and limits, checked before anything loads; None: prompts sampled as they are (a
    --from-run run of one turn keeps that path)."""
    from rollcorr.train.config import ConfigError, TaskConfig, check_env

    if plan is not None:
        if not plan["task_config"].env:
            return None
        task_config, task, where, split = plan["task_config"], plan["task"], f"--from-run {plan['run']}: task.env", "train"
    elif args.env is None and args.task is None:
        if args.reward is not None:
            raise ValueError("--reward scores the items of --task (or --env's); give the task")
        return None
    else:
        if args.prompts:
            raise ValueError("--prompts: --env / --task play the items of a task; give the prompts or the task")
        spec = _env_spec(args.env)
        try:
            check_env(spec)
        except ConfigError as err:
            raise ValueError(f"--env: {str(err).removeprefix('task.env: ')}") from None
        task_config = TaskConfig(name=args.task or _model_task(args.model), reward=args.reward, env=spec)
        where, split = "--env", "test"
        try:
            task = task_config.build()
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"--task {task_config.name}: {err}") from None
    try:
        env = task_config.environment(task)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    items = env.sample(args.num_responses, seed=args.seed, split=split)
    return {"env": env, "items": items, "limits": task_config.limits(), "task": task_config.name,
            "reward": task_config.reward, "spec": task_config.env}


def _env_spec(text: str | None) -> dict | None:
    """``--env``: an environment's name, or a YAML mapping as ``task.env`` holds it (None: a one-turn episode)."""
    if text is None:
        return None
    from rollcorr.config.yaml_io import YamlError, load_yaml

    try:
        value = load_yaml(text, "--env")
    except YamlError as err:
        raise ValueError(str(err)) from None
    if not isinstance(value, str | dict):
        raise ValueError(f"--env {text!r}: give an environment's name, or a mapping as task.env holds it: "
                         "'{name: checkpoints, every: 7, max_turns: 2}'")
    return {"name": value} if isinstance(value, str) else value


def _model_task(model: str | None) -> str:
    """The task a built-in model was trained on (``--task``'s default)."""
    from rollcorr.models.builtin import BUILTIN_MODELS

    spelling = model or "builtin"
    if spelling not in BUILTIN_MODELS:
        raise ValueError("--env / --task: name the task whose items are played with --task NAME (a model that is "
                         "not a built-in one has no task of its own)")
    return BUILTIN_MODELS[spelling].task


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
    # as the backend names it in reports: e.g. "vllm" runs bf16, so the report and the terminal say "vllm:bf16"
    from rollcorr.engines import backend_of, parse_spec

    sampler_spec = backend_of(sampler_spec).shown(parse_spec(sampler_spec), sampler_spec)
    if gguf_file and not (Path(model) / gguf_file).is_file():
        found = sorted(p.name for p in Path(model).glob("*.gguf"))
        raise FileNotFoundError(f"--gguf-file {gguf_file!r} not found in {model!r}; GGUF files there: {found}")
    return sampler_spec, learner_spec, model, gguf_file


def materialise_gguf(model_dir: str, gguf_file: str, into: Path) -> Path:
    """Dequantise a GGUF model into a Hugging Face folder both engines can load (``gguf_to_hf``).

    The hf engines then see exactly the weights the GGUF holds; a llamacpp sampler re-exports that folder to
    its own quantisation. Tensors are dequantised one at a time, so this holds one float32 copy at most.
    """
    from rollcorr.engines.gguf import gguf_to_hf

    return gguf_to_hf(Path(model_dir) / gguf_file, into)


REPORT_FILES = ("summary.json", "report.html")  # and *.png: what a report folder holds


def _out_dir(out: str | None) -> Path:
    """--out, or runs/audit-<time>-<random suffix>: two audits started in the same second get two folders."""
    if out:
        return Path(out)
    import secrets

    return Path("runs") / f"{time.strftime('audit-%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def _claim(out: Path, overwrite: bool):
    """Refuse a non-empty --out unless --overwrite (then remove its old report files); lock the folder for this
    audit (a second audit into it stops at once, naming the first's pid). Returns the lock."""
    from rollcorr.train.rundir import LOCK_FILE, RunLock

    if out.exists() and not out.is_dir():  # e.g. `--from-log F --out F`
        raise ValueError(f"--out {out}: exists and is not a folder (the report is a folder of files); choose another")
    held = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ValueError(f"--out {out}: not empty ({shown}); choose a new folder, or pass --overwrite to replace "
                         "the report in it")
    out.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out)
    if overwrite:
        _remove_report(out)
    return lock


def _remove_report(out: Path) -> None:
    """Delete the report files in ``out`` (summary, HTML, PNGs), leaving anything else."""
    for path in out.iterdir():
        if path.name in REPORT_FILES or path.suffix == ".png":
            path.unlink(missing_ok=True)


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

    from rollcorr.audit.collect import from_rollout, learner_routing
    from rollcorr.engines import SamplingParams, backend_of, make_learner, make_sampler, parse_spec
    from rollcorr.engines.spec import check_kept_ids, check_kept_mass, check_truncation

    if args.num_responses < 1 or args.batch_size < 1:
        raise ValueError(f"-n and --batch-size must be >= 1, got {args.num_responses} and {args.batch_size}")
    plan = _run_plan(args) if args.from_run else None
    if args.step is not None and plan is None:
        raise ValueError("--step picks a checkpoint of --from-run RUN; give the run")
    episodes = _env_plan(args, plan)  # an environment to play (--env / --task, a multi-turn run), or None
    prompts = _live_prompts(args, plan, episodes, console)  # line-numbered prompt errors before anything is loaded
    defaults = plan["sampling"] if plan is not None else SAMPLING_DEFAULTS
    sampling = {key: getattr(args, key) if getattr(args, key) is not None else value for key, value in defaults.items()}
    params = SamplingParams(**sampling, seed=args.seed, record_kept_ids=args.sampler_dist == "keep_mask")
    sampler_spec, learner_spec, model, gguf_file = _check_engines(args)
    changes = _check_diagnosis(args, sampler_spec)
    check_truncation(sampler_spec, params.top_k, params.top_p, ("--top-k", "--top-p"))
    check_kept_mass(sampler_spec, params.truncated, args.sampler_dist == "full", "--sampler-dist full")
    check_kept_ids(sampler_spec, params.records_kept_ids, "--sampler-dist keep_mask",
                   "compare with the distribution it drew from (--sampler-dist processed)")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # rollcorr's own progress bars are the ones to read
    with console.status(f"loading learner {learner_spec} and sampler {sampler_spec} ..."):
        model_path = model
        if gguf_file:
            model_path = materialise_gguf(model, gguf_file, Path(workdir) / "model")
        if plan is not None and plan["adapters"]:  # a LoRA run's checkpoint: its adapters merged into the base
            from rollcorr.engines.lora import merge_adapters

            model_path = str(merge_adapters(model or "builtin", plan["adapters"], Path(workdir) / "model"))
        learner = make_learner(learner_spec, model_path=model_path, routing_replay=args.routing_replay)
        if plan is not None:  # the run's own chat setting (null: the template when the tokenizer has one)
            from rollcorr.tasks.chat import uses_chat

            args.chat = uses_chat(learner.tokenizer, plan["chat"])
        prompts, tokens = _checked_prompts(prompts, args, learner, params, episodes)
        # what the engine needs to know up front (llama.cpp sizes its KV cache for this audit, serves a GGUF file)
        sampler_kw = backend_of(sampler_spec).audit_kwargs(
            parse_spec(sampler_spec), rows=args.batch_size, tokens=tokens,
            gguf_file=str(Path(model) / gguf_file) if gguf_file else None,
        )
        sampler = make_sampler(sampler_spec, model_path=model_path, **sampler_kw)
    gather = _gatherer(args, learner, prompts, params, episodes)
    rows = len(prompts) if episodes is None else len(episodes["items"])
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    started = time.perf_counter()
    try:
        with Progress(*columns, console=console) as progress:
            tasks = {
                "sample": progress.add_task(f"sampling ({sampler_spec})", total=rows),
                "score": progress.add_task(f"scoring  ({learner_spec})", total=rows),
            }
            rollout, conversations = gather(sampler, lambda stage, n: progress.advance(tasks[stage], n))
            diagnosis = _diagnose(args, sampler_spec, changes, progress, sampler, learner, rollout, gather, params,
                                  lambda spec, **kw: make_sampler(spec, model_path=model_path, **sampler_kw, **kw))
    finally:
        close = getattr(sampler, "close", None)
        if close:
            close()
    if args.routing_replay and rollout.routed_experts is None:
        raise ValueError(f"--routing-replay: sampler {sampler_spec} returned no routed experts to replay")
    learner_routes = learner_routing(learner, rollout, args.batch_size)
    source = _source(args, plan, episodes, rollout, sampler_spec, learner_spec, model, gguf_file, params)
    source["seconds"] = round(time.perf_counter() - started, 2)
    data = from_rollout(rollout, learner.tokenizer, sampler_dist=args.sampler_dist, source=source,
                        learner_routed_experts=learner_routes)
    data.diagnosis = diagnosis
    if episodes is not None:
        with console.status("token in, token out: re-tokenising the conversations ..."):
            data.tito = _tito(args, learner, rollout, conversations, data, params)
    return data


def _live_prompts(args, plan: dict | None, episodes: dict | None, console) -> list:
    """The prompts a live audit samples: through an environment (``_env_plan``) its items' first prompts, checked
    as the sampler gets them; with ``--from-run`` the run's training prompts (text or conversations; the template
    comes later), and the run's model and engines unless named; else ``--prompts``' file or the built-in task's."""
    from rollcorr.audit.collect import builtin_prompts, load_prompts

    if plan is None and episodes is None:
        return load_prompts(args.prompts) if args.prompts else builtin_prompts(args.num_responses, seed=args.seed)
    if plan is not None:
        if plan["note"]:
            console.print(f"[yellow]note:[/] {plan['note']}", highlight=False, soft_wrap=True)
        args.model, args.sampler, args.learner = plan["model"], args.sampler or plan["sampler"], args.learner or plan["learner"]
    if episodes is not None:
        return [item["prompt"] for item in episodes["items"] if "prompt" in item]
    return [item["prompt"] for item in plan["task"].sample(args.num_responses, seed=args.seed, split="train")]


def _checked_prompts(prompts, args, learner, params, episodes) -> tuple[list, int]:
    """(what the sampler gets for each prompt, the longest sequence a row can grow to), the prompts checked against
    the model's context; an environment's rows grow by turns: up to ``max_tokens`` when the environment sets it,
    else a turn's budget again for each observation (their lengths are known only once said)."""
    from rollcorr.engines.preflight import check_prompts

    if not prompts:  # an environment whose items carry no prompt: its episodes say it
        return prompts, 0
    prompts = _prepare_prompts(prompts, args, learner.tokenizer)
    positions = getattr(learner.model.config, "max_position_embeddings", None)
    distinct = list({p if isinstance(p, str) else tuple(p): p for p in prompts}.values())
    check_prompts(learner.tokenizer, distinct, params.max_new_tokens, positions, "prompt")
    longest = max(_length(learner.tokenizer, p) for p in distinct)
    if episodes is None:
        return prompts, longest + params.max_new_tokens
    turns = min(episodes["env"].max_turns, episodes["limits"].max_turns or episodes["env"].max_turns)  # as Episodes
    return prompts, longest + (episodes["limits"].max_tokens or 2 * turns * params.max_new_tokens)


def _gatherer(args, learner, prompts, params, episodes):
    """``gather(sampler, on_batch) -> (rollout, conversations)``: the audit's rows sampled by ``sampler`` and scored
    by the learner — the prompts as they are (conversations None), or each item's episode through the
    environment (each row's conversation as messages)."""
    from rollcorr.audit.collect import collect, collect_episodes

    if episodes is None:
        return lambda sampler, on_batch=None: (collect(sampler, learner, prompts, params, batch_size=args.batch_size,
                                                       on_batch=on_batch), None)
    from rollcorr.envs import Renderer

    renderer = Renderer(learner.tokenizer, args.chat)
    return lambda sampler, on_batch=None: collect_episodes(
        sampler, learner, episodes["env"], episodes["items"], renderer, params, limits=episodes["limits"],
        batch_size=args.batch_size, on_batch=on_batch)


def _tito(args, learner, rollout, conversations, data, params) -> dict:
    """The token-in-token-out check of the played trajectories (``rollcorr.audit.tito``), scored by the learner."""
    import torch

    from rollcorr.audit.tito import tito_check
    from rollcorr.envs import Renderer

    def score(part):
        with torch.no_grad():
            return learner.log_prob(part, temperature=params.temperature or 1.0).detach().float().cpu()

    try:
        return tito_check(rollout, conversations, Renderer(learner.tokenizer, args.chat), data.rollout_log_prob,
                          rollout.old_log_prob, score, batch_size=args.batch_size)
    except ValueError as err:  # a template that fails on the conversation (e.g. it refuses a role)
        raise ValueError(f"token in, token out: the chat template cannot re-tokenise a conversation ({err})") from None


def _played(episodes: dict, rollout) -> dict:
    """What an audit through an environment played (``summary["source"]``): the environment (``{"name": "(one
    turn)"}`` for ``--task`` alone), task, reward and its mean, and the ``env/`` metrics of a run — given whatever
    the episodes did (``episode_metrics`` is empty for a batch in which no episode went past its first turn)."""
    from rollcorr.envs import episode_metrics

    metrics = episode_metrics(rollout) or {
        "env/turns_mean": 1.0, "env/turns_max": 1.0, "env/observation_token_share": 0.0,
        "env/cut_share": sum(bool(m.get("cut")) for m in rollout.meta) / len(rollout.meta)}
    return {"environment": episodes["spec"] or {"name": "(one turn)"}, "task": episodes["task"],
            **({"reward": episodes["reward"]} if episodes["reward"] else {}),
            "reward_mean": round(float(rollout.rewards.mean()), 4),
            **{k.removeprefix("env/"): round(v, 4) for k, v in metrics.items()}}


def _source(args, plan: dict | None, episodes: dict | None, rollout, sampler_spec: str, learner_spec: str,
            model: str | None, gguf_file: str | None, params) -> dict:
    """How a live audit's data was made (``summary["source"]``): what the report shows and what its suggested
    commands repeat (``verdict.override``, ``verdict.audit_command``); an environment's episodes add what was
    played (its spec, task, reward) and the ``env/`` metrics of the trajectories."""
    if episodes is not None:
        played = _played(episodes, rollout)
        prompts = f"the items of task {episodes['task']} ({'train' if plan is not None else 'test'} split)"
    else:
        played = {}
        prompts = (f"the run's task ({plan['task'].__class__.__name__}, train split)" if plan is not None
                   else args.prompts or "builtin addition task (test split)")
    return {
        "sampler": sampler_spec,
        "learner": learner_spec,
        "model": (plan or {}).get("adapters") or model or "builtin",
        **({"gguf_file": gguf_file} if gguf_file else {}),
        "prompts": prompts,
        **({"prompts_file": args.prompts} if args.prompts else {}),
        **played,
        **({"run": plan["run"], "step": plan["step"]} if plan is not None else {}),
        "chat_template": args.chat,
        "sampler_dist": args.sampler_dist,
        **({"routing_replay": args.routing_replay} if args.routing_replay else {}),
        "responses": rollout.batch_size,
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "seed": params.seed,
    }


def _check_diagnosis(args, sampler_spec: str) -> list[str] | None:
    """--localize / --whatif checked before anything loads: N ≥ 1, a sampler in this process for --localize, known changes
    that apply to this sampler. Returns the --whatif changes (None without it)."""
    from rollcorr.audit.whatif import parse_changes
    from rollcorr.engines import backend_of
    from rollcorr.engines.spec import backends_that

    if args.localize_exact and args.localize is None:
        raise ValueError("--localize-exact measures --localize's components exactly: add --localize")
    if args.localize is not None:
        if args.localize < 1:
            raise ValueError(f"--localize N: N must be >= 1 responses, got {args.localize}")
        if not backend_of(sampler_spec).in_process:
            here = " / ".join(backends_that("in_process"))
            raise ValueError(f"--localize compares the two models module by module, so the sampler must run in this "
                             f"process (an {here} engine); {sampler_spec} runs its own kernels out of reach of the "
                             f"hooks (compare an {here} sampler of the same precision, or use --whatif)")
    return None if args.whatif is None else parse_changes(args.whatif, sampler_spec)


def _diagnose(args, sampler_spec, changes, progress, sampler, learner, rollout, gather, params, build) -> dict:
    """--localize and --whatif on the audited rollout, while its sampler is still loaded (``gather``: the audit's
    rows sampled again by another sampler and scored, as ``_gatherer`` makes it)."""
    from rollcorr.audit.collect import from_rollout

    out: dict = {}
    full = from_rollout(rollout, sampler_dist="full")  # the audit's own log μ of these tokens
    if args.localize is not None:
        from rollcorr.audit.localize import components, localize

        # exact: one step per component; the default's exact measurements are as many as fit its budget
        task = progress.add_task("localising", total=len(components(learner.model)) if args.localize_exact else None)
        out["localization"] = localize(sampler, learner, rollout, temperature=params.temperature,
                                       responses=args.localize, audit_log_mu=full.rollout_log_prob,
                                       on_component=lambda name: progress.advance(task), exact=args.localize_exact)
    if changes:
        from rollcorr.audit.whatif import run_whatif

        task = progress.add_task("what if", total=len(changes))

        def sample_and_score(other):
            scored, _ = gather(other)
            return from_rollout(scored, sampler_dist=args.sampler_dist)

        out["whatif"] = run_whatif(changes, sampler_spec, build, sample_and_score, sampler,
                                   rollout, on_change=lambda name: progress.advance(task))
    return out


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    # torch's CPU detection (cpuinfo) reads /proc/cpuinfo on its first use: done now, while a file descriptor is
    # free, so an audit that later runs out of them says so in rollcorr's one line alone
    torch.backends.cpu.get_cpu_capability()
    console = Console()
    if args.worst < 0:
        return _fail(f"--worst must be >= 0, got {args.worst}")
    from rollcorr.train.rundir import RunFolderError

    out = _out_dir(args.out)
    created = [folder for folder in (out, *out.parents) if not folder.exists()]  # innermost first
    try:  # checked and locked before any work
        lock = _claim(out, args.overwrite)
    except (ValueError, RunFolderError) as err:
        return _fail(str(err))
    except OSError as err:  # a place no folder can be made (/proc, /sys), a read-only disk: one line
        from rollcorr.safe_io import describe_os_error

        return _fail(f"--out {out}: cannot write the report: no folder can be made there ({describe_os_error(err)})")
    code = 1
    try:
        code = _audit(args, out, console)
        return code
    finally:
        lock.release()
        with contextlib.suppress(OSError):  # e.g. no file descriptor left: what could be tidied is
            (out / ".lock").unlink(missing_ok=True)
            if code != 0:  # a half-written report is no report (the folder held none before: _claim)
                _remove_report(out)
            for folder in created:  # an audit that stopped before writing leaves no empty folder (nor runs/)
                if any(folder.iterdir()):
                    break
                folder.rmdir()


def _audit(args, out: Path, console) -> int:
    from rollcorr.audit.dump_audit import audit_log
    from rollcorr.audit.report import print_summary, write_report

    try:
        if args.from_log:
            given = [f"--{name.replace('_', '-')}" for name in LIVE_ONLY if getattr(args, name, None) not in (None, False)]
            if given:
                return _fail(f"--from-log reads log-probs from the file; {', '.join(given)} do(es) not apply")
            # read chunk by chunk: a dump too large to hold padded is summed as it is read (audit.dump_audit)
            log = audit_log(args.from_log, rollout_field=args.rollout_field, learner_field=args.learner_field,
                            mask_field=args.mask_field, worst_k=args.worst)
        else:
            log = None
            with tempfile.TemporaryDirectory(prefix="rollcorr-audit-") as workdir:
                data = _collect_live(args, console, workdir)
    except (ValueError, FileNotFoundError, ImportError, NotImplementedError) as err:
        return _fail(str(err))
    try:
        summary = log.write(out, worst_k=args.worst) if log is not None else write_report(data, out, worst_k=args.worst)
    except OSError as err:  # a read-only place (/proc, /sys), a full disk, no file descriptor left: one line
        from rollcorr.safe_io import describe_os_error

        failed = f"--out {out}: cannot write the report ({describe_os_error(err)})"
    else:
        failed = None
    if failed is not None:  # ``run`` removes what was written, once the lock's descriptor is free too
        return _fail(failed)
    print_summary(summary, console)
    malformed = summary["source"].get("malformed_rows")
    if malformed:
        console.print(f"[yellow]{len(malformed)} malformed row(s) skipped:[/] " + "; ".join(malformed[:5]))
    console.print(f"report: {out / 'report.html'}  (summary.json and PNGs beside it)")
    return 0
