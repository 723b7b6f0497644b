"""generate() on the recurrent cache: cached = recomputed, the rest of generate(), fixed-size state, errors."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from linearformers import LinearAttentionCache
from tests.conftest import FAMILIES, tiny_config


def _lm(family, **overrides):
    torch.manual_seed(0)
    cfg = tiny_config(family, is_decoder=True, max_position_embeddings=256, **overrides)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _recomputed_greedy(model, ids, steps):
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    return ids


VARIANTS = {
    "global": {},
    "local_heads": {"num_local_heads": 1, "local_window": 4, "local_relative_bias": True},
    "rotary": {"position_embedding_type": "rotary"},
    "sinusoidal_all_local": {"position_embedding_type": "sinusoidal", "num_local_heads": 4, "local_window": 3},
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_greedy_equals_recomputed_greedy_for_64_tokens(family, variant):
    model = _lm(family, initializer_range=0.2, **VARIANTS[variant])
    ids = torch.randint(1, 99, (2, 6), generator=torch.Generator().manual_seed(1))
    cached = model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert cached.shape == (2, 70)
    assert torch.equal(cached, _recomputed_greedy(model, ids, 64))
    # A random model tends to repeat one token; forbidding repeated bigrams makes every step's choice depend on
    # the whole history, and generate(use_cache=False) recomputes the full forward at each step.
    kwargs = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, no_repeat_ngram_size=2)
    varied = model.generate(ids, **kwargs)
    assert torch.equal(varied, model.generate(ids, use_cache=False, **kwargs))
    assert len(set(varied[0, 6:].tolist())) > 10


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_uses_the_chunked_kernel_and_steps_use_the_recurrent_one(family, monkeypatch):
    import linearformers.modeling.linformer as linformer
    import linearformers.modeling.performer as performer

    calls = {"prefill": 0, "step": 0}
    if family == "performer":
        module, names = performer, ("favor_attention", "favor_step")
    else:
        module, names = linformer, ("causal_linformer_attention", "causal_linformer_step")
    for kind, name in zip(("prefill", "step"), names):
        original = getattr(module, name)

        def counted(*args, _original=original, _kind=kind, **kwargs):
            calls[_kind] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    model = _lm(family)
    model.generate(torch.randint(1, 99, (1, 10)), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    layers_count = model.config.num_hidden_layers
    assert calls == {"prefill": layers_count, "step": 4 * layers_count}


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_size_does_not_grow_with_context(family):
    model = _lm(family, num_local_heads=1, local_window=4)

    def cache_bytes(length):
        cache = LinearAttentionCache(model.config.num_hidden_layers)
        with torch.no_grad():
            model(torch.randint(1, 99, (1, length)), past_key_values=cache, use_cache=True)
        total = 0
        for layer in cache.layers:
            for state in (*layer.recurrent_states.values(), *layer.conv_states.values()):
                total += 0 if state is None else state.numel() * state.element_size()
        return total, cache

    short, _ = cache_bytes(16)
    long, cache = cache_bytes(200)
    assert short == long > 0
    assert cache.get_seq_length() == 200
    local_window = cache.layers[0].conv_states[0]
    assert local_window.shape[-1] == 3  # the local head keeps only its last window - 1 tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padded_batch_generates_what_each_prompt_generates_alone(family):
    model = _lm(family, num_local_heads=1, local_window=4)
    prompts = [torch.randint(1, 99, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 4)]
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 9 - len(p) :] = p
        mask[i, 9 - len(p) :] = 1
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=20, min_new_tokens=20, do_sample=False)
        assert torch.equal(batch[i, 9:], alone[0, len(p) :])


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_is_reproducible_with_a_seed(family):
    model = _lm(family)
    ids = torch.randint(1, 99, (2, 5))
    torch.manual_seed(3)
    a = model.generate(ids, do_sample=True, top_k=20, temperature=0.9, max_new_tokens=12)
    torch.manual_seed(3)
    b = model.generate(ids, do_sample=True, top_k=20, temperature=0.9, max_new_tokens=12)
    torch.manual_seed(4)
    c = model.generate(ids, do_sample=True, top_k=20, temperature=0.9, max_new_tokens=12)
    assert torch.equal(a, b) and a.shape == (2, 17)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_with_the_cache_equals_beam_search_without(family):
    model = _lm(family, num_local_heads=1, local_window=4)
    ids = torch.randint(1, 99, (2, 5))
    kwargs = dict(
        num_beams=3,
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    cached = model.generate(ids, **kwargs)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, rtol=1e-4, atol=1e-5)
    greedy = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert cached.sequences.shape == greedy.shape


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_token_stops_generation(family):
    model = _lm(family)
    ids = torch.randint(1, 99, (1, 5))
    free = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    eos = int(free[0, 8])  # the token greedy decoding emits at its 4th step
    stopped = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)
    first = free[0, 5:].tolist().index(eos)
    assert stopped.shape[1] == 5 + first + 1
    assert int(stopped[0, -1]) == eos


@pytest.mark.parametrize("family", FAMILIES)
def test_text_generation_pipeline(family, tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = tiny_config(family, is_decoder=True, vocab_size=tokenizer.vocab_size, max_position_embeddings=128)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path))
    out = generator("def fibonacci(n):", max_new_tokens=8, do_sample=False)
    assert out[0]["generated_text"].startswith("def fibonacci(n):")
    assert len(out[0]["generated_text"]) > len("def fibonacci(n):")


def test_learned_positions_stop_with_a_clear_error_past_their_limit():
    torch.manual_seed(0)
    cfg = tiny_config("performer", is_decoder=True, max_position_embeddings=16)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        model.generate(torch.randint(1, 99, (1, 10)), max_new_tokens=20, min_new_tokens=20, do_sample=False)


def test_linformer_stops_with_a_clear_error_past_max_seq_length():
    cfg = tiny_config(
        "linformer", is_decoder=True, position_embedding_type="rotary", max_seq_length=16, projected_length=8
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(ValueError, match="max_seq_length=16"):
        model.generate(torch.randint(1, 99, (1, 10)), max_new_tokens=20, min_new_tokens=20, do_sample=False)


@pytest.mark.parametrize("position_embedding_type", ["rotary", "sinusoidal"])
def test_performer_without_learned_positions_generates_past_max_position_embeddings(position_embedding_type):
    cfg = tiny_config(
        "performer", is_decoder=True, max_position_embeddings=16, position_embedding_type=position_embedding_type
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    out = model.generate(torch.randint(1, 99, (1, 10)), max_new_tokens=30, min_new_tokens=30, do_sample=False)
    assert out.shape == (1, 40)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("max_new_tokens", [1, 2, 9])
def test_max_new_tokens_bounds_the_generated_length(family, max_new_tokens):
    model = _lm(family, num_local_heads=1, local_window=4)
    assert model.generation_config.eos_token_id is None  # nothing can stop it early
    ids = torch.randint(1, 99, (2, 5), generator=torch.Generator().manual_seed(2))
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    assert out.shape == (2, 5 + max_new_tokens)
    assert torch.equal(out, _recomputed_greedy(model, ids, max_new_tokens))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_row_that_emits_eos_is_padded_while_the_other_goes_on(family):
    model = _lm(family)
    ids = torch.randint(1, 99, (2, 5), generator=torch.Generator().manual_seed(5))
    free = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    eos = int(free[0, 6])  # row 0 emits it at its 2nd step
    assert eos != 0 and eos not in free[1, 5:].tolist()  # the seed picks rows that differ and an eos that is not pad
    out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert out.shape == (2, 13)
    first = free[0, 5:].tolist().index(eos)
    assert out[0, 5 + first] == eos and bool((out[0, 6 + first :] == 0).all())
    assert torch.equal(out[1], free[1])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("left_padded", [False, True])
def test_a_prompt_fed_in_pieces_through_the_cache_equals_one_pass(family, left_padded):
    """Chunked prefill: the cache continues with several tokens at a time (local heads too, pieces shorter and
    longer than their window), and after a left-padded first piece the rows sit at different positions."""
    model = _lm(family, num_local_heads=1, local_window=4, local_relative_bias=True)
    for module in model.modules():  # a non-zero relative bias, so distances inside the window matter
        if getattr(module, "relative_bias", None) is not None:
            torch.nn.init.normal_(module.relative_bias)
    ids = torch.randint(1, 99, (2, 23), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 23, dtype=torch.long)
    if left_padded:
        mask[0, :3] = 0
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, use_cache=False).logits
        cache = LinearAttentionCache(model.config.num_hidden_layers)
        pieces = [
            model(ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache, use_cache=True).logits
            for a, b in ((0, 7), (7, 16), (16, 17), (17, 23))
        ]
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], whole[real], rtol=1e-4, atol=1e-4)


def test_a_cached_linformer_refuses_padding_after_the_prefill():
    model = _lm("linformer")
    ids = torch.randint(1, 99, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    cache = LinearAttentionCache(model.config.num_hidden_layers)
    with torch.no_grad():
        model(ids[:, :6], attention_mask=mask[:, :6], past_key_values=cache, use_cache=True)
        mask[1, 8] = 0
        with pytest.raises(ValueError, match="padding belongs in the first"):
            model(ids[:, 6:], attention_mask=mask, past_key_values=cache, use_cache=True)


def test_keys_of_large_norm_decode_like_the_full_forward():
    """Keys whose FAVOR+ features underflow at offset 0 (a key projection scaled up): the prefill takes the
    stabilized causal path, and the cached state carries an offset M that decoding steps move, so cached decoding
    gives the logits of the full forward instead of losing those keys."""
    model = _lm("performer")
    with torch.no_grad():
        for layer in range(model.config.num_hidden_layers):
            model.get_submodule(f"model.layers.{layer}.attention.k_proj").weight.mul_(300.0)
    ids = torch.randint(1, 99, (2, 14), generator=torch.Generator().manual_seed(3))
    cache = LinearAttentionCache(model.config.num_hidden_layers)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        steps = [model(ids[:, :8], past_key_values=cache, use_cache=True).logits]
        for t in range(8, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    offsets = torch.stack([cache.get_state(i)[2] for i in range(model.config.num_hidden_layers)])
    assert (offsets < -30).any(), "the keys must be large enough to need an offset"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cache_goes_by_either_name_and_comes_back_in_the_installed_field(family):
    # transformers 5.24 renamed past_key_values to cache (its generate() passes cache=, 5.23's past_key_values=)
    from linearformers.modeling.base import CACHE_FIELD

    model = _lm(family, initializer_range=0.2)
    ids = torch.randint(1, 99, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        new_name, old_name = LinearAttentionCache(2), LinearAttentionCache(2)
        first = model(ids[:, :5], cache=new_name, use_cache=True)
        assert getattr(first, CACHE_FIELD) is new_name
        assert getattr(model.model(ids[:, :5], use_cache=True), CACHE_FIELD) is not None
        steps = [first.logits, model(ids[:, 5:], cache=new_name, use_cache=True).logits]
        old = [model(ids[:, :5], past_key_values=old_name).logits, model(ids[:, 5:], past_key_values=old_name).logits]
        for pieces in (steps, old):
            torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="both cache and past_key_values"):
            model(ids[:, :1], cache=new_name, past_key_values=old_name)
        with pytest.raises(TypeError, match="must be a LinearAttentionCache"):
            model(ids[:, :1], cache=(torch.zeros(1),))


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_and_a_step_loop_raise_no_cache_deprecation(family, monkeypatch):
    # transformers >= 5.24 warns (once per process, so a recorder rather than the log) when a cache goes by its old
    # name; the models must hand generate() the name it reads
    import warnings

    import transformers.utils.generic as generic

    from linearformers.modeling.base import CACHE_FIELD

    said = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda message, *a, **k: said.append(message))
    model = _lm(family)
    ids = torch.randint(1, 99, (2, 5), generator=torch.Generator().manual_seed(4))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        out = model(ids, use_cache=True)
        model(ids[:, :1], **{CACHE_FIELD: getattr(out, CACHE_FIELD)})
    cache_words = [str(m) for m in said + [w.message for w in caught] if "past_key_values" in str(m)]
    assert cache_words == []


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_fills_a_cache_the_caller_hands_it(family):
    from linearformers.modeling.base import CACHE_FIELD

    model = _lm(family, initializer_range=0.2)
    ids = torch.randint(1, 99, (2, 6), generator=torch.Generator().manual_seed(5))
    cache = LinearAttentionCache(model.config.num_hidden_layers)
    given = model.generate(ids, max_new_tokens=5, do_sample=False, **{CACHE_FIELD: cache})
    assert torch.equal(given, model.generate(ids, max_new_tokens=5, do_sample=False))
    assert cache.get_seq_length() == 6 + 5 - 1  # the last token is returned, never fed back


CONTINUED = {
    "performer_softmax": ("performer", {}),
    "performer_relu": ("performer", {"feature_map": "relu"}),
    "performer_hedgehog": ("performer", {"feature_map": "hedgehog"}),
    "performer_hybrid_window": ("performer", {"hybrid_window": 3}),
    "linformer": ("linformer", {}),
}


@pytest.mark.parametrize("inputs", ["ids", "left_padded_ids", "inputs_embeds"])
@pytest.mark.parametrize("model_name", list(CONTINUED))
def test_generate_continued_from_its_returned_cache_equals_one_uninterrupted_generate(model_name, inputs):
    # transformers' idiom (test_generate_continue_from_past_key_values): generate again from the full sequence and
    # the returned cache; only the tokens the cache has not seen may be fed
    from linearformers.modeling.base import CACHE_FIELD

    family, overrides = CONTINUED[model_name]
    model = _lm(family, initializer_range=0.2, **overrides)
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    if inputs == "left_padded_ids":
        ids[0, :3], mask[0, :3] = 0, 0
    kwargs = dict(do_sample=False, return_dict_in_generate=True, output_scores=True)
    embed = model.get_input_embeddings()
    prompt = {"inputs_embeds": embed(ids)} if inputs == "inputs_embeds" else {"input_ids": ids}
    with torch.no_grad():
        full = model.generate(**prompt, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, **kwargs)
        first = model.generate(**prompt, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, **kwargs)
        new = first.sequences[:, -3:]  # generate() returns only the new tokens after inputs_embeds
        if inputs == "inputs_embeds":
            prompt = {"inputs_embeds": torch.cat([prompt["inputs_embeds"], embed(new)], 1)}
        else:
            prompt = {"input_ids": first.sequences}
        cont = model.generate(
            **prompt,
            attention_mask=torch.cat([mask, torch.ones_like(new)], 1),
            max_new_tokens=1,
            **{CACHE_FIELD: getattr(first, CACHE_FIELD)},
            **kwargs,
        )
    assert getattr(cont, CACHE_FIELD).get_seq_length() == getattr(full, CACHE_FIELD).get_seq_length() == 10
    torch.testing.assert_close(cont.scores[0], full.scores[3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_continues_a_cache_from_the_new_tokens_and_a_mask_of_the_whole_sequence(family):
    from linearformers.modeling.base import CACHE_FIELD

    model = _lm(family, initializer_range=0.2)
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(7))
    kwargs = dict(do_sample=False, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        full = model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        first = model.generate(ids, max_new_tokens=3, min_new_tokens=3, **kwargs)
        cont = model.generate(
            first.sequences[:, -1:],
            attention_mask=torch.ones(2, 10, dtype=torch.long),
            max_new_tokens=1,
            **{CACHE_FIELD: getattr(first, CACHE_FIELD)},
            **kwargs,
        )
        torch.testing.assert_close(cont.scores[0], full.scores[3], rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="input_ids of length 1 and a cache that holds 10 tokens"):
            model.generate(first.sequences[:, -1:], max_new_tokens=1, **{CACHE_FIELD: getattr(cont, CACHE_FIELD)})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("left_padded", [False, True])
def test_chunked_prefill_generates_what_one_prefill_generates(family, left_padded):
    from linearformers.modeling.base import CACHE_FIELD

    model = _lm(family, initializer_range=0.2)
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    if left_padded:
        ids[0, :3], mask[0, :3] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    chunked = model.generate(ids, prefill_chunk_size=3, **{CACHE_FIELD: LinearAttentionCache(2)}, **kwargs)
    assert torch.equal(chunked, model.generate(ids, **kwargs))
