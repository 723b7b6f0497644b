"""Sequence classification with Trainer and local evaluate metrics (accuracy, macro F1).

    python examples/run_classification.py --family performer --train_file train.csv --validation_file dev.csv \
        --text_column sentence --label_column label --output_dir out/cls \
        --config_overrides 'hidden_size=256,num_hidden_layers=4,num_attention_heads=4' --block_size 512 \
        --per_device_train_batch_size 16 --num_train_epochs 3 --eval_strategy epoch --use_cpu
"""

import numpy as np
from common import DataArguments, ModelArguments, load_everything
from transformers import (
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)

import linearformers  # noqa: F401  (registers the models with the Auto classes)
from linearformers.training import load_metric


def main():
    model_args, data_args, training_args = HfArgumentParser(
        (ModelArguments, DataArguments, TrainingArguments)
    ).parse_args_into_dataclasses()
    tokenizer, data, model = load_everything(
        model_args, data_args, "classification", AutoModelForSequenceClassification, training_args.seed
    )
    accuracy, f1 = load_metric("accuracy"), load_metric("f1")

    def compute_metrics(prediction):
        predictions = np.argmax(prediction.predictions, axis=-1)
        return {
            **accuracy.compute(predictions=predictions, references=prediction.label_ids),
            **f1.compute(predictions=predictions, references=prediction.label_ids),
        }

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
