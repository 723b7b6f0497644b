"""Where a short call's time goes on a GPU: the host's share of one attention layer's forward + backward.

At 4K tokens the Triton kernels' own work is a fraction of a millisecond, so a call can be bound by the host: the
Python around the launches, the custom-op dispatch, each Triton launch's argument binding, and any read of a device
value (which stalls the host until the GPU has caught up). For each kernel of ``benchmarks/gpu.py`` (same shapes:
12 heads x 64, batch 1, bf16, the layer's inputs and upstream gradient made beforehand), this prints and writes:

* ``event_ms``: forward + backward timed with CUDA events, as ``gpu.py`` times it (median);
* ``host_fwd_ms`` / ``host_bwd_ms``: host time until the forward / the backward call returns (median; a device read
  inside counts the wait);
* ``device_ms``: the GPU's busy time, the sum of its kernels' durations in one profiled call;
* ``launches``: each Triton kernel's launches per call and host time per launch (``JITFunction.run`` timed);
* ``top_host_ops``: the profiler's operators by their own host time in one call; ``top_device_kernels`` by their
  own device time.
``--models gpt2 performer_clm`` profiles one training step of those ``gpu.py`` models at each length too (its time
and the device's largest kernels).

    python benchmarks/host_time.py --out /tmp/host --lengths 4096 16384
    python benchmarks/host_time.py --device cpu --kernels sdpa_causal favor_causal/chunked --lengths 256  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu
from _stamp import finish_stamp, start_stamp

DEFAULT_KERNELS = [
    "sdpa_causal", "favor_causal/triton", "linear_causal/triton", "hedgehog_causal/triton", "hybrid_causal/triton",
    "sdpa", "favor/triton", "hedgehog/triton", "linformer/auto",
]  # fmt: skip
LAUNCH_HOST: dict[str, list[float]] = {}


def _time_launches():
    """Time the host side of every Triton launch (JITFunction.run), per kernel name."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return
    run = JITFunction.run

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            LAUNCH_HOST.setdefault(self.fn.__name__, []).append(time.perf_counter() - t0)

    JITFunction.run = timed


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _profiled(fn, device: str):
    """One call of ``fn`` under the profiler (host, and the device on CUDA): its averaged entries and the sum of
    their own device time (µs)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        _sync(device)
    table = prof.key_averages()
    return table, sum(getattr(e, "self_device_time_total", 0) or 0 for e in table)


def measure(name: str, n: int, device: str, repeats: int) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    fn, inputs, grad = gpu.build_attention(name, n, device, dtype, 256, 256)
    meter = gpu.Meter(device)
    fwd, bwd, events = [], [], []

    def once(record=False):
        t0 = time.perf_counter()
        out = fn(*inputs)
        t1 = time.perf_counter()
        out.backward(grad)
        t2 = time.perf_counter()
        for t in inputs:
            t.grad = None
        if record:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)

    for _ in range(3):
        once()
    _sync(device)
    for _ in range(repeats):
        _sync(device)
        once(record=True)
        _sync(device)
    events = [meter.time(once) for _ in range(repeats)]
    LAUNCH_HOST.clear()
    _sync(device)
    once()
    _sync(device)
    launches = {k: {"calls": len(v), "host_us_each": 1e6 * statistics.mean(v)} for k, v in LAUNCH_HOST.items()}
    table, device_us = _profiled(once, device)
    top = sorted(table, key=lambda e: -e.self_cpu_time_total)[:14]
    return {
        "top_device_kernels": _top_device(table),
        "event_ms": 1e3 * statistics.median(events),
        "host_fwd_ms": 1e3 * statistics.median(fwd),
        "host_bwd_ms": 1e3 * statistics.median(bwd),
        "device_ms": device_us / 1e3,
        "launches": launches,
        "top_host_ops": [
            {"name": e.key[:90], "calls": e.count, "self_host_us": round(e.self_cpu_time_total, 1)} for e in top
        ],
    }


def _top_device(table, count=12) -> list[dict]:
    """The profiler's entries by their own device time (kernels and copies), largest first."""
    timed = [e for e in table if (getattr(e, "self_device_time_total", 0) or 0) > 0]
    timed.sort(key=lambda e: -e.self_device_time_total)
    return [
        {"name": e.key[:90], "calls": e.count, "device_us": round(e.self_device_time_total, 1)} for e in timed[:count]
    ]


def profile_training(name: str, n: int, device: str) -> dict:
    """One training step of gpu.py's model ``name`` at length n under the profiler (after two untimed steps):
    the step's time, the device's busy time and its largest kernels."""
    torch.manual_seed(0)
    model = gpu.build_model(name, n, gpu.GPT2_SHAPE if name in ("gpt2", "performer_clm") else gpu.BERT_SHAPE)
    model = model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 30000, (1, n), device=device)

    def step():
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    seconds = time.perf_counter() - t0
    table, device_us = _profiled(step, device)
    return {"step_ms": 1e3 * seconds, "device_ms": device_us / 1e3, "top_device_kernels": _top_device(table, 20)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--kernels", nargs="+", default=DEFAULT_KERNELS)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=gpu.RESULTS)
    parser.add_argument("--models", nargs="*", default=[], help="training steps to profile (gpu.py's model names)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --device cpu for a smoke run")
    out = args.out / "host_time.json"
    args.out.mkdir(parents=True, exist_ok=True)
    out.write_text("{}")  # writable before the work
    stamp = start_stamp()
    if os.environ.get("BENCH_COMMIT"):  # a copy of the tree whose .git is not its own (a lent GPU machine)
        stamp["commit"] = os.environ["BENCH_COMMIT"]
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        stamp["device"] = f"{props.name} ({props.total_memory / 2**30:.0f} GiB); host: {stamp['device']}"
    _time_launches()
    rows = {}
    for name in args.kernels:
        for n in args.lengths:
            try:
                row = measure(name, n, args.device, args.repeats)
            except Exception as err:  # one kernel's failure is recorded, the others still run
                row = {"status": f"{type(err).__name__}: {str(err)[:300]}"}
            rows[f"{name} {n}"] = row
            if "event_ms" in row:
                calls = sum(v["calls"] for v in row["launches"].values())
                per = sum(v["calls"] * v["host_us_each"] for v in row["launches"].values())
                print(
                    f"{name:24s} n={n:6d}: {row['event_ms']:7.3f} ms (events), host fwd {row['host_fwd_ms']:.3f} + "
                    f"bwd {row['host_bwd_ms']:.3f} ms, device busy {row['device_ms']:.3f} ms; {calls} Triton "
                    f"launches, {per / 1e3:.3f} ms of their host time",
                    flush=True,
                )
                for op in row["top_host_ops"][:8]:
                    print(f"      {op['self_host_us']:9.1f} us  x{op['calls']:<3d} {op['name']}")
                for op in row["top_device_kernels"][:6]:
                    print(f"      {op['device_us']:9.1f} us device  x{op['calls']:<3d} {op['name']}")
            else:
                print(f"{name} n={n}: {row['status']}", flush=True)
            gpu._free(args.device, False)
            out.write_text(json.dumps({"header": finish_stamp(stamp), "rows": rows}, indent=1) + "\n")
    for name in args.models:
        for n in args.lengths:
            try:
                row = profile_training(name, n, args.device)
            except Exception as err:
                row = {"status": f"{type(err).__name__}: {str(err)[:300]}"}
            rows[f"train {name} {n}"] = row
            if "step_ms" in row:
                print(f"train {name} n={n}: step {row['step_ms']:.1f} ms, device busy {row['device_ms']:.1f} ms")
                for op in row["top_device_kernels"]:
                    print(f"      {op['device_us'] / 1e3:9.2f} ms device  x{op['calls']:<4d} {op['name']}")
            else:
                print(f"train {name} n={n}: {row['status']}", flush=True)
            gpu._free(args.device, False)
            out.write_text(json.dumps({"header": finish_stamp(stamp), "rows": rows}, indent=1) + "\n")
    out.write_text(json.dumps({"header": finish_stamp(stamp), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
