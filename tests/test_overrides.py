"""One reading of a `key=value` override: `rollcorr train` and `rollcorr analyze --set` give the same value, and
YAML 1.1's surprising number forms (underscores, base 60) are not numbers anywhere."""

import pytest

from rollcorr.analyze.cli import load_config as analyze_config
from rollcorr.analyze.cli import parse_value
from rollcorr.config.yaml_io import load_yaml
from rollcorr.train.config import load_config


@pytest.mark.parametrize("window, want", [("1.5_3", (1.5, 3.0)), ("0.5_2", (0.5, 2.0))])
def test_a_threshold_window_reads_the_same_in_train_and_analyze(window, want):
    """`rs_thresholds=1.5_3` was the window [0.6536, 1.53] in train (YAML read 1.53) and [1.5, 3.0] in analyze;
    `0.5_2` was refused by train as "got 0.52"."""
    train = load_config(None, ["algorithm.correction.rs=seq_mean_k1", f"algorithm.correction.rs_thresholds={window}"])
    analyze, _ = analyze_config(overrides=["rs=seq_mean_k1", f"rs_thresholds={window}"])
    assert tuple(train.algorithm.correction.rs_thresholds[0]) == want
    assert tuple(analyze.rs_thresholds[0]) == want


def test_numbers_are_plain_numbers():
    assert load_yaml("1_000") == "1_000" and load_yaml("1:30") == "1:30"  # YAML 1.1: 1000 and 90
    assert load_yaml("3") == 3 and load_yaml("0.25") == 0.25 and load_yaml("-1.0e-5") == -1e-5
    assert parse_value("None") is None and parse_value("[1, 2]") == [1, 2] and parse_value("2.5") == 2.5
    assert parse_value("seq_mean_k1") == "seq_mean_k1"


def test_inf_is_a_number_everywhere_and_an_upper_bound_of_none():
    """`is_upper=inf` was refused as "a string" while `optim.lr=inf` parsed: YAML 1.1 reads only `.inf`."""
    assert load_yaml("inf") == float("inf") and load_yaml("-inf") == float("-inf") and load_yaml(".inf") == float("inf")
    assert load_yaml("info") == "info" and load_yaml("Infinity") == "Infinity"  # words stay words
    train = load_config(None, ["algorithm.correction.is_level=token", "algorithm.correction.is_upper=inf"])
    analyze, _ = analyze_config(overrides=["is_level=token", "is_upper=inf"])
    assert train.algorithm.correction.is_upper is None and analyze.is_upper is None  # no upper bound
    with pytest.raises(ValueError, match="is_upper must be finite, got -inf"):
        analyze_config(overrides=["is_level=token", "is_upper=-inf"])
    with pytest.raises(ValueError, match="optim.lr: must be a finite number > 0, got inf"):
        load_config(None, ["optim.lr=inf"])
