"""LinformerConfig's own fields (configuration/linformer.py): the projected length per layer, the
sequence limit, the hybrid window and its sinks (for encoders only), and conversion's defaults."""

import re

import pytest
from huggingface_hub.errors import StrictDataclassFieldValidationError

from linearformers import LinformerConfig


@pytest.mark.parametrize("value", [None, 1, 64])
def test_config_accepts_none_and_positive_windows(value):
    assert LinformerConfig(hybrid_window=value).hybrid_window == value


@pytest.mark.parametrize(("field", "value"), [("hybrid_window", 0), ("hybrid_window", 2.5), ("hybrid_sinks", -1)])
def test_config_refuses_bad_values(field, value):
    with pytest.raises(StrictDataclassFieldValidationError, match=f"field '{field}'"):
        LinformerConfig(**{"hybrid_window": 8, field: value})


def test_config_refuses_sinks_without_a_window_and_a_window_in_a_decoder():
    with pytest.raises(ValueError, match="hybrid_sinks=1 needs a hybrid_window"):
        LinformerConfig(hybrid_sinks=1)
    with pytest.raises(ValueError, match="hybrid_window is for Linformer encoders.*PerformerConfig"):
        LinformerConfig(hybrid_window=8, is_decoder=True)


def test_max_seq_length_defaults_to_max_position_embeddings():
    assert LinformerConfig(max_position_embeddings=1024).max_seq_length == 1024


@pytest.mark.parametrize(
    "per_layer,message",
    [
        ([], "projected_length_per_layer has 0 entries for num_hidden_layers=2"),
        ([64], "projected_length_per_layer has 1 entries for num_hidden_layers=2"),
    ],
)
def test_projected_length_per_layer_needs_one_k_per_layer(per_layer, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LinformerConfig(num_hidden_layers=2, projected_length_per_layer=per_layer)


@pytest.mark.parametrize("bad", [0, -8])
def test_projected_length_per_layer_needs_positive_ks(bad):
    with pytest.raises(StrictDataclassFieldValidationError, match=f"projected length k must be positive, got {bad}"):
        LinformerConfig(num_hidden_layers=2, projected_length_per_layer=[64, bad])


def test_an_empty_projected_length_per_layer_is_refused_for_a_single_layer_too():
    with pytest.raises(ValueError, match=re.escape("has 0 entries for num_hidden_layers=1")):
        LinformerConfig(num_hidden_layers=1, projected_length_per_layer=[])


def test_a_converted_linformer_starts_at_k_equal_n_unless_told_otherwise():
    assert LinformerConfig.conversion_defaults({}, 128) == {"max_seq_length": 128, "projected_length": 128}
    given = LinformerConfig.conversion_defaults({"max_seq_length": None, "projected_length": 32}, 128)
    assert given == {"max_seq_length": 128, "projected_length": 32}
    assert LinformerConfig.conversion_defaults({"max_seq_length": 64}, 128)["projected_length"] == 64
