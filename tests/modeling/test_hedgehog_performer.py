"""PerformerConfig(kernel="hedgehog"): the learned Hedgehog feature map in the Performer models."""

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from linearformers import LinearAttentionCache, PerformerConfig
from linearformers.ops.feature_maps import HedgehogFeatureMap
from tests.conftest import tiny_config


def _encoder(**overrides):
    torch.manual_seed(0)
    return AutoModel.from_config(tiny_config("performer", kernel="hedgehog", **overrides)).eval()


def _lm(**overrides):
    torch.manual_seed(0)
    cfg = tiny_config("performer", kernel="hedgehog", is_decoder=True, max_position_embeddings=128, **overrides)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _left_padded(n=7, pad=3):
    ids = torch.randint(1, 99, (2, n), generator=torch.Generator().manual_seed(1))
    ids[1, :pad] = 0
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


def test_layers_own_a_hedgehog_map_at_its_identity_init_and_no_random_features():
    model = _encoder(num_local_heads=1, local_window=4)
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
    model = _lm() if decoder else _encoder()
    model.train()
    ids, mask = _left_padded()
    out = model(ids, attention_mask=mask)
    result = out.logits if decoder else out.last_hidden_state
    assert torch.isfinite(result).all()
    result.float().pow(2).mean().backward()
    for layer in (model.model if decoder else model).layers:
        fmap = layer.attention.feature_map
        for p in (fmap.weight, fmap.bias, fmap.key_weight, fmap.key_bias):
            assert p.grad is not None and p.grad.abs().sum() > 0


def test_training_forwards_never_redraw():
    model = _encoder(feature_redraw_interval=1)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(3):
        model(torch.randint(1, 99, (1, 5)))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k != "feature_redraws")


def test_encoder_real_tokens_do_not_see_the_padding():
    model = _encoder()
    ids, mask = _left_padded()
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).last_hidden_state[1, 3:]
        alone = model(ids[1:, 3:]).last_hidden_state[0]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-4)


def test_cached_greedy_equals_uncached_greedy():
    model = _lm(initializer_range=0.2)
    ids = torch.randint(1, 99, (2, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, no_repeat_ngram_size=2)
    cached = model.generate(ids, **kwargs)
    assert cached.shape == (2, 18)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kwargs))


def test_cache_holds_two_states_and_a_prompt_in_pieces_equals_one_prefill():
    model = _lm()
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
    model = _lm() if decoder else _encoder()
    with torch.no_grad():  # move the map away from its init, so a reload that re-initialized it would show
        for layer in (model.model if decoder else model).layers:
            layer.attention.feature_map.weight.add_(0.1 * torch.randn_like(layer.attention.feature_map.weight))
    ids, mask = _left_padded()
    model.save_pretrained(tmp_path)
    cls = AutoModelForCausalLM if decoder else AutoModel
    reloaded = cls.from_pretrained(tmp_path).eval()
    assert reloaded.config.kernel == "hedgehog"
    with torch.no_grad():
        a, b = model(ids, attention_mask=mask), reloaded(ids, attention_mask=mask)
    key = "logits" if decoder else "last_hidden_state"
    assert torch.equal(a[key], b[key])


@pytest.mark.parametrize("decoder", [False, True])
def test_bf16_autocast_forward_is_finite(decoder):
    model = _lm() if decoder else _encoder()
    ids, mask = _left_padded()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, attention_mask=mask)
    result = out.logits if decoder else out.last_hidden_state
    assert torch.isfinite(result.float()).all()


def test_hub_export_loads_with_remote_code_where_the_package_is_missing(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from tests.hub_cards.test_export import assert_causal_lm_loads_as_remote_code

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = tiny_config(
        "performer",
        kernel="hedgehog",
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
    model = AutoModel.from_config(tiny_config("performer", kernel="hedgehog", vocab_size=tokenizer.vocab_size))
    folder = save_for_hub(model, tokenizer, tmp_path / "export", repo_id="me/tiny")
    card = (folder / "README.md").read_text()
    assert "Hedgehog" in card and "m=32" in card and "random features" not in card
