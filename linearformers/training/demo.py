"""`make demo`: the whole mission on an embedded default, offline, in about a minute on 2 idle CPU cores.

1. Real text: the Python standard library's own source, split into train / validation files.
2. Small Performer and Linformer causal LMs trained with `linearformers-train` (on Trainer), each with a
   byte-level BPE tokenizer trained on the training text first.
3. Evaluation (perplexity), checkpoints under outputs/demo/<family>/, and a Hub-ready export (weights, config
   with auto_map, tokenizer, model card, self-contained code) in outputs/demo/<family>/hub.
4. Reload through AutoModelForCausalLM.from_pretrained, generate a sample on the recurrent cache.
5. A report: parameters, first / last training loss, eval perplexity, tokens/s, wall time, and the samples.

    python -m linearformers.training.demo [--steps 150] [--output outputs/demo]
    python -m linearformers.training.demo --data-only --data-dir .   # `make data`: the README's data files only
"""

from __future__ import annotations

import argparse
import csv
import os
import sysconfig
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from ..hub_cards import save_for_hub
from .loop import ModelDataArguments, train

MODELS = {
    "performer": 'num_features=64,position_embedding_type="rotary",num_local_heads=1,local_window=32,'
    "feature_redraw_interval=100",
    "linformer": 'projected_length=64,sharing="key_value"',
}
BATCH, BLOCK = 8, 128
SHAPE = "hidden_size=128,num_hidden_layers=4,num_attention_heads=4,intermediate_size=512,hidden_dropout_prob=0.0"


def write_corpus(folder: Path, max_chars: int = 1_500_000) -> tuple[str, str]:
    """Standard-library modules, in order, one file for training and every 20th module for validation."""
    folder.mkdir(parents=True, exist_ok=True)
    modules = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train_parts, valid_parts, size = [], [], 0
    for i, path in enumerate(modules):
        text = path.read_text(errors="ignore")
        (valid_parts if i % 20 == 0 else train_parts).append(text)
        size += len(text)
        if size > max_chars:
            break
    train_file, valid_file = folder / "train.txt", folder / "validation.txt"
    train_file.write_text("\n".join(train_parts))
    valid_file.write_text("\n".join(valid_parts)[:80_000])  # ~150 blocks: evaluation stays a few seconds
    return str(train_file), str(valid_file)


def write_classification(folder: Path, rows: int = 4000) -> tuple[str, str]:
    """train.csv / validation.csv (text, label): standard-library lines labelled "comment" (without their "#") or
    "code", balanced; every 5th pair of rows goes to validation."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = {"comment": [], "code": []}
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for line in path.read_text(errors="ignore").splitlines():
            line = line.strip()
            if len(line) > 20:  # the "#" is dropped: the model must tell comments from code by their words
                lines["comment" if line.startswith("#") else "code"].append(line.lstrip("#").strip())
        if min(len(found) for found in lines.values()) >= rows // 2:
            break
    files = {"train": folder / "train.csv", "validation": folder / "validation.csv"}
    with files["train"].open("w", newline="") as train, files["validation"].open("w", newline="") as valid:
        writers = {"train": csv.writer(train), "validation": csv.writer(valid)}
        for writer in writers.values():
            writer.writerow(["text", "label"])
        for i, pair in enumerate(zip(lines["comment"][: rows // 2], lines["code"][: rows // 2])):
            for text, label in zip(pair, ("comment", "code")):
                writers["validation" if i % 5 == 0 else "train"].writerow([text, label])
    return str(files["train"]), str(files["validation"])


def write_data(folder: Path) -> None:
    """What the README's training commands read: train.txt / validation.txt and train.csv / validation.csv."""
    texts = write_corpus(folder)
    tables = write_classification(folder)
    for name in (*texts, *tables):
        print(f"wrote {name} ({Path(name).stat().st_size / 1e6:.2f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--output", default="outputs/demo")
    parser.add_argument("--data-only", action="store_true", help="write the data files into --data-dir and stop")
    parser.add_argument("--data-dir", default=None, help="where the data goes (default: OUTPUT/data)")
    args = parser.parse_args()
    output = Path(args.output)
    data_dir = Path(args.data_dir) if args.data_dir else output / "data"
    if args.data_only:
        write_data(data_dir)
        return
    torch.set_num_threads(2)
    train_file, valid_file = write_corpus(data_dir)
    print(f"corpus: {Path(train_file).stat().st_size / 1e6:.1f} MB of Python standard library source")
    load = os.getloadavg()[0]
    print(f"load average {load:.2f} on {os.cpu_count()} cores; each model takes ~30 s on 2 idle cores")
    report = []
    for family, extra in MODELS.items():
        print(f"\n== {family}: training a small causal LM ==")
        start = time.perf_counter()
        out = train(
            ModelDataArguments(
                task="clm",
                family=family,
                train_file=train_file,
                validation_file=valid_file,
                config_overrides=f"{SHAPE},{extra}",
                block_size=BLOCK,
                overwrite_output_dir=True,  # the demo owns its output folder: a rerun starts over
            ),
            TrainingArguments(
                output_dir=str(output / family),
                per_device_train_batch_size=BATCH,
                per_device_eval_batch_size=BATCH,
                learning_rate=2e-3,
                warmup_steps=10,
                max_steps=args.steps,
                eval_strategy="steps",
                eval_steps=max(args.steps // 3, 1),
                save_steps=max(args.steps // 3, 1),
                save_total_limit=2,
                seed=0,
                logging_steps=1,  # the report's first and last training loss
                report_to="tensorboard",
            ),
        )
        seconds = time.perf_counter() - start
        # Hub-ready: weights, config with auto_map, tokenizer, model card and self-contained code
        folder = str(
            save_for_hub(
                out["model"],
                AutoTokenizer.from_pretrained(out["final_dir"]),
                output / family / "hub",
                results=out["results"],
                datasets=["python-stdlib-source"],
            )
        )
        model = AutoModelForCausalLM.from_pretrained(folder).eval()  # plain Auto class: the package registered it
        tokenizer = AutoTokenizer.from_pretrained(folder)
        prompt = "def "
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        torch.manual_seed(0)
        sample = model.generate(ids, max_new_tokens=40, do_sample=True, top_k=20, temperature=0.8)
        text = tokenizer.decode(sample[0], skip_special_tokens=True)
        losses = out["train_loss"]
        report.append(
            (
                family,
                type(model).__name__,
                sum(p.numel() for p in model.parameters()),
                losses[0],
                losses[-1],
                out["results"]["perplexity"],
                args.steps * BATCH * BLOCK / seconds,
                seconds,
                folder,
                text,
            )
        )
    print(f"\n== report: {args.steps} steps of {BATCH} x {BLOCK} tokens each, 2 threads ==")
    print(
        f"{'family':<10} {'class':<22} {'params':>8} {'loss first':>10} {'loss last':>10} {'eval ppl':>9}"
        f" {'tokens/s':>9} {'time':>7}"
    )
    for family, cls, params, first, last, ppl, speed, seconds, _folder, _text in report:
        print(
            f"{family:<10} {cls:<22} {params / 1e6:>7.1f}M {first:>10.2f} {last:>10.2f} {ppl:>9.1f}"
            f" {speed:>9.0f} {seconds:>6.0f}s"
        )
    print("tokens/s: training tokens over the whole training run, its evaluations and checkpoints included")
    print(f"load average now {os.getloadavg()[0]:.2f} (was {load:.2f}): a busy machine lowers tokens/s")
    for family, *_, folder, text in report:
        print(f"\n{family} checkpoint: {folder} (reloaded with AutoModelForCausalLM.from_pretrained)")
        print(f"{family} sample: {text!r}")


if __name__ == "__main__":
    main()
