"""The shared stack's modules (linearformers/modeling/layers.py)."""

import pytest

import linearformers as lf
from linearformers.modeling import layers
from tests.conftest import tiny_config


def test_the_blocks_old_name_still_imports_with_a_warning_that_names_its_removal():
    with pytest.warns(FutureWarning, match=r"LinearAttentionBlock.*0\.3\.0"):
        from linearformers.modeling.layers import LinearAttentionLayer
    assert LinearAttentionLayer is layers.LinearAttentionBlock


def test_a_name_the_module_lacks_still_raises_attribute_error():
    with pytest.raises(AttributeError, match="LinearAttentionBlok"):
        layers.LinearAttentionBlok  # noqa: B018


def test_new_tensors_lists_what_the_modules_declare_and_have_by_state_dict_name():
    """A Performer hybrid with a learned map and key scale: per layer the map's tensors, the balance and the key
    scale (no query scale: the module has none), the redraw counter once; nothing the checkpoint would hold."""
    model = lf.PerformerModel(
        tiny_config(
            "performer", kernel="hedgehog", hybrid_window=4, hybrid_key_scale=True, num_local_heads=1, local_window=8
        )
    )
    new = layers.new_tensors(model)
    for i in range(2):
        own = {name.removeprefix(f"layers.{i}.attention.") for name in new if name.startswith(f"layers.{i}.")}
        assert own == {
            "feature_map.weight",
            "feature_map.bias",
            "feature_map.key_weight",
            "feature_map.key_bias",
            "window_balance",
            "key_scale_weight",
            "key_scale_bias",
        }
    assert {name for name in new if not name.startswith("layers.")} == {"feature_redraws"}
    assert set(new) <= set(model.state_dict())


def test_new_tensors_names_a_shared_projection_once_under_its_owner():
    model = lf.LinformerForMaskedLM(
        tiny_config("linformer", sharing="layerwise", num_local_heads=1, local_window=8, local_relative_bias=True)
    )
    new = layers.new_tensors(model)
    assert {name for name, declared in new.items() if declared.projection} == {"model.shared_projection"}
    assert new["model.shared_projection"].start == "window_means"
    assert new["model.layers.0.attention.relative_bias"] == layers.NewTensor(start="zeros")
