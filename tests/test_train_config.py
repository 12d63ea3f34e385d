"""rollcorr train: configuration loading, overrides and validation (no model is loaded here)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from rollcorr.config.presets import preset
from rollcorr.train.build import build_step_config, check_components
from rollcorr.train.config import ConfigError, TrainConfig, config_from_dict, load_config, save_config
from rollcorr.train.loop import missing_log_probs_error, publishes


def test_default_config_loads_and_resolves_algorithm_defaults():
    c = load_config()
    assert c.trainer.mode == "sync"
    assert c.algorithm.name == "grpo"
    assert c.algorithm.resolved("clip_high") == 0.2
    dapo = load_config(None, ["algorithm.name=dapo"])
    assert dapo.algorithm.resolved("clip_high") == 0.28
    assert dapo.algorithm.resolved("aggregation") == "token-mean"
    assert dapo.algorithm.resolved("dynamic_sampling") is True
    # an explicit value beats the algorithm's default
    assert (
        load_config(None, ["algorithm.name=dapo", "algorithm.clip_high=0.3"]).algorithm.resolved("clip_high")
        == 0.3
    )


def test_default_yaml_and_dataclass_defaults_cannot_disagree():
    """One default per key: the shipped default.yaml (the documented default run) and TrainConfig()."""
    shipped, dataclass = load_config(None).to_dict(), TrainConfig().to_dict()
    for section, values in shipped.items():
        if not isinstance(values, dict):  # a top-level key (plugins)
            assert dataclass[section] == values, f"{section}: {values!r} in default.yaml"
            continue
        for key, value in values.items():
            assert dataclass[section][key] == value, f"{section}.{key}: {value!r} in default.yaml"
    assert shipped == dataclass
    assert shipped["trainer"]["steps"] == 600 and shipped["optim"]["skip_zero_grad"] is True


def test_overrides_parse_yaml_values_and_nested_dicts():
    c = load_config(None, ["trainer.max_staleness=2", "rollout.temperature=0.7", "trainer.progress=false", "optim.lr=1e-3",
                           "algorithm.correction.preset=decoupled_seq_is_rs", "algorithm.correction.is_upper=3"])
    assert c.trainer.max_staleness == 2 and isinstance(c.trainer.max_staleness, int)
    assert c.rollout.temperature == 0.7 and c.optim.lr == 1e-3
    assert c.trainer.progress is False
    assert c.algorithm.correction == dataclasses.replace(preset("decoupled_seq_is_rs"), is_upper=3.0)  # resolved at load
    algo, _, _ = check_components(c)
    assert algo.correction.is_upper == 3.0 and algo.correction.is_level == "sequence"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["trainer.bogus=1"], "trainer.bogus"),
        (["bogus.x=1"], "bogus"),
        (["trainer.max_staleness=-1"], "trainer.max_staleness"),
        (["trainer.mode=fast"], "trainer.mode"),
        (["algorithm.name=ppo2"], "algorithm.name"),
        (["rollout.top_p=abc"], "rollout.top_p"),
        (["rollout.group_size=1"], "rollout.group_size"),
        (["trainer.steps=0"], "trainer.steps"),
        (["trainer.mini_batches=3"], "trainer.mini_batches"),
        (["trainer.mode=simulated_async", "trainer.lag=5", "trainer.max_staleness=2"], "trainer.lag"),
        (["trainer.partial_rollouts=true"], "trainer.partial_rollouts"),
        (
            ["algorithm.name=oapl", "algorithm.oapl_sync_every=8", "trainer.max_staleness=4"],
            "algorithm.oapl_sync_every",
        ),
        (["trainer.steps.x=1"], "trainer.steps"),
        (["noequals"], "noequals"),
        (["optim.schedule=linear"], "optim.schedule"),
        (["trainer.executor=spark"], "trainer.executor"),
        (
            ["trainer.executor=ray", "trainer.mode=simulated_async", "trainer.partial_rollouts=true"],
            "trainer.partial_rollouts",
        ),
        (["optim.lr=fast"], "optim.lr"),
    ],
)
def test_invalid_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(key), str(err.value)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["algorithm.correction.preset=no_such_preset"], "algorithm.correction.preset"),
        (["algorithm.correction.is_uper=3"], "algorithm.correction.is_uper"),
        (["algorithm.correction.is_upper=-1"], "algorithm.correction"),
        (["algorithm.proximal.name=telepathy"], "algorithm.proximal.name"),
        (["algorithm.proximal.bogus_option=1"], "algorithm.proximal"),
        (["model.sampler=tpu:fp8"], "model.sampler"),
        (["task.name=subtraction"], "task.name"),
        (["algorithm.loss=nope"], "algorithm.loss"),
        (["trainer.executor=ray", "algorithm.proximal.name=old_logit_model"], "algorithm.proximal.name"),
    ],
)
def test_component_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        check_components(load_config(None, overrides))
    assert str(err.value).startswith(key), str(err.value)


def test_rollout_without_log_probs_names_the_key():
    config = load_config(None, ["algorithm.proximal.name=bypass"])
    _, proximal, _ = check_components(config)
    err = missing_log_probs_error(proximal, config)
    assert re.match(r"^algorithm\.proximal\.name: 'bypass' needs rollout log-probs", str(err)), str(err)
    config = load_config()
    _, proximal, _ = check_components(config)
    assert str(missing_log_probs_error(proximal, config)).startswith("model.sampler"), config.model.sampler


def test_saved_config_round_trips(tmp_path):
    c = load_config(None, ["algorithm.name=cispo", "trainer.mode=async", "trainer.max_staleness=3"])
    save_config(c, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == c
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["algorithm"]["name"] == "cispo"
    assert config_from_dict(c.to_dict()) == c
    assert isinstance(again, TrainConfig)


def test_oapl_publishes_every_n_versions():
    c = load_config(None, ["algorithm.name=oapl", "algorithm.oapl_sync_every=3", "trainer.max_staleness=2"])
    assert [v for v in range(10) if publishes(build_step_config(c), v)] == [0, 3, 6, 9]
    assert all(publishes(build_step_config(load_config()), v) for v in range(5))


def test_every_algorithm_builds():
    for name in ("grpo", "dapo", "drgrpo", "rloo", "cispo", "gspo", "oapl"):
        algo, _, _ = check_components(load_config(None, [f"algorithm.name={name}"]))
        assert algo.loss.name in ("ppo_clip", "cispo", "gspo", "oapl")


def test_default_yaml_and_dataclass_defaults_agree_key_by_key():
    """configs/default.yaml and the dataclass defaults cannot drift apart: same keys, same values."""
    import dataclasses

    from rollcorr.train.config import DEFAULT_CONFIG

    yaml_data = yaml.safe_load(DEFAULT_CONFIG.read_text())
    defaults = dataclasses.asdict(TrainConfig())

    def walk(a, b, prefix):
        assert sorted(a) == sorted(b), f"{prefix or 'config'}: yaml keys {sorted(a)} vs dataclass {sorted(b)}"
        for key in a:
            dotted = f"{prefix}.{key}" if prefix else key
            if dotted in ("algorithm.correction", "algorithm.proximal"):
                continue  # typed sections, written as a preset / strategy name: compared resolved, below
            if isinstance(b[key], dict) and key in ("algorithm", "model", "task", "rollout", "optim", "trainer"):
                walk(a[key], b[key], dotted)
            else:
                same = a[key] == b[key] and type(a[key]) is type(b[key])
                assert same, f"{dotted}: yaml {a[key]!r} vs dataclass {b[key]!r}"

    walk(yaml_data, defaults, "")
    assert load_config() == TrainConfig()


def test_loss_names_and_aggregations_have_one_home():
    """The trainer's validation reads the loss catalogue (rollcorr.losses.LOSSES) and the aggregation names
    from rollcorr.config.loss."""
    import rollcorr.losses as losses
    from rollcorr.config import loss as home
    from rollcorr.train import config as train_config

    assert losses.AGG_MODES is home.AGG_MODES and train_config.AGG_MODES is home.AGG_MODES
    assert train_config.LossConfig is losses.LossConfig and train_config.LOSS_CATALOGUE is losses.LOSSES
    assert set(train_config.accepted_losses()) | set(train_config.REFUSED_LOSSES) == set(losses.LOSS_NAMES)
    assert set(train_config.REFUSED_LOSSES) == {n for n, s in losses.LOSSES.items() if s.builds_own_weights}
    for name, table in train_config.ALGORITHMS.items():
        assert table["loss"] in train_config.accepted_losses() and table["aggregation"] in home.AGG_MODES, name


def test_another_loss_brings_its_own_clip_and_aggregation():
    """algorithm.loss=gspo under grpo takes GSPO's own ε and aggregation, not GRPO's (set explicitly: kept)."""
    from rollcorr.losses import loss_spec

    gspo = loss_spec("gspo")
    algo = build_step_config(load_config(None, ["algorithm.loss=gspo"]))
    own = (gspo.clip_low, gspo.clip_high, gspo.agg)
    assert (algo.loss.eps_low, algo.loss.eps_high, algo.loss.agg_mode) == own
    assert (gspo.clip_low, gspo.clip_high, gspo.agg) == (3e-4, 4e-4, "seq-mean-token-mean")
    algo = build_step_config(load_config(None, ["algorithm.name=gspo"]))
    assert algo.loss.agg_mode == "seq-mean-token-mean"
    algo = build_step_config(load_config(None, ["algorithm.loss=gspo", "algorithm.aggregation=token-mean"]))
    assert algo.loss.agg_mode == "token-mean"
    assert build_step_config(load_config()).loss.agg_mode == "token-mean"  # GRPO: verl's token-mean


def test_the_rank_count_is_read_in_one_place(monkeypatch):
    """``learner_processes``: torchrun's world size in a process it started (``trainer.ranks`` left at 1), else
    ``trainer.ranks``; the config's checks read it, so torchrun's two ranks refuse LoRA as trainer.ranks=2 does."""
    from rollcorr.train.config import learner_processes

    lora = ["model.lora.r=8"]
    with pytest.raises(ConfigError, match="^model.lora: LoRA trains in one process"):
        load_config(None, [*lora, "trainer.ranks=2"])
    assert learner_processes(load_config(None, lora)) == 1
    for key, value in {"RANK": "0", "WORLD_SIZE": "2"}.items():  # left in a shell: not a launcher's
        monkeypatch.setenv(key, value)
    assert learner_processes(load_config(None, lora)) == 1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # in a process torchrun started
    with pytest.raises(ConfigError, match="^model.lora: LoRA trains in one process"):
        load_config(None, lora)
    assert learner_processes(load_config(None)) == 2
