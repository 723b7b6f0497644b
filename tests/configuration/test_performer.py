"""PerformerConfig's own fields (configuration/performer.py): feature_eps, the learned map's feature
count, the hybrid window, its sinks and learned scales, and conversion's defaults."""

import pytest
from huggingface_hub.errors import StrictDataclassFieldValidationError

from linearformers import PerformerConfig
from tests.configuration.test_common import _refused
from tests.conftest import tiny_config


@pytest.mark.parametrize("value", [None, 1, 64])
def test_config_accepts_none_and_positive_windows(value):
    assert PerformerConfig(hybrid_window=value).hybrid_window == value


@pytest.mark.parametrize(("value", "cause"), [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)])
def test_config_refuses_other_windows(value, cause):
    with pytest.raises(StrictDataclassFieldValidationError, match="field 'hybrid_window'") as raised:
        PerformerConfig(hybrid_window=value)
    assert isinstance(raised.value.__cause__, cause)


@pytest.mark.parametrize("value", [0, 1, 64])
def test_config_accepts_sinks_with_a_window(value):
    assert PerformerConfig(hybrid_window=8, hybrid_sinks=value).hybrid_sinks == value


@pytest.mark.parametrize(("value", "cause"), [(-1, ValueError), (1.5, TypeError), (True, TypeError), (None, TypeError)])
def test_config_refuses_other_sinks(value, cause):
    with pytest.raises(StrictDataclassFieldValidationError, match="field 'hybrid_sinks'") as raised:
        PerformerConfig(hybrid_window=8, hybrid_sinks=value)
    assert isinstance(raised.value.__cause__, cause)


def test_sinks_without_a_window_are_refused():
    with pytest.raises(ValueError, match="hybrid_sinks=2 needs a hybrid_window"):
        PerformerConfig(hybrid_sinks=2)


def test_a_query_scale_without_a_window_is_refused():
    with pytest.raises(ValueError, match="hybrid_query_scale=True needs a hybrid_window"):
        PerformerConfig(hybrid_query_scale=True)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_config_refuses_a_query_scale_that_is_not_a_bool(value):
    with pytest.raises(StrictDataclassFieldValidationError, match="field 'hybrid_query_scale'"):
        PerformerConfig(hybrid_window=8, hybrid_query_scale=value)


def test_a_key_scale_without_a_window_is_refused():
    with pytest.raises(ValueError, match="hybrid_key_scale=True needs a hybrid_window"):
        PerformerConfig(hybrid_key_scale=True)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_config_refuses_a_key_scale_that_is_not_a_bool(value):
    with pytest.raises(StrictDataclassFieldValidationError, match="field 'hybrid_key_scale'"):
        PerformerConfig(hybrid_window=8, hybrid_key_scale=value)


def test_config_checks_the_feature_count_and_ignores_redraws():
    with pytest.raises(ValueError, match="num_features"):
        tiny_config("performer", feature_map="hedgehog", num_features=33)
    cfg = PerformerConfig(feature_map="hedgehog")  # the default feature_redraw_interval (1000) is accepted and ignored
    assert cfg.feature_redraw_interval == 1000 and not cfg.draws_random_features
    assert PerformerConfig().draws_random_features


def test_feature_eps_nan_or_inf_raises_naming_feature_eps():
    for bad in (float("nan"), float("inf")):
        _refused(PerformerConfig, {"feature_eps": bad}, ValueError)


def test_a_converted_performer_keeps_the_users_fields_none_included():
    fields = {"feature_redraw_interval": None, "num_features": 64}
    assert PerformerConfig.conversion_defaults(fields, 128) == fields
