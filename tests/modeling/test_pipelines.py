"""transformers pipelines load our models from a saved folder, the Auto registration doing the rest."""

import pytest
import torch
from transformers import (
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    pipeline,
)

from tests.conftest import FAMILIES, tiny_config


def _save(auto, family, tokenizer_dir, folder, **config):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = tiny_config(family, vocab_size=tokenizer.vocab_size, max_position_embeddings=128, **config)
    auto.from_config(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_fill_mask_pipeline(family, tokenizer_dir, tmp_path):
    fill = pipeline("fill-mask", model=_save(AutoModelForMaskedLM, family, tokenizer_dir, tmp_path))
    out = fill("The quick brown [MASK] jumps over the lazy dog.", top_k=3)
    assert len(out) == 3 and all("token_str" in o and 0 <= o["score"] <= 1 for o in out)


@pytest.mark.parametrize("family", FAMILIES)
def test_text_classification_pipeline(family, tokenizer_dir, tmp_path):
    folder = _save(
        AutoModelForSequenceClassification,
        family,
        tokenizer_dir,
        tmp_path,
        num_labels=2,
        id2label={0: "NEG", 1: "POS"},
        label2id={"NEG": 0, "POS": 1},
    )
    out = pipeline("text-classification", model=folder)(["I loved it.", "Terrible, a waste of time."])
    assert [o["label"] in ("NEG", "POS") for o in out] == [True, True]


@pytest.mark.parametrize("family", FAMILIES)
def test_token_classification_pipeline(family, tokenizer_dir, tmp_path):
    folder = _save(
        AutoModelForTokenClassification,
        family,
        tokenizer_dir,
        tmp_path,
        num_labels=3,
        id2label={0: "O", 1: "B-PER", 2: "I-PER"},
        label2id={"O": 0, "B-PER": 1, "I-PER": 2},
    )
    out = pipeline("token-classification", model=folder)("Guido van Rossum wrote Python.")
    assert isinstance(out, list)
    assert all(o["entity"] in ("B-PER", "I-PER") for o in out)  # "O" is dropped by the pipeline


@pytest.mark.parametrize("family", FAMILIES)
def test_extractive_question_answering_end_to_end(family, tokenizer_dir, tmp_path):
    # transformers 5 removed pipeline("question-answering") (REMOVED_TASKS); this is the same path by hand:
    # tokenize (question, context) with offsets, score spans, map the best one back to characters.
    folder = _save(AutoModelForQuestionAnswering, family, tokenizer_dir, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForQuestionAnswering.from_pretrained(folder).eval()
    context = "Python was created by Guido van Rossum and first released in 1991."
    enc = tokenizer("Who created Python?", context, return_offsets_mapping=True, return_tensors="pt")
    offsets = enc.pop("offset_mapping")[0]
    with torch.no_grad():
        out = model(**enc)
    in_context = torch.tensor([s == 1 for s in enc.sequence_ids(0)])
    start_logits = out.start_logits[0].masked_fill(~in_context, -1e9)
    end_logits = out.end_logits[0].masked_fill(~in_context, -1e9)
    scores = start_logits[:, None] + end_logits[None, :]
    scores = scores.masked_fill(~torch.ones_like(scores, dtype=torch.bool).triu(), -1e9)
    start, end = divmod(int(scores.argmax()), scores.shape[1])
    answer = context[int(offsets[start][0]) : int(offsets[end][1])]
    assert answer and answer in context
    assert out.start_logits.shape == enc["input_ids"].shape
