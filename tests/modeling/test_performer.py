"""The Performer models (modeling/performer.py): the random features (saved, drawn from the seed, redrawn in
training only), the learned Hedgehog map (feature_map="hedgehog"), and the hybrid (hybrid_window): sliding-window
softmax beside the linear attention in the same heads (LoLCATs)."""

import itertools
import math

import pytest
import torch
import torch._dynamo
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers import AutoModel, AutoModelForCausalLM

import linearformers as lf
from linearformers import LinearAttentionCache
from linearformers.ops import favor_positive, relu_features
from linearformers.ops.feature_maps import HedgehogFeatureMap, favor_exponents
from linearformers.ops.reference import hybrid_reference, local_reference, softmax_reference
from tests.conftest import tiny_config


def _left_padded(n=11, pad=3, batch=2, seed=1):
    ids = torch.randint(1, 99, (batch, n), generator=torch.Generator().manual_seed(seed))
    ids[1, :pad] = 0
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


# the random features and their redraws


def test_performer_features_are_saved_with_the_checkpoint(tmp_path):
    model = lf.PerformerModel(tiny_config("performer")).eval()
    model.redraw_features(5)  # differs from the draw a fresh model would make
    features = model.layers[0].attention.random_features.clone()
    model.save_pretrained(tmp_path)
    again = lf.PerformerModel.from_pretrained(tmp_path)
    torch.testing.assert_close(again.layers[0].attention.random_features, features, rtol=0, atol=0)
    assert not torch.equal(lf.PerformerModel(tiny_config("performer")).layers[0].attention.random_features, features)


def test_features_are_deterministic_from_the_seed_and_differ_per_layer():
    a = lf.PerformerModel(tiny_config("performer", feature_seed=3))
    b = lf.PerformerModel(tiny_config("performer", feature_seed=3))
    c = lf.PerformerModel(tiny_config("performer", feature_seed=4))
    fa = [layer.attention.random_features for layer in a.layers]
    assert torch.equal(fa[0], b.layers[0].attention.random_features)
    assert not torch.equal(fa[0], fa[1])
    assert not torch.equal(fa[0], c.layers[0].attention.random_features)


def test_redraws_follow_the_interval_in_training_only():
    model = lf.PerformerModel(tiny_config("performer", feature_redraw_interval=2))
    ids = torch.randint(1, 99, (1, 8))
    first = model.layers[0].attention.random_features.clone()
    model.eval()
    for _ in range(3):
        model(ids)
    assert torch.equal(model.layers[0].attention.random_features, first)
    model.train()
    model(ids)
    model(ids)
    assert torch.equal(model.layers[0].attention.random_features, first)
    model(ids)  # third training forward: draw 1
    drawn = model.layers[0].attention.random_features
    assert not torch.equal(drawn, first)
    torch.testing.assert_close(drawn, model.layers[0].attention.draw_features(1), rtol=0, atol=0)


@pytest.mark.parametrize("auto", [AutoModel, AutoModelForCausalLM], ids=lambda a: a.__name__)
def test_only_the_performer_keeps_a_redraw_counter(auto):
    decoder = auto is AutoModelForCausalLM
    prefix = "model." if decoder else ""
    linformer = auto.from_config(tiny_config("linformer", is_decoder=decoder))
    performer = auto.from_config(tiny_config("performer", is_decoder=decoder))
    assert not [key for key in linformer.state_dict() if "feature_redraws" in key]
    assert [key for key in performer.state_dict() if "feature_redraws" in key] == [prefix + "feature_redraws"]


@pytest.mark.parametrize("position_embedding_type", ["rotary", "sinusoidal"])
def test_performer_without_learned_positions_runs_past_max_position_embeddings(position_embedding_type):
    cfg = tiny_config("performer", max_position_embeddings=16, position_embedding_type=position_embedding_type)
    model = AutoModel.from_config(cfg).eval()
    out = model(torch.randint(1, 99, (1, 100))).last_hidden_state
    assert out.shape == (1, 100, 32) and torch.isfinite(out).all()


# the learned map (feature_map="hedgehog")


def _hedgehog_encoder(**overrides):
    torch.manual_seed(0)
    return AutoModel.from_config(tiny_config("performer", feature_map="hedgehog", **overrides)).eval()


def _hedgehog_lm(**overrides):
    torch.manual_seed(0)
    cfg = tiny_config("performer", feature_map="hedgehog", is_decoder=True, max_position_embeddings=128, **overrides)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_layers_own_a_hedgehog_map_at_its_identity_init_and_no_random_features():
    model = _hedgehog_encoder(num_local_heads=1, local_window=4)
    for layer in model.layers:
        attention = layer.attention
        assert attention.random_features is None
        fmap = attention.feature_map
        assert isinstance(fmap, HedgehogFeatureMap)
        assert (fmap.num_heads, fmap.head_dim, fmap.num_features) == (3, 8, 32)
        reference = HedgehogFeatureMap(3, 8, 32)
        # m / 2 = 16 > head_dim = 8: the first 8 columns are the identity (the rest are random), bias 0
        for name in ("weight", "key_weight"):
            assert torch.equal(getattr(fmap, name)[:, :, :8], getattr(reference, name)[:, :, :8])
        assert not fmap.bias.any() and not fmap.key_bias.any()
    keys = model.state_dict().keys()
    assert not [k for k in keys if "random_features" in k]
    assert [k for k in keys if k.endswith("attention.feature_map.key_weight")]


@pytest.mark.parametrize("decoder", [False, True])
def test_forward_with_left_padding_and_gradients_reach_the_map(decoder):
    model = _hedgehog_lm() if decoder else _hedgehog_encoder()
    model.train()
    ids, mask = _left_padded(n=7)
    out = model(ids, attention_mask=mask)
    result = out.logits if decoder else out.last_hidden_state
    assert torch.isfinite(result).all()
    result.float().pow(2).mean().backward()
    for layer in (model.model if decoder else model).layers:
        fmap = layer.attention.feature_map
        for p in (fmap.weight, fmap.bias, fmap.key_weight, fmap.key_bias):
            assert p.grad is not None and p.grad.abs().sum() > 0


def test_training_forwards_never_redraw():
    model = _hedgehog_encoder(feature_redraw_interval=1)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(3):
        model(torch.randint(1, 99, (1, 5)))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k != "feature_redraws")


def test_encoder_real_tokens_do_not_see_the_padding():
    model = _hedgehog_encoder()
    ids, mask = _left_padded(n=7)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).last_hidden_state[1, 3:]
        alone = model(ids[1:, 3:]).last_hidden_state[0]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-4)


def test_cached_greedy_equals_uncached_greedy():
    model = _hedgehog_lm(initializer_range=0.2)
    ids = torch.randint(1, 99, (2, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, no_repeat_ngram_size=2)
    cached = model.generate(ids, **kwargs)
    assert cached.shape == (2, 18)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kwargs))


def test_cache_holds_two_states_and_a_prompt_in_pieces_equals_one_prefill():
    model = _hedgehog_lm()
    ids = torch.randint(1, 99, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        cache = LinearAttentionCache(model.config.num_hidden_layers)
        first = model(ids[:, :6], past_key_values=cache, use_cache=True)
        second = model(ids[:, 6:9], past_key_values=first.past_key_values, use_cache=True)
        third = model(ids[:, 9:], past_key_values=second.past_key_values, use_cache=True)
    assert len(third.past_key_values.get_state(0)) == 2
    pieces = torch.cat([first.logits, second.logits, third.logits], 1)
    torch.testing.assert_close(pieces, full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("decoder", [False, True])
def test_save_and_reload_gives_identical_outputs(decoder, tmp_path):
    model = _hedgehog_lm() if decoder else _hedgehog_encoder()
    with torch.no_grad():  # move the map away from its init, so a reload that re-initialized it would show
        for layer in (model.model if decoder else model).layers:
            layer.attention.feature_map.weight.add_(0.1 * torch.randn_like(layer.attention.feature_map.weight))
    ids, mask = _left_padded(n=7)
    model.save_pretrained(tmp_path)
    cls = AutoModelForCausalLM if decoder else AutoModel
    reloaded = cls.from_pretrained(tmp_path).eval()
    assert reloaded.config.feature_map == "hedgehog"
    with torch.no_grad():
        a, b = model(ids, attention_mask=mask), reloaded(ids, attention_mask=mask)
    key = "logits" if decoder else "last_hidden_state"
    assert torch.equal(a[key], b[key])


@pytest.mark.parametrize("decoder", [False, True])
def test_a_learned_map_forward_under_bf16_autocast_is_finite(decoder):
    model = _hedgehog_lm() if decoder else _hedgehog_encoder()
    ids, mask = _left_padded(n=7)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, attention_mask=mask)
    result = out.logits if decoder else out.last_hidden_state
    assert torch.isfinite(result.float()).all()


def test_a_learned_map_export_loads_with_remote_code_where_the_package_is_missing(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from tests.hub_cards.test_export import assert_causal_lm_loads_as_remote_code

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = tiny_config(
        "performer",
        feature_map="hedgehog",
        vocab_size=tokenizer.vocab_size,
        is_decoder=True,
        num_local_heads=1,
        local_window=4,
        max_position_embeddings=128,
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # away from the init: a remote load that re-initialized the map would show
        for layer in model.model.layers:
            layer.attention.feature_map.key_weight.add_(0.1 * torch.randn_like(layer.attention.feature_map.key_weight))
    assert_causal_lm_loads_as_remote_code(model, tokenizer, tmp_path)


def test_model_card_describes_the_learned_map(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from linearformers.hub_cards import save_for_hub

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModel.from_config(tiny_config("performer", feature_map="hedgehog", vocab_size=tokenizer.vocab_size))
    folder = save_for_hub(model, tokenizer, tmp_path / "export", repo_id="me/tiny")
    card = (folder / "README.md").read_text()
    assert "Hedgehog" in card and "m=32" in card and "random features" not in card


# the hybrid (hybrid_window)

TWO_MAPS = ("softmax", "hedgehog")  # the random map, which takes the softmax's scale, and a learned one
ALL_FEATURE_MAPS = ("softmax", "relu", "hedgehog")
WINDOW = 3


# the learned scales of the hybrid's linear part, by test id: none, the query's, the keys', both
SCALES = {
    "": {},
    "query": {"hybrid_query_scale": True},
    "key": {"hybrid_key_scale": True},
    "both": {"hybrid_query_scale": True, "hybrid_key_scale": True},
}
BOTH = SCALES["both"]


def _config(feature_map, decoder, **overrides):
    overrides.setdefault("hybrid_window", WINDOW)
    if decoder:
        overrides.setdefault("max_position_embeddings", 128)
    return tiny_config("performer", feature_map=feature_map, is_decoder=decoder, **overrides)


def _model(feature_map="softmax", decoder=False, **overrides):
    torch.manual_seed(0)
    cls = AutoModelForCausalLM if decoder else AutoModel
    return cls.from_config(_config(feature_map, decoder, **overrides)).eval()


def _layers(model):
    return model.model.layers if hasattr(model, "model") else model.layers


def _move_balance(model):
    """Window balances (and query and key scales, where the model has them) away from their init and different per
    head, so that a reload that re-initialized them, or a wiring that ignored them, would show."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in _layers(model):
            attention = layer.attention
            scales = (attention.query_scale_weight, attention.query_scale_bias)
            scales += (attention.key_scale_weight, attention.key_scale_bias)
            for param in (attention.window_balance, *scales):
                if param is not None:
                    param.copy_(torch.randn(param.shape, generator=g))


def _output(model, *args, **kwargs):
    out = model(*args, **kwargs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def test_layers_own_a_window_balance_at_zero_only_with_a_hybrid_window():
    model = _model(num_local_heads=1, local_window=4)
    for layer in model.layers:
        balance = layer.attention.window_balance
        assert isinstance(balance, torch.nn.Parameter) and balance.shape == (3,)  # the global heads
        assert not balance.any()  # gamma = 1
    keys = model.state_dict().keys()
    assert [k for k in keys if k.endswith("attention.window_balance")]
    plain = AutoModel.from_config(tiny_config("performer"))
    assert all(layer.attention.window_balance is None for layer in plain.layers)
    assert not [k for k in plain.state_dict() if "window_balance" in k]  # old checkpoints are unchanged
    assert "hybrid_window=3" in repr(model.layers[0].attention)


def _reference_features(attention, q, k):
    """The linear part's features, computed here from the feature-map functions (not through the layer), and the
    queries' log scale: the random map's own plus, with hybrid_query_scale, q_t·a_h + b_h; with hybrid_key_scale the
    keys' features times exp(20 tanh((k_s·a'_h + b'_h) / 20))."""
    phi_q, phi_k, log_scale = _reference_map_features(attention, q, k)
    if attention.config.hybrid_key_scale:
        raw = (k * attention.key_scale_weight[None, :, None, :]).sum(-1) + attention.key_scale_bias[:, None]
        phi_k = phi_k * torch.exp(20.0 * torch.tanh(raw / 20.0))[..., None]
    return phi_q, phi_k, log_scale


def _reference_map_features(attention, q, k):
    projection, config = attention.random_features, attention.config
    learned = None
    if config.hybrid_query_scale:
        learned = (q * attention.query_scale_weight[None, :, None, :]).sum(-1) + attention.query_scale_bias[:, None]
    if config.feature_map == "hedgehog":
        return attention.feature_map(q, is_query=True), attention.feature_map(k, is_query=False), learned
    if config.feature_map == "relu":
        eps = config.feature_eps
        return relu_features(q, projection, eps=eps), relu_features(k, projection, eps=eps), learned
    log_scale = favor_exponents(q, projection, is_query=True).amax(-1) - math.log(projection.shape[0])
    log_scale = log_scale if learned is None else log_scale + learned
    return favor_positive(q, projection, is_query=True), favor_positive(k, projection, is_query=False), log_scale


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("sinks", [0, 2], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("feature_map", ALL_FEATURE_MAPS)
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "causal"])
def test_global_heads_equal_the_hybrid_reference(feature_map, decoder, sinks, scale):
    model = _model(feature_map, decoder, hybrid_sinks=sinks, **SCALES[scale])
    _move_balance(model)
    attention = _layers(model)[0].attention
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :2] = False
    with torch.no_grad():
        out = attention.global_attention(q, k, v, mask, None, None)
        phi_q, phi_k, log_scale = _reference_features(attention, q, k)
        gamma = attention.window_balance.exp()
        want = hybrid_reference(
            *(t.double() for t in (q, k, v, phi_q, phi_k, gamma)), WINDOW, causal=decoder, key_padding_mask=mask,
            query_log_scale=None if log_scale is None else log_scale.double(), sinks=sinks,
        )  # fmt: skip
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


def _projected(attention, x):
    return [attention._split(p(x)) for p in (attention.q_proj, attention.k_proj, attention.v_proj)]


@pytest.mark.parametrize("feature_map", TWO_MAPS)
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "causal"])
def test_a_window_covering_the_sequence_is_exact_softmax_attention(feature_map, decoder):
    n = 9
    model = _model(feature_map, decoder, hybrid_window=n, initializer_range=0.2)
    _move_balance(model)  # gamma cancels when the linear part is empty
    attention = _layers(model)[0].attention
    x = torch.randn(2, n, 32, generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        got = attention(x, mask)
        q, k, v = _projected(attention, x)
        heads = softmax_reference(q, k, v, causal=decoder, key_padding_mask=mask)
        want = attention.o_proj(heads.transpose(1, 2).reshape(2, n, 32))
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-6)  # rows of padding: no real key


@pytest.mark.parametrize("feature_map", TWO_MAPS)
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "causal"])
def test_a_large_balance_leaves_the_softmax_on_the_window(feature_map, decoder):
    """gamma = e^30: the linear part vanishes next to the window's, which is local softmax attention over the
    last w keys (causal) or |s - t| < w (bidirectional: local_reference's window 2w - 1)."""
    model = _model(feature_map, decoder, initializer_range=0.2)
    attention = _layers(model)[0].attention
    with torch.no_grad():
        attention.window_balance.fill_(30.0)
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(2, 4, 10, 8, generator=g) for _ in range(3))
        got = attention.global_attention(q, k, v, None, None, None)
        band = WINDOW if decoder else 2 * WINDOW - 1
        local = local_reference(q, k, v, band, causal=decoder)
        attention.window_balance.fill_(0.0)
        balanced = attention.global_attention(q, k, v, None, None, None)
    torch.testing.assert_close(got, local, rtol=1e-4, atol=1e-5)
    assert (balanced - local).abs().max() > 1e-2  # at gamma = 1 the linear part counts


@pytest.mark.parametrize("feature_map", TWO_MAPS)
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "causal"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize(
    ("sinks", "scale"), [(0, ""), (2, ""), (2, "query"), (2, "both")], ids=["", "sinks", "sinks-query", "sinks-both"]
)
def test_padding_does_not_change_the_real_tokens_outputs(feature_map, decoder, side, sinks, scale):
    model = _model(feature_map, decoder, initializer_range=0.2, hybrid_sinks=sinks, **SCALES[scale])
    _move_balance(model)
    n, pad = 8, 4
    ids = torch.randint(1, 99, (1, n), generator=torch.Generator().manual_seed(2))
    junk = torch.randint(1, 99, (1, pad), generator=torch.Generator().manual_seed(3))  # padding of real ids
    real, fake = torch.ones(1, n, dtype=torch.long), torch.zeros(1, pad, dtype=torch.long)
    padded = torch.cat([junk, ids] if side == "left" else [ids, junk], 1)
    mask = torch.cat([fake, real] if side == "left" else [real, fake], 1)
    with torch.no_grad():
        alone = _output(model, ids)
        both = _output(model, padded, attention_mask=mask)
    torch.testing.assert_close(both[:, pad:] if side == "left" else both[:, :n], alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("sinks", "scale"), [(0, ""), (2, ""), (2, "query"), (2, "both")], ids=["", "sinks", "sinks-query", "sinks-both"]
)
@pytest.mark.parametrize("feature_map", TWO_MAPS)
def test_causal_outputs_never_read_the_future(feature_map, sinks, scale):
    model = _model(feature_map, True, initializer_range=0.2, hybrid_sinks=sinks, **SCALES[scale])
    _move_balance(model)
    ids = torch.randint(1, 99, (2, 12), generator=torch.Generator().manual_seed(4))
    changed = ids.clone()
    changed[:, 7:] = torch.randint(1, 99, (2, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = _output(model, ids, use_cache=False), _output(model, changed, use_cache=False)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize(
    ("feature_map", "window", "sinks", "scale"),
    [
        *((k, w, 0, "") for k in ALL_FEATURE_MAPS for w in (1, WINDOW)),
        ("softmax", 1, 2, ""),
        ("hedgehog", WINDOW, 4, ""),
        ("softmax", WINDOW, 1, "query"),
        ("hedgehog", WINDOW, 1, "query"),
        ("softmax", WINDOW, 1, "both"),
        ("hedgehog", 1, 0, "key"),
        ("hedgehog", WINDOW, 1, "both"),
    ],
)
def test_a_prompt_in_pieces_then_steps_with_the_cache_equals_a_full_forward(feature_map, window, sinks, scale):
    """A left-padded batch fed as 2 tokens (fewer than the window), 3 more (a continued prefill), then one at a
    time (decoding steps): the same logits as one uncached forward. With sinks, row 1's padding puts its sinks
    across the pieces and steps."""
    model = _model(feature_map, True, hybrid_window=window, initializer_range=0.2, hybrid_sinks=sinks, **SCALES[scale])
    _move_balance(model)
    ids, mask = _left_padded()
    cuts = [0, 2, 5, *range(6, ids.shape[1] + 1)]
    cache = LinearAttentionCache(model.config.num_hidden_layers)
    pieces = []
    with torch.no_grad():
        full = _output(model, ids, attention_mask=mask, use_cache=False)
        for start, end in itertools.pairwise(cuts):
            out = model(ids[:, start:end], attention_mask=mask[:, :end], past_key_values=cache, use_cache=True)
            pieces.append(out.logits)
    state = cache.get_state(0)
    assert len(state) == 10 and state[6].shape[2] == sinks and bool(state[8].all())
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], full[real], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("sinks", "scale"), [(0, ""), (1, ""), (1, "query"), (1, "both")], ids=["", "sinks", "sinks-query", "sinks-both"]
)
@pytest.mark.parametrize("feature_map", TWO_MAPS)
def test_cached_greedy_generation_equals_uncached(feature_map, sinks, scale):
    model = _model(feature_map, True, initializer_range=0.2, hybrid_sinks=sinks, **SCALES[scale])
    _move_balance(model)
    ids, mask = _left_padded(n=6, pad=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, **kwargs)
    assert cached.shape == (2, 16)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kwargs))


def test_the_cache_does_not_grow_with_the_context():
    model = _model("softmax", True, hybrid_sinks=2)
    ids = torch.randint(1, 99, (2, 60), generator=torch.Generator().manual_seed(6))

    def state_after(n):
        cache = LinearAttentionCache(model.config.num_hidden_layers)
        with torch.no_grad():
            model(ids[:, : n - 3], past_key_values=cache, use_cache=True)
            for t in range(n - 3, n):
                model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == n
        return cache.get_state(0)

    short, long = state_after(20), state_after(60)
    assert len(short) == 10 and [t.shape for t in short] == [t.shape for t in long]
    assert long[2].shape[2] == WINDOW - 1  # the kept keys: the window's, not the context's
    assert long[6].shape[2] == 2  # and the sinks'
    assert torch.equal(long[9], torch.full_like(long[9], 60) - torch.arange(2))  # sinks at positions 0, 1


@pytest.mark.parametrize("feature_map", TWO_MAPS)
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "causal"])
def test_save_and_reload_keeps_the_balance_and_the_outputs(feature_map, decoder, tmp_path):
    model = _model(feature_map, decoder, hybrid_sinks=1, **BOTH)
    _move_balance(model)
    ids, mask = _left_padded()
    model.save_pretrained(tmp_path)
    reloaded = (AutoModelForCausalLM if decoder else AutoModel).from_pretrained(tmp_path).eval()
    assert reloaded.config.hybrid_window == WINDOW and reloaded.config.hybrid_sinks == 1
    assert reloaded.config.hybrid_query_scale is True and reloaded.config.hybrid_key_scale is True
    for mine, theirs in zip(_layers(model), _layers(reloaded)):
        for name in ("window_balance", "query_scale_weight", "query_scale_bias", "key_scale_weight", "key_scale_bias"):
            assert torch.equal(getattr(mine.attention, name), getattr(theirs.attention, name))
    with torch.no_grad():
        assert torch.equal(_output(model, ids, attention_mask=mask), _output(reloaded, ids, attention_mask=mask))


def test_a_plain_checkpoint_loads_into_a_hybrid_with_the_balance_at_its_init(tmp_path):
    plain = _model("softmax", hybrid_window=None)
    plain.save_pretrained(tmp_path)
    hybrid = AutoModel.from_pretrained(tmp_path, hybrid_window=WINDOW)
    assert hybrid.config.hybrid_window == WINDOW
    for mine, theirs in zip(plain.layers, hybrid.layers):
        assert torch.equal(mine.attention.q_proj.weight, theirs.attention.q_proj.weight)
        assert torch.equal(mine.attention.random_features, theirs.attention.random_features)
        assert not theirs.attention.window_balance.any()


@pytest.mark.parametrize("feature_map", TWO_MAPS)
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "causal"])
def test_gradients_reach_the_balance_the_scales_and_the_feature_map(feature_map, decoder):
    model = _model(feature_map, decoder, initializer_range=0.2, **BOTH).train()
    _move_balance(model)  # the key scale's weight gets no gradient while the key scale's input is all zero
    ids, mask = _left_padded()
    _output(model, ids, attention_mask=mask).float().pow(2).mean().backward()
    for layer in _layers(model):
        attention = layer.attention
        params = [attention.window_balance, attention.q_proj.weight, attention.k_proj.weight]
        params += [attention.query_scale_weight, attention.query_scale_bias]
        params += [attention.key_scale_weight, attention.key_scale_bias]
        if attention.feature_map is not None:
            params += list(attention.feature_map.parameters())
        for p in params:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


@pytest.mark.parametrize("feature_map", TWO_MAPS)
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "causal"])
def test_bf16_autocast_forward_is_finite(feature_map, decoder):
    model = _model(feature_map, decoder, hybrid_sinks=1, **BOTH)
    _move_balance(model)
    ids, mask = _left_padded()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = _output(model, ids, attention_mask=mask)
        if decoder:  # and a cached step after a prefill
            cache = LinearAttentionCache(model.config.num_hidden_layers)
            model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            step = torch.ones(2, 1, dtype=mask.dtype)
            out = model(ids[:, :1], attention_mask=torch.cat([mask, step], 1), past_key_values=cache).logits
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("feature_map", TWO_MAPS)
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "causal"])
def test_compiled_model_has_no_graph_breaks_and_equals_eager(feature_map, decoder):
    """fullgraph=True: a graph break (the op's host-syncing gamma check, say) would raise. Training mode, so the
    backward is traced too (the learned map's own autograd function included). aot_eager keeps the test quick;
    inductor compiles the same graph."""
    eager = _model(feature_map, decoder, hybrid_sinks=1, **BOTH).train()  # the sinks' path too
    _move_balance(eager)
    compiled_model = _model(feature_map, decoder, hybrid_sinks=1, **BOTH).train()
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    ids, mask = _left_padded()
    torch._dynamo.reset()
    kwargs = dict(attention_mask=mask, use_cache=False) if decoder else dict(attention_mask=mask)
    want, got = _output(eager, ids, **kwargs), _output(compiled, ids, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want.pow(2).mean().backward()
    got.pow(2).mean().backward()
    for mine, theirs in zip(_layers(compiled_model), _layers(eager)):
        for name in ("window_balance", "key_scale_weight"):
            torch.testing.assert_close(getattr(mine.attention, name).grad, getattr(theirs.attention, name).grad)
        if feature_map == "hedgehog":
            for a, b in zip(mine.attention.feature_map.parameters(), theirs.attention.feature_map.parameters()):
                assert b.grad is not None
                torch.testing.assert_close(a.grad, b.grad)


def test_the_query_scale_exists_only_when_asked_for_and_starts_at_zero():
    scaled, plain = _model(hybrid_query_scale=True), _model()
    for layer in scaled.layers:
        attention = layer.attention
        assert attention.query_scale_weight.shape == (4, 8) and attention.query_scale_bias.shape == (4,)
        assert not attention.query_scale_weight.any() and not attention.query_scale_bias.any()
    assert "hybrid_query_scale=True" in repr(scaled.layers[0].attention)
    assert not [k for k in plain.state_dict() if "query_scale" in k]  # checkpoints without it are unchanged


def test_the_query_scale_moves_the_linear_part_against_the_window():
    """l_t = b raises every linear score by e^b against the window's: the output moves, and a very negative b
    leaves the window's softmax alone (the same as a very large balance)."""
    model = _model("hedgehog", hybrid_query_scale=True)
    attention = model.layers[0].attention
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 10, 8, generator=g) for _ in range(3))
    with torch.no_grad():
        zero = attention.global_attention(q, k, v, None, None, None)
        attention.query_scale_bias.fill_(2.0)
        raised = attention.global_attention(q, k, v, None, None, None)
        attention.query_scale_bias.fill_(-60.0)
        window_only = attention.global_attention(q, k, v, None, None, None)
    assert (raised - zero).abs().max() > 1e-2
    torch.testing.assert_close(
        window_only, local_reference(q, k, v, 2 * WINDOW - 1, causal=False), rtol=1e-4, atol=1e-5
    )


def test_the_key_scale_exists_only_when_asked_for_and_starts_at_zero():
    keyed, plain = _model("hedgehog", hybrid_key_scale=True), _model("hedgehog")
    for layer in keyed.layers:
        attention = layer.attention
        assert attention.key_scale_weight.shape == (4, 8) and attention.key_scale_bias.shape == (4,)
        assert not attention.key_scale_weight.any() and not attention.key_scale_bias.any()
        assert attention.query_scale_weight is None  # the two are independent
    assert "hybrid_key_scale=True" in repr(keyed.layers[0].attention)
    assert not [k for k in plain.state_dict() if "key_scale" in k]  # checkpoints without it are unchanged
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():  # at zero it is the identity: the same outputs as without it
        assert torch.equal(keyed.layers[0].attention(x), plain.layers[0].attention(x))


def test_the_key_scale_weighs_keys_within_the_bound():
    """r_s = 20 tanh((k_s·a + b) / 20): a key with a larger r takes a larger share of every query's linear part;
    r stays inside (-20, 20) however large k_s·a + b grows, so the outputs stay finite."""
    model = _model("hedgehog", hybrid_key_scale=True)
    attention = model.layers[0].attention
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 4, 12, 8, generator=g) for _ in range(3))
    with torch.no_grad():
        attention.key_scale_weight.zero_()
        attention.key_scale_bias.fill_(1e6)
        assert torch.allclose(attention.key_log_scale(k), torch.full((1, 4, 12), 20.0))
        attention.key_scale_bias.zero_()
        attention.key_scale_weight[:, 0] = 3.0  # keys with a large first coordinate weigh more
        r = attention.key_log_scale(k)
        torch.testing.assert_close(r, 20.0 * torch.tanh(3.0 * k[..., 0] / 20.0))
        out = attention.global_attention(q, k, v, None, None, None)
        attention.key_scale_weight[:, 0] = 1e4
        huge = attention.global_attention(q, k, v, None, None, None)
        _, phi_k, _ = attention.hybrid_features(q, k, None)
    assert torch.isfinite(huge).all() and phi_k.max() <= math.exp(20.0) * 1.001  # hedgehog features are at most 1
    assert (out - huge).abs().max() > 1e-3


def test_hub_export_loads_with_remote_code_where_the_package_is_missing(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from tests.hub_cards.test_export import assert_causal_lm_loads_as_remote_code

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = _config(
        "softmax", True, vocab_size=tokenizer.vocab_size, num_local_heads=1, local_window=4, initializer_range=0.2,
        hybrid_sinks=1, **BOTH,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg).eval()
    _move_balance(model)  # a remote load that re-initialized the balance, or ignored the window, would show
    assert_causal_lm_loads_as_remote_code(model, tokenizer, tmp_path)


@pytest.mark.parametrize("feature_map", TWO_MAPS)
def test_model_card_names_the_window(feature_map, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from linearformers.hub_cards import save_for_hub

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModel.from_config(_config(feature_map, False, vocab_size=tokenizer.vocab_size))
    card = (save_for_hub(model, tokenizer, tmp_path / "export", repo_id="me/tiny") / "README.md").read_text()
    assert f"window of {WINDOW} tokens" in card and "LoLCATs" in card and "sinks" not in card
    sinks = AutoModel.from_config(_config(feature_map, False, vocab_size=tokenizer.vocab_size, hybrid_sinks=1))
    card = (save_for_hub(sinks, tokenizer, tmp_path / "sinks", repo_id="me/tiny") / "README.md").read_text()
    assert "first 1 real token(s) of each sequence are attention sinks" in card and "log scale" not in card
    scaled = AutoModel.from_config(
        _config(feature_map, False, vocab_size=tokenizer.vocab_size, hybrid_query_scale=True)
    )
    card = (save_for_hub(scaled, tokenizer, tmp_path / "scaled", repo_id="me/tiny") / "README.md").read_text()
    assert "learned log scale per query (hybrid_query_scale)" in card and "hybrid_key_scale" not in card
    keyed = AutoModel.from_config(_config(feature_map, False, vocab_size=tokenizer.vocab_size, hybrid_key_scale=True))
    card = (save_for_hub(keyed, tokenizer, tmp_path / "keyed", repo_id="me/tiny") / "README.md").read_text()
    assert "learned log scale (hybrid_key_scale)" in card
    plain = AutoModel.from_config(tiny_config("performer", feature_map=feature_map, vocab_size=tokenizer.vocab_size))
    card = (save_for_hub(plain, tokenizer, tmp_path / "plain", repo_id="me/tiny") / "README.md").read_text()
    assert "LoLCATs" not in card


@pytest.mark.parametrize("feature_map", TWO_MAPS)
def test_beam_search_with_the_cache_equals_beam_search_without(feature_map):
    # beams reorder every state of the cache, the sinks' validity (bool) and distance (int64) among them
    model = _model(feature_map, True, initializer_range=0.2, hybrid_sinks=2)
    _move_balance(model)
    ids, mask = _left_padded(n=6, pad=2)
    kwargs = dict(
        attention_mask=mask, num_beams=3, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    cached = model.generate(ids, **kwargs)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("feature_map", ALL_FEATURE_MAPS)
def test_the_linear_parts_features_and_scales_ignore_bf16_autocast(feature_map):
    """Under bf16 autocast (a model trained with it) the features, the queries' log scale and the keys' scale are
    the float32 ones: a bf16 product anywhere in them would carry bf16's rounding into every score of the linear
    part and into dq / dk."""
    model = _model(feature_map, decoder=False, **BOTH)
    _move_balance(model)
    attention = _layers(model)[0].attention
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 4, 37, 8, generator=g) * 2 for _ in range(2))
    plain = attention.hybrid_features(q, k, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = attention.hybrid_features(q, k, None)
    for name, a, b in zip(("phi_q", "phi_k", "log_scale"), plain, under):
        assert b.dtype == torch.float32, name
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=name)


SELECT = {"hybrid_select_blocks": 2, "hybrid_select_block_size": 2}


@pytest.mark.parametrize("feature_map", TWO_MAPS)
def test_encoder_heads_with_far_blocks_equal_the_hybrid_reference(feature_map):
    """hybrid_select_blocks: the heads pass the choice to the op (the learned map then leaves the native walk,
    which gives no normalizer to add the chosen keys to) and equal the reference with it."""
    model = _model(feature_map, hybrid_sinks=1, **BOTH, **SELECT).double()  # float64: the wiring, not rounding
    _move_balance(model)
    attention = _layers(model)[0].attention
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 20, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, -3:] = False
    with torch.no_grad():
        out = attention.global_attention(q, k, v, mask, None, None)
        phi_q, phi_k, log_scale = _reference_features(attention, q, k)
        gamma = attention.window_balance.exp()
        args = [t.double() for t in (q, k, v, phi_q, phi_k, gamma)]
        kw = dict(causal=False, key_padding_mask=mask, query_log_scale=log_scale.double(), sinks=1)
        want = hybrid_reference(*args, WINDOW, select_blocks=2, select_block_size=2, **kw)
        plain = hybrid_reference(*args, WINDOW, **kw)
    real = mask[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], want[real], rtol=1e-5, atol=1e-6)  # the features are made in float32
    assert (want - plain)[real].abs().max() > 1e-3  # the choice counts


@pytest.mark.parametrize("feature_map", TWO_MAPS)
def test_far_blocks_keep_padding_invariance_and_survive_a_reload(feature_map, tmp_path):
    model = _model(feature_map, initializer_range=0.2, hybrid_sinks=1, **BOTH, **SELECT)
    _move_balance(model)
    n, pad = 20, 5
    ids = torch.randint(1, 99, (1, n), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([ids, torch.randint(1, 99, (1, pad), generator=torch.Generator().manual_seed(3))], 1)
    mask = torch.cat([torch.ones(1, n, dtype=torch.long), torch.zeros(1, pad, dtype=torch.long)], 1)
    model.save_pretrained(tmp_path)
    reloaded = AutoModel.from_pretrained(tmp_path).eval()
    assert reloaded.config.hybrid_select_blocks == 2 and reloaded.config.hybrid_select_block_size == 2
    with torch.no_grad():
        alone = _output(model, ids)
        torch.testing.assert_close(_output(model, padded, attention_mask=mask)[:, :n], alone, rtol=1e-4, atol=1e-5)
        assert torch.equal(_output(reloaded, ids), alone)
        without = AutoModel.from_pretrained(tmp_path, hybrid_select_blocks=0).eval()
        assert not torch.allclose(_output(without, ids), alone, atol=1e-4)


@pytest.mark.parametrize("feature_map", TWO_MAPS)
def test_short_sequences_read_exactly_each_by_its_own_length(feature_map, tmp_path):
    """hybrid_exact_length L: a row of at most L real tokens is read by exact softmax over its keys (the hybrid with
    a window covering it); a longer row by the hybrid. Each row by its own mask: a short row padded into a batch
    with a long one, right or left, reads as it does alone."""
    model = _model(feature_map, initializer_range=0.2, hybrid_sinks=1, hybrid_exact_length=12, **BOTH)
    _move_balance(model)
    wide = AutoModel.from_config(_config(feature_map, False, hybrid_window=64, hybrid_sinks=1, **BOTH)).eval()
    wide.load_state_dict(model.state_dict())
    plain = AutoModel.from_config(_config(feature_map, False, hybrid_sinks=1, **BOTH)).eval()
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(1, 99, (3, 30), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 30, dtype=torch.long)
    mask[0, 12:] = 0  # 12 real tokens, right-padded
    mask[1, :20] = 0  # 10, left-padded
    with torch.no_grad():
        batched = _output(model, ids, attention_mask=mask)
        torch.testing.assert_close(batched[0, :12], _output(wide, ids[:1, :12])[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(batched[1, 20:], _output(wide, ids[1:2, 20:])[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(batched[2], _output(plain, ids[2:])[0], rtol=1e-4, atol=1e-5)
        for row, real in ((0, slice(0, 12)), (1, slice(20, 30))):
            alone = _output(model, ids[row : row + 1, real])[0]
            torch.testing.assert_close(batched[row, real], alone, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(_output(plain, ids[:1, :12]), _output(model, ids[:1, :12]), atol=1e-4)
        assert torch.equal(_output(model, ids[2:]), _output(plain, ids[2:]))  # 30 > 12 tokens: the hybrid
    model.save_pretrained(tmp_path)
    assert AutoModel.from_pretrained(tmp_path).config.hybrid_exact_length == 12
    hybrid = AutoModel.from_pretrained(tmp_path, hybrid_exact_length=None).eval()
    with torch.no_grad():
        torch.testing.assert_close(_output(hybrid, ids[:1, :12]), _output(plain, ids[:1, :12]))


def test_exact_rows_train_with_the_hybrid_rows_of_their_batch():
    """Gradients reach the weights through the exact rows and the hybrid rows of one batch."""
    model = _model("hedgehog", initializer_range=0.2, hybrid_sinks=1, hybrid_exact_length=12, **BOTH).train()
    ids = torch.randint(1, 99, (2, 30), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[0, 10:] = 0
    _output(model, ids, attention_mask=mask).square().mean().backward()
    attention = _layers(model)[0].attention
    assert attention.q_proj.weight.grad.abs().sum() > 0
    assert attention.feature_map.weight.grad.abs().sum() > 0  # the long row's linear part


def test_exact_reading_is_refused_without_a_window_or_in_a_decoder():
    with pytest.raises(ValueError, match=r"hybrid_exact_length=8 needs a hybrid_window"):
        _config("softmax", False, hybrid_window=None, hybrid_exact_length=8)
    with pytest.raises(ValueError, match=r"hybrid_exact_length is for encoders"):
        _config("softmax", True, hybrid_exact_length=8)
    with pytest.raises(StrictDataclassFieldValidationError, match="field 'hybrid_exact_length'"):
        _config("softmax", False, hybrid_exact_length=0)
    _, details, _ = _config("hedgehog", False, hybrid_exact_length=512).describe()
    assert "at most 512 real tokens takes exact softmax attention" in details
