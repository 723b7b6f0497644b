import re

import pytest
from transformers import AutoModel

from linearformers import LinformerConfig, PerformerConfig


@pytest.mark.parametrize(
    "cls,kwargs,message",
    [
        (PerformerConfig, dict(hidden_size=65, num_attention_heads=4), "not divisible by num_attention_heads"),
        (LinformerConfig, dict(hidden_size=100, num_attention_heads=3), "not divisible by num_attention_heads"),
        (PerformerConfig, dict(num_random_features=-3), "num_random_features must be positive"),
        (PerformerConfig, dict(num_random_features=0), "num_random_features must be positive"),
        (PerformerConfig, dict(kernel="cosine"), "unknown Performer kernel 'cosine'"),
        (PerformerConfig, dict(causal_chunk_size=0), "causal_chunk_size must be positive"),
        (PerformerConfig, dict(feature_redraw_interval=-1), "feature_redraw_interval"),
        (PerformerConfig, dict(num_hidden_layers=0), "num_hidden_layers must be a positive"),
        (PerformerConfig, dict(hidden_size=-8), "hidden_size must be a positive"),
        (PerformerConfig, dict(vocab_size=0), "vocab_size must be a positive"),
        (PerformerConfig, dict(intermediate_size=0), "intermediate_size must be a positive"),
        (PerformerConfig, dict(hidden_act="swishy"), "unknown hidden_act"),
        (PerformerConfig, dict(hidden_dropout_prob=1.5), "hidden_dropout_prob must be in"),
        (PerformerConfig, dict(position_embedding_type="alibi"), "unknown position_embedding_type"),
        (PerformerConfig, dict(num_local_heads=13), "num_local_heads=13"),
        (PerformerConfig, dict(num_local_heads=2, local_window=1024), "local_window=1024 is larger than"),
        (LinformerConfig, dict(num_local_heads=2, local_window=1024), "local_window=1024 is larger than"),
        (LinformerConfig, dict(projected_length=1024), "k=1024 is larger than max_seq_length=512"),
        (LinformerConfig, dict(projected_length=0), "must be positive"),
        (LinformerConfig, dict(max_seq_length=-1), "must be positive"),
        (LinformerConfig, dict(sharing="everything"), "unknown Linformer sharing mode 'everything'"),
        (LinformerConfig, dict(projection="fft"), "unknown Linformer projection 'fft'"),
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
        (PerformerConfig, dict(rope_theta=0.0), "rope_theta must be a finite number > 0"),
        (PerformerConfig, dict(rope_theta=-1.0), "rope_theta must be a finite number > 0"),
        (PerformerConfig, dict(layer_norm_eps=float("nan")), "layer_norm_eps must be a finite number > 0"),
        (LinformerConfig, dict(initializer_range=float("nan")), "initializer_range must be a finite number >= 0"),
        (PerformerConfig, dict(hidden_dropout_prob=float("nan")), "hidden_dropout_prob must be in"),
        (PerformerConfig, dict(classifier_dropout=1.0), "classifier_dropout must be in"),
    ],
)
def test_bad_config_values_raise_a_value_error_naming_them(cls, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(**kwargs)


def test_configs_round_trip_through_json(tmp_path):
    cfg = LinformerConfig(projected_length=64, sharing="key_value", projected_length_per_layer=None)
    cfg.save_pretrained(tmp_path)
    again = LinformerConfig.from_pretrained(tmp_path)
    assert (again.projected_length, again.sharing, again.max_seq_length) == (64, "key_value", 512)
    pc = PerformerConfig(num_random_features=64, kernel="relu", feature_seed=7)
    pc.save_pretrained(tmp_path / "p")
    again = PerformerConfig.from_pretrained(tmp_path / "p")
    assert (again.num_random_features, again.kernel, again.feature_seed) == (64, "relu", 7)


def test_max_seq_length_defaults_to_max_position_embeddings():
    assert LinformerConfig(max_position_embeddings=1024).max_seq_length == 1024


@pytest.mark.parametrize(
    "cls,kwargs,message",
    [
        (PerformerConfig, dict(hidden_size=16.0), "PerformerConfig.hidden_size must be int, got float 16.0"),
        (PerformerConfig, dict(vocab_size="50"), "vocab_size must be int, got str '50'"),
        (PerformerConfig, dict(is_decoder="yes"), "is_decoder must be bool, got str 'yes'"),
        (PerformerConfig, dict(num_random_features=True), "num_random_features must be int, got bool"),
        (PerformerConfig, dict(feature_redraw_interval=2.5), "feature_redraw_interval must be int | None"),
        (PerformerConfig, dict(kernel=3), "kernel must be str, got int 3"),
        (LinformerConfig, dict(sharing=None), "sharing must be str, got NoneType None"),
        (
            LinformerConfig,
            dict(num_hidden_layers=2, projected_length_per_layer=[4, 4.0]),
            "projected_length_per_layer must be list[int] | None",
        ),
    ],
)
def test_values_of_the_wrong_type_raise_a_type_error_naming_the_field(cls, kwargs, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        cls(**kwargs)


def test_assignment_after_construction_is_type_checked_and_models_recheck_values():
    cfg = PerformerConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64)
    with pytest.raises(TypeError, match=re.escape("PerformerConfig.hidden_size must be int, got float 16.0")):
        cfg.hidden_size = 16.0
    assert cfg.hidden_size == 32, "a refused assignment leaves the field as it was"
    with pytest.raises(TypeError, match="LinformerConfig.projection must be str"):
        LinformerConfig().projection = 3
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
    import typing

    from linearformers.configuration.common import _field_hints

    def has_float(hint):
        return hint is float or float in typing.get_args(hint)

    return [name for name, hint in _field_hints(cls).items() if has_float(hint)]


@pytest.mark.parametrize("cls", [LinformerConfig, PerformerConfig])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_every_float_field_refuses_nan_and_infinity_naming_the_field(cls, bad):
    names = _float_fields(cls)
    assert "layer_norm_eps" in names and (cls is LinformerConfig or "kernel_eps" in names)
    for name in names:
        with pytest.raises(ValueError, match=rf"\b{name}\b") as raised:
            cls(**{name: bad})
        assert re.search(r"finite|\[0, 1\)", str(raised.value)), str(raised.value)


def test_kernel_eps_nan_or_inf_raises_naming_kernel_eps():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kernel_eps must be a finite number"):
            PerformerConfig(kernel_eps=bad)


@pytest.mark.parametrize(
    "per_layer,message",
    [
        ([], "projected_length_per_layer has 0 entries for num_hidden_layers=2"),
        ([64], "projected_length_per_layer has 1 entries for num_hidden_layers=2"),
        ([64, 0], "projected length k must be positive, got 0"),
        ([64, -8], "projected length k must be positive, got -8"),
    ],
)
def test_projected_length_per_layer_needs_one_positive_k_per_layer(per_layer, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LinformerConfig(num_hidden_layers=2, projected_length_per_layer=per_layer)


def test_an_empty_projected_length_per_layer_is_refused_for_a_single_layer_too():
    with pytest.raises(ValueError, match=re.escape("has 0 entries for num_hidden_layers=1")):
        LinformerConfig(num_hidden_layers=1, projected_length_per_layer=[])


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
