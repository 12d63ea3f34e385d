"""``rollcorr analyze [FILE]``: apply a correction config to a rollout dump and explain what it does.

Without FILE it runs on the sample dump shipped with rollcorr (bf16 sampler vs fp32 learner on the built-in
model). The correction applied: ``--preset`` / ``--config`` when given, else the one the dump records (a dump
written by ``RollcorrGRPOTrainer`` or ``write_dump(correction=...)``), else ``DEFAULT_PRESET``; ``--set``
overrides keys of any of them. The report says which it used.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path
from typing import Any

DEFAULT_PRESET = "decoupled_geo_rs_token_tis"
DIALECTS = ("verl", "trl", "nemo_rl", "skyrl", "openrlhf")


def sample_dump_path() -> Path:
    """The sample dump shipped in ``rollcorr/data``."""
    return Path(str(resources.files("rollcorr") / "data" / "sample_rollouts.jsonl"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        nargs="?",
        type=Path,
        help="rollout dump (.jsonl, .jsonl.gz or .parquet; - or a FIFO reads a stream); default: the shipped sample",
    )
    src = parser.add_argument_group(
        f"correction config (default: the one the dump records, else --preset {DEFAULT_PRESET})"
    )
    src.add_argument("--preset", help="a named preset (see --list-presets)")
    src.add_argument(
        "--config", type=Path, help="YAML file with CorrectionConfig keys (optionally 'preset: NAME')"
    )
    src.add_argument("--dialect", choices=DIALECTS, help="read --config as this framework's config keys")
    src.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one CorrectionConfig key (repeatable), e.g. --set is_upper=3 --set rs=seq_mean_k1",
    )
    src.add_argument("--list-presets", action="store_true", help="print the preset names and exit")
    fields = parser.add_argument_group("dump field names (defaults: verl's; peers' names are auto-detected)")
    fields.add_argument("--rollout-field", default="rollout_log_probs", help="sampler log-probs, log μ")
    fields.add_argument("--learner-field", default="old_log_probs", help="learner log-probs, log π_old")
    fields.add_argument(
        "--mask-field", default="response_mask", help="1 on valid tokens (else from list lengths)"
    )
    fields.add_argument("--advantages-field", default="advantages", help="per-token or per-row advantages")
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=8, help="rejected sequences / tokens to show (default 8)")
    out.add_argument(
        "--all-metrics", action="store_true", help="print every diagnostic, not the headline ones"
    )
    out.add_argument(
        "--json", dest="json_out", type=Path, metavar="OUT", help="write metrics and findings as JSON"
    )


def parse_value(text: str) -> Any:
    """A ``--set`` value, read as ``rollcorr train`` reads its overrides (``rollcorr.config.yaml_io``: YAML
    without its underscore and base-60 numbers, so ``0.5_2`` is a verl "lo_hi" window, not 0.52), plus
    Python-style None / True / False; text that is not YAML stays text."""
    from rollcorr.config.yaml_io import YamlError, load_yaml

    special = {"none": None, "null": None, "true": True, "false": False}
    if text.strip().lower() in special:
        return special[text.strip().lower()]
    try:
        return load_yaml(text, f"--set {text}")
    except YamlError:
        return text


def load_config(
    preset_name: str | None = None,
    config_path: Path | None = None,
    overrides: list[str] = (),
    dialect: str | None = None,
    recorded: dict[str, Any] | None = None,
) -> tuple[Any, str]:
    """Build the CorrectionConfig from a preset, a YAML file and ``KEY=VALUE`` overrides (applied in that order).

    With neither a preset nor a YAML file the base is ``recorded`` (the dump's own correction, keys that differ
    from ``CorrectionConfig()``) when given, else ``DEFAULT_PRESET``. Returns (config, a short description of
    where it came from). Raises ValueError on any bad input.
    """
    from rollcorr.config.correction import CorrectionConfig
    from rollcorr.config.presets import resolve
    from rollcorr.correction.rejection import check_rules

    data: dict[str, Any] = {}
    source: list[str] = []
    if config_path is not None:
        from rollcorr.config.yaml_io import load_yaml_file

        if not config_path.is_file():
            raise ValueError(f"--config file not found: {config_path}")
        # bounded (size, aliases, depth), a key twice refused; YamlError is a ValueError
        loaded = load_yaml_file(config_path, f"--config {config_path}") or {}
        if not isinstance(loaded, dict):
            raise ValueError(
                f"--config {config_path}: expected a mapping of config keys, got {type(loaded).__name__}"
            )
        if dialect is not None:
            from rollcorr.config import dialects

            loaded = getattr(dialects, f"from_{dialect}")(loaded).to_dict()
        elif "preset" in loaded:
            if preset_name is not None and preset_name != loaded["preset"]:
                raise ValueError(
                    f"--preset {preset_name} conflicts with 'preset: {loaded['preset']}' in {config_path}"
                )
            preset_name = loaded.pop("preset")
        data.update(loaded)
        source.append(str(config_path) if dialect is None else f"{config_path} ({dialect})")
    elif dialect is not None:
        raise ValueError("--dialect needs --config FILE")

    base: dict[str, Any] = {}
    if preset_name is None and config_path is None and recorded is not None:
        try:
            recorded_config = CorrectionConfig.from_dict(recorded)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"the dump's recorded correction is not a valid CorrectionConfig ({err})"
            ) from None
        base = recorded_config.to_dict()
        source.insert(0, f"the dump's own correction ({_preset_name(recorded_config)})")
    elif preset_name is None and config_path is None:
        preset_name = DEFAULT_PRESET
        source.insert(0, f"preset {preset_name} (default: the dump records no correction)")
    elif preset_name is not None:
        source.insert(0, f"preset {preset_name}")

    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        data[key.strip()] = parse_value(value)
    if overrides:
        source.append("--set " + " ".join(overrides))
    spec = {**base, **data} if preset_name is None else {"preset": preset_name, **data}
    config = resolve(spec)
    check_rules(config)  # rules from outside it names: registered (--plugins, installed), options they take
    return config, ", ".join(source)


def _preset_name(config: Any) -> str:
    """ "= preset NAME" for a config equal to a preset, else "a custom config"."""
    from rollcorr.config.presets import PRESETS, preset

    same = sorted(name for name in PRESETS if preset(name) == config)
    return f"= preset {same[0]}" if same else "a custom config"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    if not console.is_terminal:  # piped or captured: rich would fall back to 80 columns
        console = Console(width=110)
    err = Console(stderr=True, soft_wrap=True)  # an error is one line, never wrapped at 80 columns
    if args.list_presets:
        from rollcorr.config.presets import PRESETS

        for name in sorted(PRESETS):
            console.print(name)
        return 0
    from rollcorr.analyze.analysis import analyze_reader
    from rollcorr.analyze.render import render, write_json
    from rollcorr.dumps import open_dump

    path = args.file if args.file is not None else sample_dump_path()
    try:
        if args.top < 0:
            raise ValueError(f"--top must be >= 0, got {args.top}")
        if args.json_out is not None and args.json_out.is_dir():
            raise ValueError(
                f"--json {args.json_out}: is a directory; give a file name, e.g. {args.json_out / 'analysis.json'}"
            )
        if args.config is not None or args.preset is not None or args.dialect is not None:
            load_config(
                args.preset, args.config, args.overrides, args.dialect
            )  # bad options fail before reading
        reader = open_dump(
            path,
            rollout_field=args.rollout_field,
            learner_field=args.learner_field,
            mask_field=args.mask_field,
            advantages_field=args.advantages_field,
        )
        own = args.preset is None and args.config is None  # the config may come from the dump itself
        recorded = reader.first_correction() if own else None
        config, source = load_config(args.preset, args.config, args.overrides, args.dialect, recorded)
        analysis = analyze_reader(reader, config, source, top=max(args.top, 1))
        info = analysis.dump
        if own and info.corrections_seen > 1:
            raise ValueError(
                f"{path}: the rows record {info.corrections_seen} different corrections; name one with --preset "
                "or --config"
            )
        if own and recorded is None and info.correction is not None:  # recorded only by rows further on
            if not Path(path).is_file():
                raise ValueError(f"{path}: only rows after the first ones record a correction; name it with "
                                 "--preset or --config (a stream cannot be read twice)")
            config, source = load_config(None, None, args.overrides, args.dialect, info.correction)
            reader = open_dump(path, rollout_field=args.rollout_field, learner_field=args.learner_field,
                               mask_field=args.mask_field, advantages_field=args.advantages_field)
            analysis = analyze_reader(reader, config, source, top=max(args.top, 1))
    except (ValueError, FileNotFoundError, ImportError) as error:
        err.print(f"[bold red]rollcorr analyze:[/] {escape(str(error))}", highlight=False)
        return 2
    render(analysis, console, top=args.top, all_metrics=args.all_metrics)
    if args.json_out is not None:
        try:
            write_json(analysis, args.json_out)
        except OSError as error:
            err.print(f"[bold red]rollcorr analyze:[/] --json {escape(str(args.json_out))}: cannot write "
                      f"({escape(error.strerror or str(error))})", highlight=False)
            return 2
        console.print(f"wrote {args.json_out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollcorr analyze", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
