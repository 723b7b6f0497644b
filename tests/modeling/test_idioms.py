"""Idioms scripts bring from other transformers models: generate(**tokenizer(...)), attn_implementation=..."""

import logging

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline

from tests.conftest import FAMILIES, tiny_config


def _lm(family, tokenizer):
    torch.manual_seed(0)
    cfg = tiny_config(family, is_decoder=True, vocab_size=tokenizer.vocab_size, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_takes_the_wordpiece_tokenizers_output_with_token_type_ids(family, tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = _lm(family, tokenizer)
    inputs = tokenizer(["Linear attention scales", "to long sequences of tokens"], return_tensors="pt", padding=True)
    assert "token_type_ids" in inputs
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    plain = model.generate(
        input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=5, do_sample=False
    )
    assert torch.equal(out, plain)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    text = pipeline("text-generation", model=str(tmp_path))("Linear attention", max_new_tokens=3, do_sample=False)
    assert text[0]["generated_text"].startswith("Linear attention")


@pytest.mark.parametrize(
    ("family", "implementation"),
    [
        ("linformer", "sdpa"),
        ("performer", "sdpa"),
        ("performer", "eager"),
        ("linformer", "flash_attention_2"),
        ("performer", "flex_attention"),
    ],
)
def test_softmax_attn_implementations_are_recorded_and_change_nothing(family, implementation, tmp_path):
    torch.manual_seed(0)
    cfg = tiny_config(family, is_decoder=True)
    reference = AutoModelForCausalLM.from_config(cfg).eval()
    assert reference.config._attn_implementation == "eager"
    reference.save_pretrained(tmp_path)
    ids = torch.randint(1, 99, (1, 6), generator=torch.Generator().manual_seed(0))
    want = reference.generate(ids, max_new_tokens=4, do_sample=False)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=implementation).eval()
    assert loaded.config._attn_implementation == implementation
    assert torch.equal(loaded.generate(ids, max_new_tokens=4, do_sample=False), want)
    loaded.save_pretrained(tmp_path / "again")
    assert "attn_implementation" not in (tmp_path / "again" / "config.json").read_text()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    assert again.config._attn_implementation == "eager"
    assert torch.equal(again(ids).logits, reference(ids).logits)

    from_config = AutoModel.from_config(tiny_config(family), attn_implementation=implementation)
    assert from_config.config._attn_implementation == implementation
    by_config = type(from_config)(tiny_config(family, attn_implementation=implementation))
    assert by_config.config._attn_implementation == implementation


def test_a_softmax_implementation_logs_that_the_linear_kernels_run(caplog):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            # local heads make the message new: warning_once would stay silent after another test's identical one
            cfg = tiny_config("performer", num_local_heads=3, local_window=4)
            AutoModel.from_config(cfg, attn_implementation="sdpa")
    finally:
        hf_logging.disable_propagation()
    assert "recorded but not used" in caplog.text
    assert "FAVOR+ (Performer) with 3 local windowed-softmax head(s)" in caplog.text


@pytest.mark.parametrize("family", FAMILIES)
def test_an_unknown_attn_implementation_raises_naming_the_kernel(family):
    with pytest.raises(ValueError, match="is not a value .* accepts: its attention is"):
        AutoModel.from_config(tiny_config(family), attn_implementation="paged_flash_nonsense")
