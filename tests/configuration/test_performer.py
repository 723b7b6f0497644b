"""PerformerConfig's own fields (configuration/performer.py): feature_eps, the learned map's feature
count, the hybrid window, its sinks and learned scales, conversion's defaults, and the old names of renamed fields."""

import json

import pytest
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import AutoConfig, AutoModel

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


OLD_NAMES = {"kernel": "feature_map", "num_random_features": "num_features", "kernel_eps": "feature_eps"}
NEW_VALUES = {"feature_map": "relu", "num_features": 64, "feature_eps": 0.01}


@pytest.mark.parametrize(("old", "new"), OLD_NAMES.items())
def test_an_old_field_name_gives_the_new_field_with_a_future_warning_until_0_3_0(old, new):
    with pytest.warns(
        FutureWarning, match=rf"{old} is renamed {new}; the name {old} goes away in linearformers 0\.3\.0"
    ):
        config = PerformerConfig(**{old: NEW_VALUES[new]})
    assert config.to_dict() == PerformerConfig(**{new: NEW_VALUES[new]}).to_dict()


@pytest.mark.parametrize(("old", "new"), OLD_NAMES.items())
def test_an_old_field_name_beside_its_new_name_is_a_value_error(old, new):
    with pytest.raises(ValueError, match=rf"got both {old}=.* and {new}=.*; pass only {new}"):
        PerformerConfig(**{old: NEW_VALUES[new], new: NEW_VALUES[new]})


def test_an_old_attribute_name_reads_the_new_field_with_a_future_warning():
    config = PerformerConfig(feature_map="relu", num_features=64)
    with pytest.warns(FutureWarning, match="kernel is renamed feature_map"):
        assert config.kernel == "relu"
    with pytest.warns(FutureWarning, match="random_feature_kernel is renamed draws_random_features.*0\\.3\\.0"):
        assert config.random_feature_kernel is True


def _with_old_keys(folder):
    """Rewrite folder/config.json with the old keys, as the code before the rename saved it."""
    saved = json.loads((folder / "config.json").read_text())
    for old, new in OLD_NAMES.items():
        saved[old] = saved.pop(new)
    (folder / "config.json").write_text(json.dumps(saved))


def _warned_names(caught) -> set[str]:
    """The old names that the FutureWarnings in ``caught`` name as renamed."""
    return {old for old, new in OLD_NAMES.items() for w in caught if f"{old} is renamed {new};" in str(w.message)}


def test_a_config_json_with_the_old_keys_loads_as_the_new_config_and_saves_the_new_keys(tmp_path):
    tiny_config("performer", **NEW_VALUES).save_pretrained(tmp_path / "old")
    _with_old_keys(tmp_path / "old")
    with pytest.warns(FutureWarning) as caught:
        loaded = AutoConfig.from_pretrained(tmp_path / "old")
    assert _warned_names(caught) == set(OLD_NAMES)
    assert isinstance(loaded, PerformerConfig)
    loaded_fields = {key: value for key, value in loaded.to_diff_dict().items() if key != "_name_or_path"}
    assert loaded_fields == tiny_config("performer", **NEW_VALUES).to_diff_dict()
    loaded.save_pretrained(tmp_path / "new")
    saved = json.loads((tmp_path / "new" / "config.json").read_text())
    assert not set(OLD_NAMES) & set(saved) and {saved[new] for new in NEW_VALUES} == set(NEW_VALUES.values())


def test_automodel_loads_a_folder_whose_config_json_has_the_old_keys(tmp_path):
    model = AutoModel.from_config(tiny_config("performer", **NEW_VALUES))
    model.save_pretrained(tmp_path)
    _with_old_keys(tmp_path)
    with pytest.warns(FutureWarning) as caught:
        loaded = AutoModel.from_pretrained(tmp_path)
    assert _warned_names(caught) == set(OLD_NAMES)
    assert (loaded.config.feature_map, loaded.config.num_features, loaded.config.feature_eps) == ("relu", 64, 0.01)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(hybrid_select_blocks=2), "hybrid_select_blocks=2 needs a hybrid_window"),
        (dict(hybrid_window=8, hybrid_select_blocks=2, is_decoder=True), "for encoders"),
        (dict(hybrid_window=8, hybrid_select_blocks=2, feature_map="hedgehog"), "softmax's scale"),
        (dict(hybrid_window=8, hybrid_select_blocks=2, feature_map="relu"), "softmax's scale"),
    ],
)
def test_far_block_selection_is_refused_where_it_cannot_work(overrides, match):
    with pytest.raises(ValueError, match=match):
        PerformerConfig(**overrides)


def test_far_block_selection_takes_the_random_map_or_a_query_scale():
    assert PerformerConfig(hybrid_window=8, hybrid_select_blocks=4).hybrid_select_block_size == 32
    cfg = PerformerConfig(
        hybrid_window=8, hybrid_select_blocks=4, hybrid_select_block_size=16, feature_map="hedgehog",
        hybrid_query_scale=True,
    )  # fmt: skip
    assert "scores the 4 blocks of far keys" in cfg.describe()[1]


@pytest.mark.parametrize(("field", "value"), [("hybrid_select_blocks", -1), ("hybrid_select_block_size", 0)])
def test_config_refuses_selection_sizes_out_of_range(field, value):
    with pytest.raises(StrictDataclassFieldValidationError, match=f"field '{field}'"):
        PerformerConfig(hybrid_window=8, **{field: value})
