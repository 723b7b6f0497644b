"""Host-side cost of the Triton causal path, without running a kernel: every Triton launch is replaced by a no-op
that counts it, so one forward + backward of ``favor_attention(..., backend="triton")`` (features fused) and of
``linear_attention(..., backend="triton")`` (given features) times only the Python, the torch ops around the
launches and the custom-op dispatch. Runs on the CPU (TRITON_INTERPRET=1 lets the backend accept CPU tensors; the
kernels are mocked, so nothing is interpreted). Torch ops are counted with the profiler (aten ops called at the top
level of the call, or nested).

    TRITON_INTERPRET=1 python benchmarks/triton_host_overhead.py [--length 4096] [--repeats 20]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from linearformers.ops import (
    _triton_causal,
    draw_random_features,
    favor_attention,
    linear_attention,
)

LAUNCHES: dict[str, int] = {}


class _NoLaunch:
    """kernel[grid](...) that counts the launch and runs nothing (so the lost count, which _normalize adds up, stays
    0 and favor_attention takes its common path, without a redo)."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            LAUNCHES[self.name] = LAUNCHES.get(self.name, 0) + 1

        return launch


def _mock_kernels():
    real = _triton_causal.kernels()
    mocked = {name: _NoLaunch(name) for name in vars(real)}
    _triton_causal.kernels = lambda: type(real)(**mocked)


def _step(fn, inputs):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(torch.ones_like(out))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096, help="at 64 the sizes cost nothing: dispatch alone")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--multiprocessors", type=int, default=132, help="the GPU's (H100: 132): how many segments the grids take"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # the host path of a GPU call is one thread; a busy pool would time its wake-ups
    _mock_kernels()
    _triton_causal._program_target = lambda device: _triton_causal.DEFAULT_PROGRAMS_PER_SM * args.multiprocessors
    torch.manual_seed(0)
    b, h, n, d, m = 1, 12, args.length, 64, 256
    q, k, v = (torch.randn(b, h, n, d) * 0.3 for _ in range(3))
    w = draw_random_features(m, d, seed=0)
    phi_q, phi_k = (torch.rand(b, h, n, m) for _ in range(2))
    cases = {
        "favor_causal/triton": (lambda q, k, v: favor_attention(q, k, v, w, causal=True, backend="triton"), (q, k, v)),
        "linear_causal/triton": (
            lambda pq, pk, v: linear_attention(pq, pk, v, causal=True, backend="triton"),
            (phi_q, phi_k, v),
        ),
    }
    for name, (fn, inputs) in cases.items():
        _step(fn, inputs)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            _step(fn, inputs)
            times.append(time.perf_counter() - start)
        LAUNCHES.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _step(fn, inputs)
        ops = [e for e in prof.events() if e.name.startswith("aten::")]
        top = {}
        for e in ops:
            top[e.name] = top.get(e.name, 0) + 1
        syncs = [e.name for e in ops if e.name in ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")]
        print(
            f"{name} n={n}: median {statistics.median(times) * 1e3:.2f} ms host (fwd+bwd, kernels mocked), "
            f"{sum(LAUNCHES.values())} launches {dict(LAUNCHES)}, {len(ops)} aten ops (nested included), "
            f"host reads: {syncs}"
        )
        print("   ", ", ".join(f"{k.removeprefix('aten::')} {c}" for k, c in sorted(top.items(), key=lambda x: -x[1])))


if __name__ == "__main__":
    main()
