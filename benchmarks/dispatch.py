"""Counts behind the GPU-path claims of docs/attention-and-backends.md and docs/design.md, on CPU: aten ops
dispatched and torch.compile graph breaks.

    python benchmarks/dispatch.py                 # op counts and graph breaks
    python benchmarks/dispatch.py --ops           # op counts only
    python benchmarks/dispatch.py --breaks -v     # graph breaks, with each break's reason

Op counts: forward + backward of causal ``favor_attention`` with ``backend="chunked"`` (the portable form GPUs run)
and ``backend="native"`` (the compiled CPU walk: its ops are those around one opaque call per direction; "not run"
where it is not built or switched off), of ``causal_linformer_attention`` (its default, chunked, backend), and of
causal ``linear_attention(backend="chunked")`` on precomputed FAVOR+ features (made outside the count, so only the
prefix-sum kernel is counted); b = h = 1, head_dim 16, m = k = 32 slots / features, counted with a
``TorchDispatchMode``; on a GPU every op is a kernel launch. Graph breaks:
``torch._dynamo.explain`` on 2-layer models (hidden 32, 2 heads; the tests' tiny config), in training mode, on
(2, 16) inputs without and with a left-padded mask.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.conftest's tiny config

from linearformers.ops import (
    causal_linformer_attention,
    draw_random_features,
    favor_attention,
    favor_features,
    linear_attention,
)

KERNELS = ("chunked", "native", "linformer", "linear_chunked")


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def op_count(n: int, kernel: str) -> int:
    """aten ops of one forward + backward; raises ValueError where the backend refuses to run."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g).requires_grad_() for _ in range(3))
    e = torch.randn(32, n, generator=g).requires_grad_()
    w = draw_random_features(32, 16, seed=0)
    upstream = torch.randn(1, 1, n, 16, generator=g)  # made outside the count, as a layer receives it
    if kernel == "linear_chunked":  # features precomputed, as a feature map's caller (or fla's) would pass them
        with torch.no_grad():
            phi_q = favor_features(q, w, is_query=True).requires_grad_()
            phi_k = favor_features(k, w, is_query=False).requires_grad_()
    with CountOps() as counter:
        if kernel == "linformer":
            out = causal_linformer_attention(q, k, v, e, e)
        elif kernel == "linear_chunked":
            out = linear_attention(phi_q, phi_k, v, causal=True, backend="chunked")
        else:
            out = favor_attention(q, k, v, w, causal=True, backend=kernel)
        out.backward(upstream)
    return counter.count


def graph_breaks(verbose: bool) -> None:
    import torch._dynamo
    from transformers import AutoModel, AutoModelForCausalLM

    from tests.conftest import tiny_config

    torch.manual_seed(0)
    ids = torch.randint(1, 99, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :3] = 0
    for family in ("performer", "linformer"):
        for decoder in (False, True):
            overrides = {"is_decoder": decoder}
            if family == "performer":
                overrides["feature_redraw_interval"] = 3
            auto = AutoModelForCausalLM if decoder else AutoModel
            model = auto.from_config(tiny_config(family, **overrides)).train()
            counts = []
            for inputs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": mask}):
                torch._dynamo.reset()
                explained = torch._dynamo.explain(model)(**inputs)
                counts.append(explained.graph_break_count)
                if verbose:
                    for reason in explained.break_reasons:
                        frame = reason.user_stack[-1] if reason.user_stack else None
                        where = f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame else ""
                        print(f"    {reason.reason.splitlines()[0][:140]} @ {where}")
            kind = "causal LM" if decoder else "encoder"
            print(f"graph breaks, {family} {kind}: {counts[0]} without a mask, {counts[1]} with a padded one")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", action="store_true", help="op counts only")
    parser.add_argument("--breaks", action="store_true", help="graph breaks only")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each graph break's reason")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if not args.breaks:
        for kernel in KERNELS:
            try:
                counts = ", ".join(f"{op_count(n, kernel)} at n = {n}" for n in (1024, 2048, 4096, 16384))
            except ValueError as err:  # backend="native" where the compiled walk cannot run
                counts = f"not run ({err})"
            print(f"ops dispatched, forward + backward, {kernel}: {counts}", flush=True)
    if not args.ops:
        graph_breaks(args.verbose)


if __name__ == "__main__":
    main()
