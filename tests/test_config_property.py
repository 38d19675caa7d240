"""Property: any TrainConfig values, YAML document or CLI argument list either validates or
raises ValueError (the CLI: exit 2, one line) before Ray is started, never another exception.

Deterministic (``derandomize=True``): 300 + 150 + 150 = 600 examples, well under a minute.
"""

from __future__ import annotations

import math

import pytest
import ray
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import raytrain_mgpu.api
from raytrain_mgpu import TrainConfig
from raytrain_mgpu.cli import main

FIELDS = TrainConfig.field_names()
SETTINGS = dict(derandomize=True, deadline=None, suppress_health_check=list(HealthCheck), database=None)

# Values YAML and the CLI can produce, plus the ones the issue lists (inf, nan, 2**70, 'false').
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.sampled_from([2**63, 2**70, -2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.inf, -math.inf, math.nan, 0.4, 1e-9]),
    st.text(max_size=8), st.sampled_from(["false", "no", "abc", "", "..", "/abs", "../x", "60", "os:system",
                                          "builtins:eval", "lenet", "mlp", "ddp", "digits", "synthetic",
                                          "sgd", "step", "1f1b", "PACK", "params", "bf16-mixed", "s3://k:s@b/x"]),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=4), SCALARS, max_size=2))


@pytest.fixture(autouse=True)
def no_ray(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("connect() was called: a value got past the checks to Ray")

    monkeypatch.setattr(raytrain_mgpu.api, "connect", refuse)
    monkeypatch.setattr(ray, "init", refuse)  # and nothing else starts Ray either
    monkeypatch.setenv("HOME", str(tmp_path))
    # In the whole suite the shared test Ray may already be up: what counts is that no example started one.
    was_up = ray.is_initialized()
    yield
    assert ray.is_initialized() == was_up


def _validates_or_value_error(values: dict) -> None:
    try:
        TrainConfig.from_dict(values)
    except ValueError:
        pass


@settings(max_examples=300, **SETTINGS)
@given(st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4))
def test_any_field_values_validate_or_raise_value_error(values):
    _validates_or_value_error(values)


@settings(max_examples=150, **SETTINGS)
@given(st.one_of(st.text(max_size=60), st.dictionaries(st.sampled_from(FIELDS + ["bogus"]), VALUES, max_size=4)
                 .map(lambda d: yaml.safe_dump(d, allow_unicode=True))))
def test_any_yaml_document_validates_or_raises_value_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("yaml") / "c.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        TrainConfig.from_yaml(path)
    except ValueError:
        pass


FLAGS = ["--" + name.replace("_", "-") for name in FIELDS] + ["--no-use-gpu", "--config", "--bogus"]
ARG_VALUES = st.one_of(st.sampled_from(["abc", "0", "-1", "1e400", "nan", "[1", "{a: 1}", "true", "'false'",
                                        "1,2", "os:system", "..", ""]),
                       st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
                               max_size=6))


@settings(max_examples=150, **SETTINGS)
@given(st.lists(st.tuples(st.sampled_from(FLAGS), ARG_VALUES), min_size=1, max_size=3))
def test_any_cli_arguments_exit_2_with_one_line_before_ray(capsys, pairs):
    argv = ["train"] + [item for pair in pairs for item in pair]
    # A trailing --epochs 0 (the last option wins) keeps every list invalid, so none trains;
    # a value that slipped through would reach connect(), whose AssertionError fails the test.
    code = main(argv + ["--epochs", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("raytrain-mgpu: error: "), err
