"""Causal language modelling with Trainer (the shape of transformers' examples/pytorch/language-modeling).

    python examples/run_clm.py --family performer --train_file train.txt --output_dir out/clm \
        --config_overrides 'hidden_size=256,num_hidden_layers=4,num_attention_heads=4,position_embedding_type="rotary"' \
        --block_size 512 --per_device_train_batch_size 8 --max_steps 1000 --use_cpu
"""

import math

from common import DataArguments, ModelArguments, load_everything
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments, default_data_collator

import linearformers  # noqa: F401  (registers the models with the Auto classes)


def main():
    model_args, data_args, training_args = HfArgumentParser(
        (ModelArguments, DataArguments, TrainingArguments)
    ).parse_args_into_dataclasses()
    tokenizer, data, model = load_everything(model_args, data_args, "clm", AutoModelForCausalLM, training_args.seed)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        data_collator=default_data_collator,
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    metrics = trainer.evaluate()
    metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 50))
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
