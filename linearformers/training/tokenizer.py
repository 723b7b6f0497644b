"""A byte-level BPE tokenizer for causal LMs, trained in seconds on the training text with `tokenizers`.

MiniLM's uncased WordPiece (the encoders' default) cannot write code back (``def _ _ init _ _ ( self``), has no end
of text, and wraps every prompt in [CLS] ... [SEP]. A causal LM needs a tokenizer that decodes to the exact text and
an end-of-text token that generation stops at.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE of ``vocab_size`` tokens trained on ``texts``.

    ``<|endoftext|>`` is its end-of-text, beginning-of-text and padding token, as in GPT-2: documents are separated
    by it in the grouped LM blocks and ``generate()`` stops at it. No special tokens are added around an input, and
    every string (newlines, indentation, underscores, any Unicode) decodes back exactly.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_batches(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TEXT,
        bos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        unk_token=END_OF_TEXT,
        model_input_names=["input_ids", "attention_mask"],
        clean_up_tokenization_spaces=False,
    )


def _batches(texts: Iterable[str], size: int = 1000) -> Iterator[list[str]]:
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
