"""Conversion of pretrained BERT / GPT-2 checkpoints into this package's models (``convert``) and attention
transfer, which fits the new attention to the original's (``transfer``). Above the models: imports them, never the
reverse."""
