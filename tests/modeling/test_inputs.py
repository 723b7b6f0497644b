"""Bad input is refused at the model's door with an error naming the problem and the fix: masks (shape, 0/1
values), ids (shape, dtype, range), inputs_embeds, token_type_ids / position_ids, and a cache of another batch.
Good input of every accepted form still runs: 0/1 masks of any dtype, masks keyed by layer type, cached steps."""

import functools

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from linearformers import LinearAttentionCache
from tests.conftest import FAMILIES, tiny_config

AUTOS = [
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoModelForQuestionAnswering,
    AutoModelForMultipleChoice,
    AutoModelForCausalLM,
]


@functools.cache
def _model(family, auto=AutoModel, **overrides):
    torch.manual_seed(0)
    cfg = tiny_config(family, is_decoder=auto is AutoModelForCausalLM, num_hidden_layers=1, **overrides)
    return auto.from_config(cfg).eval()


def _ids(batch=2, length=10, seed=0):
    return torch.randint(1, 99, (batch, length), generator=torch.Generator().manual_seed(seed))


def _left_padded_mask(batch=2, length=10):
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :3] = 0
    return mask


# --- attention_mask: shape -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("auto", AUTOS, ids=lambda a: a.__name__)
@pytest.mark.parametrize("mask_shape", [(2, 13), (2, 7), (3, 10)], ids=["longer", "shorter", "other_batch"])
def test_a_mask_of_another_shape_than_the_input_is_refused_naming_both(family, auto, mask_shape):
    model = _model(family, auto)
    ids = _ids()
    mask = torch.ones(mask_shape, dtype=torch.long)
    if auto is AutoModelForMultipleChoice:  # (batch, choices, length), flattened to (batch * choices, length)
        ids, mask = ids[:, None].expand(-1, 3, -1), mask[:, None].expand(-1, 3, -1)
        expected = (
            rf"attention_mask has shape \({mask_shape[0] * 3}, {mask_shape[1]}\) but input_ids has shape \(6, 10\)"
        )
    else:
        expected = rf"attention_mask has shape \({mask_shape[0]}, {mask_shape[1]}\) but input_ids has shape \(2, 10\)"
    with torch.no_grad(), pytest.raises(ValueError, match=expected):
        model(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mask_that_does_not_fit_inputs_embeds_is_refused(family):
    with torch.no_grad(), pytest.raises(ValueError, match=r"attention_mask has shape \(2, 13\) but inputs_embeds"):
        _model(family)(inputs_embeds=torch.randn(2, 10, 32), attention_mask=torch.ones(2, 13))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cached_step_takes_a_mask_over_the_cache_and_the_new_tokens(family):
    model = _model(family, AutoModelForCausalLM)
    ids, mask = _ids(length=7), _left_padded_mask(length=7)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits[:, -1]
        cache = LinearAttentionCache(model.config.num_hidden_layers)
        model(ids[:, :6], attention_mask=mask[:, :6], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 1\).*cache holds 6 tokens.*\(2, 7\)"):
            model(ids[:, 6:], attention_mask=mask[:, 6:], past_key_values=cache, use_cache=True)
        step = model(ids[:, 6:], attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_a_left_padded_mask_runs_through_the_cache(family):
    model = _model(family, AutoModelForCausalLM)
    ids, mask = _ids(length=6), _left_padded_mask(length=6)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (2, 10)


# --- attention_mask: values --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("auto", [AutoModel, AutoModelForCausalLM], ids=lambda a: a.__name__)
@pytest.mark.parametrize("padding", [-1e4, -float("inf"), torch.finfo(torch.float32).min])
def test_an_additive_mask_is_refused_as_such(family, auto, padding):
    mask = torch.zeros(2, 10)
    mask[0, :3] = padding
    with torch.no_grad(), pytest.raises(ValueError, match="0 \\(padding\\) and 1 \\(token\\).*additive mask"):
        _model(family, auto)(_ids(), attention_mask=mask)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_additive_mask_without_padding_is_refused(family):
    """An additive mask with nothing padded is all 0.0, which read as a 0/1 mask pads every token."""
    with torch.no_grad(), pytest.raises(ValueError, match="every token as padding.*additive mask"):
        _model(family)(_ids(), attention_mask=torch.zeros(2, 10))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mask_with_other_values_is_refused(family):
    mask = _left_padded_mask()
    mask[1, 4] = 2
    with torch.no_grad(), pytest.raises(ValueError, match="got values like 2"):
        _model(family)(_ids(), attention_mask=mask)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("auto", [AutoModel, AutoModelForCausalLM], ids=lambda a: a.__name__)
@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.float32, torch.float16])
def test_zero_one_masks_of_any_dtype_give_the_same_output(family, auto, dtype):
    model = _model(family, auto)
    ids, mask = _ids(), _left_padded_mask()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, use_cache=False)[0]
        got = model(ids, attention_mask=mask.to(dtype), use_cache=False)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("auto", [AutoModel, AutoModelForCausalLM], ids=lambda a: a.__name__)
def test_a_mask_keyed_by_layer_type_is_read_like_the_tensor(family, auto):
    model = _model(family, auto)
    ids, mask = _ids(), _left_padded_mask()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, use_cache=False)[0]
        got = model(ids, attention_mask={"linear_attention": mask}, use_cache=False)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# --- ids, embeddings, token types, positions ----------------------------------------------------------------------

BAD_INPUTS = {
    "empty_length": (lambda: {"input_ids": torch.zeros(2, 0, dtype=torch.long)}, ValueError, r"no tokens"),
    "empty_batch": (lambda: {"input_ids": torch.zeros(0, 10, dtype=torch.long)}, ValueError, r"no sequences"),
    "ids_1d": (lambda: {"input_ids": torch.arange(1, 11)}, ValueError, r"\(batch, length\).*\(10,\).*\[None\]"),
    "ids_float": (lambda: {"input_ids": _ids().float()}, TypeError, r"integer token ids.*torch.float32"),
    "neither": (lambda: {}, ValueError, r"exactly one of input_ids or inputs_embeds"),
    "both": (
        lambda: {"input_ids": _ids(), "inputs_embeds": torch.randn(2, 10, 32)},
        ValueError,
        r"exactly one of input_ids or inputs_embeds",
    ),
    "embeds_width": (lambda: {"inputs_embeds": torch.randn(2, 10, 17)}, ValueError, r"\(2, 10, 17\).*hidden_size=32"),
    "embeds_rank": (lambda: {"inputs_embeds": torch.randn(10, 32)}, ValueError, r"\(batch, length, hidden_size\)"),
    "embeds_int": (lambda: {"inputs_embeds": torch.ones(2, 10, 32, dtype=torch.long)}, TypeError, r"torch.int64"),
    "embeds_float64": (
        lambda: {"inputs_embeds": torch.randn(2, 10, 32, dtype=torch.float64)},
        TypeError,
        r"torch.float64.*torch.float32",
    ),
    "token_types_shape": (
        lambda: {"input_ids": _ids(), "token_type_ids": torch.zeros(2, 7, dtype=torch.long)},
        ValueError,
        r"token_type_ids has shape \(2, 7\) but input_ids has shape \(2, 10\)",
    ),
    "positions_shape": (
        lambda: {"input_ids": _ids(), "position_ids": torch.zeros(2, 7, dtype=torch.long)},
        ValueError,
        r"position_ids has shape \(2, 7\) but input_ids has shape \(2, 10\)",
    ),
    "id_past_vocab": (lambda: {"input_ids": _ids().fill_(99)}, ValueError, r"99.*vocab_size=99"),
    "id_negative": (lambda: {"input_ids": _ids().fill_(-1)}, ValueError, r"-1.*vocab_size=99"),
    "token_type_past_vocab": (
        lambda: {"input_ids": _ids(), "token_type_ids": torch.full((2, 10), 2)},
        ValueError,
        r"token_type_ids.*2.*type_vocab_size=2",
    ),
    "token_type_negative": (
        lambda: {"input_ids": _ids(), "token_type_ids": torch.full((2, 10), -1)},
        ValueError,
        r"token_type_ids.*-1.*type_vocab_size=2",
    ),
    "position_negative": (
        lambda: {"input_ids": _ids(), "position_ids": torch.full((2, 10), -1)},
        ValueError,
        r"position_ids.*-1",
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_an_error_naming_the_problem(family, case):
    inputs, error, message = BAD_INPUTS[case]
    with torch.no_grad(), pytest.raises(error, match=message):
        _model(family)(**inputs())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["empty_length", "ids_1d", "id_past_vocab", "id_negative", "position_negative"])
def test_bad_inputs_to_the_causal_lm_raise_the_same_errors(family, case):
    inputs, error, message = BAD_INPUTS[case]
    with torch.no_grad(), pytest.raises(error, match=message):
        _model(family, AutoModelForCausalLM)(**inputs())


@pytest.mark.parametrize("family", FAMILIES)
def test_one_row_of_token_types_and_positions_is_broadcast_over_the_batch(family):
    model = _model(family)
    ids = _ids()
    types = torch.tensor([[0] * 5 + [1] * 5])
    with torch.no_grad():
        expected = model(ids, token_type_ids=types.expand(2, -1), position_ids=torch.arange(10).expand(2, -1))[0]
        got = model(ids, token_type_ids=types, position_ids=torch.arange(10)[None])[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_id_range_checks_are_skipped_while_compiling(monkeypatch):
    """Data-dependent checks would break the compiled graph; under torch.compile they are left out."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad(), pytest.raises(IndexError):
        _model("performer")(_ids().fill_(99))


# --- the decoding cache ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("local_heads", [0, 4], ids=["global", "all_local"])
def test_a_cache_built_for_one_batch_is_refused_for_another(family, local_heads):
    extra = {"num_local_heads": local_heads, "local_window": 3} if local_heads else {}
    model = _model(family, AutoModelForCausalLM, **extra)
    with torch.no_grad():
        cache = model(_ids(length=5), use_cache=True).past_key_values
        with pytest.raises(ValueError, match=r"the cache holds the state of a batch of 2.*batch of 3"):
            model(_ids(batch=3, length=1), past_key_values=cache, use_cache=True)
