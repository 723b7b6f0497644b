"""Hedgehog's map with its own autograd function against the same map composed of torch ops, side by side.

``softmax_pair`` (feature_maps.py) gives [softmax(u), softmax(-u)] through an autograd function that keeps only
the features, which the products after it keep anyway; composed of torch's ops (two softmaxes and a cat), autograd
also keeps both softmaxes' outputs, a second copy of the features. This runs the learned kernels of
``attention.py`` (hedgehog, hedgehog_causal, hybrid, hybrid_causal: 12 heads of 64, m = 128, batch 1, float32,
forward + backward) both ways, in alternating subprocesses (``--pairs`` per kernel and length), and prints:

  * what autograd keeps for the backward after one forward: the bytes of the distinct storages it saves (exact, the
    same in every run; inside the hybrid's checkpointed passes at long n, the checkpoint's own saving is not seen,
    which is the same both ways);
  * peak resident memory above the worker's start and the best time of ``--repeats`` (noisy on a shared VM: the
    pairs say how much).

    python benchmarks/feature_map_backward.py --lengths 4096 16384 --pairs 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _stamp import finish_stamp, start_stamp
from attention import DIM, HEADS, LEARNED, RESULTS, _kernel, forward_backward
from isolated import emit, run_isolated

from linearformers.ops import feature_maps

VARIANTS = ("composed", "softmax_pair")


def composed(u: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)], dim=-1)


def saved_bytes(fn, inputs) -> int:
    """Bytes of the distinct storages autograd saves in one forward of ``fn``."""
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    del out
    return sum(storages.values())


def worker(variant: str, name: str, n: int, repeats: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if variant == "composed":
        feature_maps.softmax_pair = composed  # HedgehogFeatureMap.forward looks the name up at each call
    fn = _kernel(name, n)
    inputs = tuple(torch.randn(1, HEADS, n, DIM, requires_grad=True) for _ in range(3))
    return {**forward_backward(fn, inputs, repeats), "saved_mb": saved_bytes(fn, inputs) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=3, metavar=("VARIANT", "NAME", "N"))
    parser.add_argument("--kernels", nargs="+", default=LEARNED, choices=LEARNED)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", type=Path, default=RESULTS / "feature_map_backward.json")
    args = parser.parse_args()
    if args.worker:
        variant, name, n = args.worker
        emit(worker(variant, name, int(n), args.repeats, args.threads))
        return
    stamp = start_stamp()
    rows = []
    print(
        "| kernel | n | kept for backward, composed → softmax_pair (MB) | "
        "peak MB, composed / softmax_pair (each pair) | seconds, composed / softmax_pair (each pair) |"
    )
    print("|---|---:|---|---|---|")
    for n in args.lengths:
        for name in args.kernels:
            runs = {variant: [] for variant in VARIANTS}
            for _ in range(args.pairs):
                for variant in VARIANTS:
                    arguments = ["--worker", variant, name, n, "--repeats", args.repeats, "--threads", args.threads]
                    row = run_isolated(__file__, arguments, timeout=args.timeout, label=f"{variant} {name} n={n}")
                    if row is None:
                        raise SystemExit(f"{variant} {name} n={n} failed")
                    runs[variant].append(row)
            a, b = runs["composed"], runs["softmax_pair"]
            rows.append({"kernel": name, "n": n, **runs})
            peaks = ", ".join(f"{x['peak_mb']:.0f} / {y['peak_mb']:.0f}" for x, y in zip(a, b))
            seconds = ", ".join(f"{x['seconds']:.3f} / {y['seconds']:.3f}" for x, y in zip(a, b))
            print(
                f"| {name} | {n} | {a[0]['saved_mb']:.0f} → {b[0]['saved_mb']:.0f} | {peaks} | {seconds} |", flush=True
            )
    args.out.write_text(
        json.dumps(
            {"header": finish_stamp(stamp), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2
        )
    )


if __name__ == "__main__":
    main()
