"""The rules every config shares (configuration/common.py), checked on both families: rules across fields, field
ranges, choices and types, JSON round trips, the family check on load and the sequence limit."""

import dataclasses
import re
import typing

import pytest
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import AutoModel

from linearformers import LinformerConfig, PerformerConfig
from linearformers.ops.feature_maps import FEATURE_MAPS
from linearformers.ops.linformer import METHODS


@pytest.mark.parametrize(
    "cls,kwargs,message",
    [
        (PerformerConfig, dict(hidden_size=65, num_attention_heads=4), "not divisible by num_attention_heads"),
        (LinformerConfig, dict(hidden_size=100, num_attention_heads=3), "not divisible by num_attention_heads"),
        (PerformerConfig, dict(num_local_heads=13), "num_local_heads=13"),
        (PerformerConfig, dict(num_local_heads=2, local_window=1024), "local_window=1024 is larger than"),
        (LinformerConfig, dict(num_local_heads=2, local_window=1024), "local_window=1024 is larger than"),
        (LinformerConfig, dict(projected_length=1024), "k=1024 is larger than max_seq_length=512"),
        (LinformerConfig, dict(projection="pool", projected_length=100), "must divide max_seq_length=512"),
        (LinformerConfig, dict(is_decoder=True, projection="pool", projected_length=64), "needs projection='learned'"),
        (LinformerConfig, dict(max_seq_length=1024), "exceeds max_position_embeddings=512"),
        (LinformerConfig, dict(projected_length_per_layer=[64, 64]), "has 2 entries for num_hidden_layers=12"),
        (
            LinformerConfig,
            dict(num_hidden_layers=2, projected_length_per_layer=[64, 32], sharing="layerwise"),
            "all k must be equal",
        ),
        (
            LinformerConfig,
            dict(num_hidden_layers=2, projected_length_per_layer=[64, 4096]),
            "k=4096 is larger than max_seq_length",
        ),
        (PerformerConfig, dict(pad_token_id=-5), "pad_token_id=-5 is not a token id"),
        (PerformerConfig, dict(vocab_size=50, pad_token_id=60), "pad_token_id=60 is not a token id"),
        (LinformerConfig, dict(vocab_size=50, eos_token_id=[3, 50]), "eos_token_id=[3, 50] is not a token id"),
        (
            PerformerConfig,
            dict(hidden_size=30, num_attention_heads=2, position_embedding_type="rotary"),
            "even head_dim",
        ),
        (PerformerConfig, dict(num_local_heads=1, local_window=1), "bidirectional local_window must be >= 2"),
    ],
)
def test_values_that_break_a_rule_across_fields_raise_a_value_error_naming_them(cls, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(**kwargs)


def _refused(cls, kwargs, cause):
    """Build cls(**kwargs), which must fail on the one field given: returns the message, which names the field and
    the value, and whose cause (the field's own check) is a ``cause``."""
    ((name, value),) = kwargs.items()
    with pytest.raises(StrictDataclassFieldValidationError) as raised:
        cls(**kwargs)
    message = str(raised.value)
    assert f"field '{name}'" in message and str(value) in message, message
    assert isinstance(raised.value.__cause__, cause), repr(raised.value.__cause__)
    return message


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (PerformerConfig, dict(num_features=-3)),
        (PerformerConfig, dict(num_features=0)),
        (PerformerConfig, dict(causal_chunk_size=0)),
        (LinformerConfig, dict(causal_chunk_size=-4)),
        (PerformerConfig, dict(feature_redraw_interval=-1)),
        (PerformerConfig, dict(num_hidden_layers=0)),
        (PerformerConfig, dict(hidden_size=-8)),
        (PerformerConfig, dict(vocab_size=0)),
        (PerformerConfig, dict(intermediate_size=0)),
        (PerformerConfig, dict(max_position_embeddings=0)),
        (PerformerConfig, dict(type_vocab_size=-1)),
        (PerformerConfig, dict(num_local_heads=-1)),
        (PerformerConfig, dict(local_window=0)),
        (PerformerConfig, dict(hidden_act="swishy")),
        (PerformerConfig, dict(hidden_dropout_prob=1.5)),
        (PerformerConfig, dict(attention_probs_dropout_prob=-0.1)),
        (LinformerConfig, dict(projected_length=0)),
        (LinformerConfig, dict(max_seq_length=-1)),
        (LinformerConfig, dict(projected_length_per_layer=[64, 0])),
        (PerformerConfig, dict(rope_theta=0.0)),
        (PerformerConfig, dict(rope_theta=-1.0)),
        (PerformerConfig, dict(layer_norm_eps=float("nan"))),
        (LinformerConfig, dict(initializer_range=float("nan"))),
        (LinformerConfig, dict(initializer_range=-0.02)),
        (PerformerConfig, dict(hidden_dropout_prob=float("nan"))),
        (PerformerConfig, dict(classifier_dropout=1.0)),
        (PerformerConfig, dict(feature_eps=-1e-3)),
        (PerformerConfig, dict(hybrid_window=0)),
        (PerformerConfig, dict(hybrid_window=-1)),
    ],
)
def test_a_value_out_of_its_field_range_is_refused_naming_the_field_and_the_value(cls, kwargs):
    _refused(cls, kwargs, ValueError)


@pytest.mark.parametrize(
    "cls,name,value,choices",
    [
        (PerformerConfig, "feature_map", "cosine", FEATURE_MAPS),
        (LinformerConfig, "projection", "fft", METHODS),
        (LinformerConfig, "sharing", "everything", ("per_head", "headwise", "key_value", "layerwise")),
        (PerformerConfig, "position_embedding_type", "alibi", ("absolute", "sinusoidal", "rotary")),
    ],
)
def test_a_value_outside_its_field_choices_is_refused_listing_the_choices(cls, name, value, choices):
    message = _refused(cls, {name: value}, TypeError)
    assert str(choices) in message, message


@pytest.mark.parametrize("cls", [LinformerConfig, PerformerConfig])
def test_every_field_we_declare_has_an_annotation_strict_checks(cls):
    """@strict skips string annotations (what `from __future__ import annotations` makes of every one); transformers'
    own PreTrainedConfig fields are out of our hands."""
    ours = [klass for klass in cls.__mro__ if klass.__module__.startswith("linearformers.")]
    hints = {name: hint for klass in ours for name, hint in vars(klass).get("__annotations__", {}).items()}
    assert "hidden_size" in hints and "causal_chunk_size" in hints
    assert not [name for name, hint in hints.items() if isinstance(hint, (str, typing.ForwardRef))]


def test_the_config_choices_are_the_attention_floor_tuples():
    fields = {f.name: f.type for f in dataclasses.fields(PerformerConfig)}
    assert typing.get_args(fields["feature_map"]) == FEATURE_MAPS
    fields = {f.name: f.type for f in dataclasses.fields(LinformerConfig)}
    assert typing.get_args(fields["projection"]) == METHODS


def test_configs_round_trip_through_json(tmp_path):
    cfg = LinformerConfig(projected_length=64, sharing="key_value", projected_length_per_layer=None)
    cfg.save_pretrained(tmp_path)
    again = LinformerConfig.from_pretrained(tmp_path)
    assert (again.projected_length, again.sharing, again.max_seq_length) == (64, "key_value", 512)
    pc = PerformerConfig(num_features=64, feature_map="relu", feature_seed=7, hybrid_window=64)
    pc.save_pretrained(tmp_path / "p")
    again = PerformerConfig.from_pretrained(tmp_path / "p")
    assert (again.num_features, again.feature_map, again.feature_seed, again.hybrid_window) == (64, "relu", 7, 64)
    assert PerformerConfig().hybrid_window is None


@pytest.mark.parametrize(
    "cls,kwargs,message",
    [
        (PerformerConfig, dict(hidden_size=16.0), "expected int, got float (value: 16.0)"),
        (PerformerConfig, dict(vocab_size="50"), "expected int, got str (value: '50')"),
        (PerformerConfig, dict(is_decoder="yes"), "expected bool, got str (value: 'yes')"),
        (PerformerConfig, dict(num_features=True), "expected int, got bool (value: True)"),
        (PerformerConfig, dict(feature_redraw_interval=2.5), "expected int, got float (value: 2.5)"),
        (PerformerConfig, dict(hybrid_window=2.5), "expected int, got float (value: 2.5)"),
        (PerformerConfig, dict(hybrid_window=True), "expected int, got bool (value: True)"),
        (PerformerConfig, dict(feature_map=3), "got 3"),
        (LinformerConfig, dict(sharing=None), "got None"),
        (
            LinformerConfig,
            dict(num_hidden_layers=2, projected_length_per_layer=[4, 4.0]),
            "with value [4, 4.0] doesn't match any type in (list[int]",
        ),
    ],
)
def test_values_of_the_wrong_type_raise_a_type_error_naming_the_field(cls, kwargs, message):
    (name,) = [key for key in kwargs if key != "num_hidden_layers"]
    with pytest.raises(StrictDataclassFieldValidationError, match=re.escape(message)) as raised:
        cls(**kwargs)
    assert f"field '{name}'" in str(raised.value)
    assert isinstance(raised.value.__cause__, TypeError)


def test_assignment_after_construction_is_checked_and_models_recheck_values():
    cfg = PerformerConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64)
    with pytest.raises(StrictDataclassFieldValidationError, match=re.escape("expected int, got float (value: 16.0)")):
        cfg.hidden_size = 16.0
    assert cfg.hidden_size == 32, "a refused assignment leaves the field as it was"
    with pytest.raises(StrictDataclassFieldValidationError, match="field 'projection'"):
        LinformerConfig().projection = 3
    with pytest.raises(StrictDataclassFieldValidationError, match="(?s)field 'feature_map'.*got bad"):
        cfg.feature_map = "bad"
    with pytest.raises(StrictDataclassFieldValidationError, match="(?s)field 'hidden_dropout_prob'.*got 1.5"):
        cfg.hidden_dropout_prob = 1.5
    assert (cfg.feature_map, cfg.hidden_dropout_prob) == ("softmax", 0.1)
    cfg.hidden_dropout_prob = 0  # an int is a float
    cfg.custom_note = "anything"  # attributes that are not fields are not checked
    cfg.num_attention_heads = 5  # a value that only fails together with hidden_size
    with pytest.raises(ValueError, match="hidden_size=32 is not divisible by num_attention_heads=5"):
        AutoModel.from_config(cfg)


def test_right_types_are_accepted_including_ints_for_floats_and_none_for_optionals():
    cfg = PerformerConfig(layer_norm_eps=1, rope_theta=500, feature_redraw_interval=None, eos_token_id=[1, 2])
    assert cfg.layer_norm_eps == 1 and cfg.eos_token_id == [1, 2]
    lin = LinformerConfig(num_hidden_layers=2, projected_length_per_layer=[4, 8], max_seq_length=None)
    assert lin.max_seq_length == lin.max_position_embeddings


def _float_fields(cls):
    return [f.name for f in dataclasses.fields(cls) if f.type is float or float in typing.get_args(f.type)]


@pytest.mark.parametrize("cls", [LinformerConfig, PerformerConfig])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_every_float_field_refuses_nan_and_infinity_naming_the_field(cls, bad):
    names = _float_fields(cls)
    assert "layer_norm_eps" in names and (cls is LinformerConfig or "feature_eps" in names)
    for name in names:
        _refused(cls, {name: bad}, ValueError)


@pytest.mark.parametrize(
    "config_cls,other_cls", [(PerformerConfig, LinformerConfig), (LinformerConfig, PerformerConfig)]
)
def test_a_config_of_the_other_family_raises_naming_both_model_types(config_cls, other_cls, tmp_path):
    other_cls().save_pretrained(tmp_path)
    message = f"model_type '{other_cls.model_type}'.*{config_cls.__name__}.*model_type '{config_cls.model_type}'"
    with pytest.raises(ValueError, match=message):
        config_cls.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        config_cls.from_dict(other_cls().to_dict())


@pytest.mark.parametrize(
    "config,limit",
    [
        (PerformerConfig(max_position_embeddings=64), (64, "max_position_embeddings")),
        (PerformerConfig(max_position_embeddings=64, position_embedding_type="rotary"), None),
        (PerformerConfig(max_position_embeddings=64, position_embedding_type="sinusoidal"), None),
        (LinformerConfig(max_position_embeddings=64, projected_length=8), (64, "max_seq_length")),
        (
            LinformerConfig(max_position_embeddings=64, max_seq_length=32, projected_length=8),
            (32, "max_seq_length"),
        ),
        (
            LinformerConfig(
                position_embedding_type="rotary", max_position_embeddings=16, max_seq_length=32, projected_length=8
            ),
            (32, "max_seq_length"),
        ),
    ],
)
def test_sequence_limit_names_the_field_that_bounds_the_input(config, limit):
    assert config.sequence_limit() == limit
    if limit is None:
        config.check_input_length(100_000, past=100_000)
        return
    value, name = limit
    config.check_input_length(value)
    config.check_input_length(1, past=value - 1)
    with pytest.raises(ValueError, match=re.escape(f"an input of {value + 1} tokens exceeds {name}={value}")):
        config.check_input_length(value + 1)
    with pytest.raises(ValueError, match=re.escape(f"{value} tokens after 1 cached ones ({value + 1} in all)")):
        config.check_input_length(value, past=1)


def test_check_input_length_refuses_negative_lengths():
    with pytest.raises(ValueError, match="length=-1"):
        PerformerConfig().check_input_length(-1)
    with pytest.raises(ValueError, match="past=-2"):
        PerformerConfig().check_input_length(3, past=-2)


def test_attention_fields_are_the_familys_own_and_the_local_heads_not_the_stacks_shape():
    performer = {f.name for f in PerformerConfig.attention_fields()}
    linformer = {f.name for f in LinformerConfig.attention_fields()}
    local = {"num_local_heads", "local_window", "local_relative_bias"}
    assert local | {"num_features", "feature_map", "hybrid_window", "hybrid_key_scale"} <= performer
    assert local | {"projected_length", "sharing", "projection", "hybrid_window"} <= linformer
    shape = {"hidden_size", "vocab_size", "num_hidden_layers", "max_position_embeddings", "is_decoder", "pad_token_id"}
    assert not (performer | linformer) & shape
    assert "num_features" not in linformer and "projected_length" not in performer
