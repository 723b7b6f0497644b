"""GPU benchmark: attention kernels against flash SDPA, and LM training steps against GPT-2 / BERT (issue 16).

Attention (one layer, kernel only: q, k, v in; 12 heads x 64, batch 1, bf16 on CUDA), forward + backward with a
fixed upstream gradient:
  * ``sdpa`` / ``sdpa_causal``: ``torch.nn.functional.scaled_dot_product_attention`` forced to the flash backend
    (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``; on CPU whatever SDPA picks);
  * ``favor/<backend>`` / ``favor_causal/<backend>``: FAVOR+ (m = 256), once per ``backend=`` value that
    ``favor_attention`` accepts (``auto`` = no ``backend=`` argument, the library's own choice); a backend that
    refuses the device / dtype is recorded as ``unavailable``;
  * ``linformer/<backend>`` (k = 256, learned E, F; once per name of ``linformer.BACKENDS``),
    ``linformer_causal/<backend>`` (``causal_linformer_attention``, once per name of ``linformer.CAUSAL_BACKENDS``)
    and ``linformer_hybrid`` (``linformer_hybrid_attention``: k = 256, window 64, one sink, gamma 1);
  * ``linear_causal/<backend>``: ``linear_attention(phi_q, phi_k, v, causal=True)`` on FAVOR+ features computed
    beforehand by ``favor_features`` and *not timed* (gradients stop at the features), once per ``backend=`` value:
    the prefix-sum kernel alone, the same inputs as the fla row, where ``favor_causal`` rows include the feature maps;
  * ``fla_causal``: flash-linear-attention's ``chunk_linear_attn(phi_q, phi_k, v, scale=1.0, normalize=True)``
    (inputs [B, T, H, m]) on those same precomputed features; compare it with ``linear_causal``. ``not installed``
    when ``fla.ops.linear_attn`` does not import, ``needs CUDA`` on CPU.
Training (batch 1, forward + backward + AdamW step, fp32 weights under bf16 autocast on CUDA): a GPT-2-small-shaped
causal LM (hidden 768, 12 layers, 12 heads, vocab 50257) as ``PerformerForCausalLM`` (m = 256),
``LinformerForCausalLM`` (k = 256) and transformers' ``GPT2LMHeadModel`` (``attn_implementation="sdpa"``); a
BERT-base-shaped MLM as ``PerformerForMaskedLM``, ``LinformerForMaskedLM`` and ``BertForMaskedLM`` (sdpa). No
dropout anywhere; our models run their attention's default backend.

Timing: CUDA events, ``--warmup`` untimed runs then the median of ``--repeats`` (attention) or ``--steps``
(training). Peak memory: ``torch.cuda.reset_peak_memory_stats`` / ``max_memory_allocated`` per configuration; for
attention the peak above what was allocated before the first call (inputs, the upstream gradient and any
projection already exist), for training the whole peak (weights, AdamW state, activations) of the timed steps.
OOM is caught and recorded (``oom``); longer lengths of that configuration are then skipped. Every kernel / model
runs in its own subprocess (``--no-isolate`` to run in-process), all its lengths in one, so a crash or a wedged
kernel loses one row. Ratios (ours vs SDPA, ours vs GPT-2 / BERT) come from one run; the JSON is rewritten
after every row, and ``--only attention`` / ``--only training`` replace just their section of an existing file.

CPU smoke mode: ``--device cpu`` times with ``time.perf_counter``, runs float32 throughout (no autocast), and
records no memory (the CUDA memory stats have no CPU counterpart here); ``--quick`` shrinks to lengths 64, 128,
m = k = 32, tiny models (hidden 64, 2 layers, 4 heads, vocab 1000), one thread, one warm-up and one timed run,
in-process (the attention layer keeps its 12 x 64 shape). The targets (issue 31) are H100 targets: on CPU they print as
``not measured``. GPU figures: benchmarks/README.md, section "GPU", from benchmarks/results/h100/ and h200/

    pip install -e .[gpu]           # flash-linear-attention (fla-core, Triton) and matplotlib, both optional
    python benchmarks/gpu.py                                         # 1K .. 64K, attention then training
    python benchmarks/gpu.py --only attention --lengths 4096 16384 65536
    python benchmarks/gpu.py --only training --models gpt2 performer_clm --lengths 16384
    python benchmarks/gpu.py --device cpu --quick --out /tmp/gpu    # smoke run, ~10 s

Outputs: ``<out>/gpu.json`` (header: device, versions, command, commit; rows; ratios; targets) and
``<out>/gpu.png`` (skipped with a note when matplotlib is missing); ``<out>`` defaults to benchmarks/results.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
HEADS, DIM = 12, 64
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
QUICK_LENGTHS = [64, 128]
GPT2_SHAPE = dict(hidden=768, layers=12, heads=12, intermediate=3072, vocab=50257, m=256, k=256)
BERT_SHAPE = dict(hidden=768, layers=12, heads=12, intermediate=3072, vocab=30522, m=256, k=256)
HEDGEHOG_M, HYBRID_WINDOW = 128, 64  # the learned map's features and the hybrids' window (one sink)
QUICK_SHAPE = dict(hidden=64, layers=2, heads=4, intermediate=256, vocab=1000, m=32, k=32)
MODELS = ("gpt2", "performer_clm", "linformer_clm", "bert", "performer_mlm", "linformer_mlm")
REFERENCE_MODEL = {"performer_clm": "gpt2", "linformer_clm": "gpt2", "performer_mlm": "bert", "linformer_mlm": "bert"}
CPU_MEMORY_NOTE = "peak memory not measured on CPU (CUDA memory stats only)"


# ----------------------------------------------------------------------------------------------- configurations


def _backends(fn, names) -> list[str]:
    """``auto`` (no backend= argument) and, when ``fn`` takes ``backend=``, each candidate name."""
    return ["auto", *names] if "backend" in inspect.signature(fn).parameters else ["auto"]


def attention_kernels() -> list[str]:
    from linearformers.ops import (
        causal_linformer_attention,
        favor_attention,
        hybrid_attention,
        linear_attention,
        linformer_attention,
    )
    from linearformers.ops.backends import BIDIRECTIONAL_BACKENDS, CAUSAL_BACKENDS
    from linearformers.ops.hybrid import HYBRID_BACKENDS
    from linearformers.ops.linformer import BACKENDS as LINFORMER_BACKENDS
    from linearformers.ops.linformer import CAUSAL_BACKENDS as LINFORMER_CAUSAL_BACKENDS

    # "auto" is backend=None
    return [
        "sdpa",
        "sdpa_causal",
        *(f"favor/{b}" for b in _backends(favor_attention, BIDIRECTIONAL_BACKENDS)),
        *(f"favor_causal/{b}" for b in _backends(favor_attention, CAUSAL_BACKENDS)),
        *(f"linformer/{b}" for b in _backends(linformer_attention, LINFORMER_BACKENDS)),
        "linformer_hybrid",
        *(f"linformer_causal/{b}" for b in _backends(causal_linformer_attention, LINFORMER_CAUSAL_BACKENDS)),
        *(f"linear_causal/{b}" for b in _backends(linear_attention, CAUSAL_BACKENDS)),
        *(f"hedgehog/{b}" for b in _backends(linear_attention, ("chunked", "triton"))),
        *(f"hedgehog_causal/{b}" for b in _backends(linear_attention, CAUSAL_BACKENDS)),
        "hybrid",
        *(f"hybrid_causal/{b}" for b in _backends(hybrid_attention, HYBRID_BACKENDS)),
        # the peer last: fla's kernels autotune on first use (over 120 s on a cold H200), which a run cut by its time
        # limit should spend after our rows
        "fla_causal",
    ]


def _sdpa_reference(name: str) -> str:
    return "sdpa_causal" if "causal" in name else "sdpa"


class Unavailable(Exception):
    """A configuration that cannot run here at all (not installed, wrong device): recorded, not an error."""


def _fla_call():
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError as err:
        raise Unavailable(f"not installed ({err.__class__.__name__}: {err})") from None
    kwargs = {"scale": 1.0, "normalize": True}  # the features carry their own scale; normalize = FAVOR+'s D^-1
    if "head_first" in inspect.signature(chunk_linear_attn).parameters:
        kwargs["head_first"] = False  # fla < 0.2 defaulted to [B, H, T, K]
    return lambda pq, pk, v: chunk_linear_attn(pq, pk, v, **kwargs)[0]


def _favor_feature_inputs(q, k, m: int, device: str, dtype: torch.dtype):
    """FAVOR+ features of q and k, (B, H, T, m) in ``dtype``, computed without gradients (not part of the timing):
    the shared input of the ``linear_causal`` and ``fla_causal`` rows."""
    from linearformers.ops import draw_random_features, favor_features

    w = draw_random_features(m, DIM, seed=0, device=device)
    with torch.no_grad():
        return favor_features(q, w, is_query=True).to(dtype), favor_features(k, w, is_query=False).to(dtype)


def build_attention(name: str, n: int, device: str, dtype: torch.dtype, m: int, k_proj: int):
    """(fn, inputs, upstream gradient) for one kernel at length n; fn(*inputs) is one forward."""
    from linearformers.ops import (
        HedgehogFeatureMap,
        causal_linformer_attention,
        draw_random_features,
        favor_attention,
        hybrid_attention,
        linear_attention,
        linformer_attention,
        linformer_hybrid_attention,
    )

    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, grad=True):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_(grad)

    q, k, v = (randn(1, HEADS, n, DIM) for _ in range(3))
    family, _, backend = name.partition("/")
    extra = {} if backend in ("", "auto") else {"backend": backend}
    if family.startswith("sdpa"):
        causal = family == "sdpa_causal"
        if device == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def fn(q, k, v):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        else:

            def fn(q, k, v):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    elif family.startswith("favor"):
        w = draw_random_features(m, DIM, seed=0, device=device)
        causal = family == "favor_causal"

        def fn(q, k, v):
            return favor_attention(q, k, v, w, causal=causal, **extra)

    elif family.startswith("linformer"):
        kp = min(k_proj, n)
        e, f = (randn(kp, n, grad=False) / math.sqrt(kp) for _ in range(2))
        if family == "linformer":

            def fn(q, k, v):
                return linformer_attention(q, k, v, e, f, **extra)

        elif family == "linformer_hybrid":
            gamma = torch.ones(HEADS, device=device)

            def fn(q, k, v):
                return linformer_hybrid_attention(q, k, v, e, f, gamma, 64, sinks=1)

        else:

            def fn(q, k, v):
                return causal_linformer_attention(q, k, v, e, f, **extra)

    elif family == "linear_causal":
        pq, pk = _favor_feature_inputs(q, k, m, device, dtype)  # precomputed and not timed, as for fla
        q, k = pq.requires_grad_(), pk.requires_grad_()

        def fn(pq, pk, v):
            return linear_attention(pq, pk, v, causal=True, **extra)

    elif family in ("hedgehog", "hedgehog_causal", "hybrid", "hybrid_causal"):
        # the learned map (m = HEDGEHOG_M) computed inside the timing; the hybrids add an exact window of
        # HYBRID_WINDOW and one sink in the same normalizer
        fmap = HedgehogFeatureMap(HEADS, DIM, HEDGEHOG_M, device=device)
        gamma = torch.ones(HEADS, device=device)
        causal = family.endswith("_causal")

        if family.startswith("hedgehog"):

            def fn(q, k, v):
                phi_q, phi_k = fmap(q, is_query=True), fmap(k, is_query=False)
                return linear_attention(phi_q, phi_k, v, causal=causal, **extra)

        else:

            def fn(q, k, v):
                phi_q, phi_k = fmap(q, is_query=True), fmap(k, is_query=False)
                return hybrid_attention(q, k, v, phi_q, phi_k, gamma, HYBRID_WINDOW, causal=causal, sinks=1, **extra)

    elif family == "fla_causal":
        call = _fla_call()
        if device != "cuda":
            raise Unavailable("needs CUDA (Triton kernels)")
        pq, pk = _favor_feature_inputs(q, k, m, device, dtype)  # precomputed and not timed
        # fla's layout is [B, T, H, m]
        pq, pk = (t.transpose(1, 2).contiguous() for t in (pq, pk))
        q, k, v = pq.requires_grad_(), pk.requires_grad_(), v.detach().transpose(1, 2).contiguous().requires_grad_()
        fn = call
    else:
        raise ValueError(f"unknown attention kernel {name!r}")
    out_shape = v.shape  # every kernel returns v's shape (fla: [B, T, H, d])
    return fn, (q, k, v), torch.randn(*out_shape, generator=gen).to(device=device, dtype=dtype)


def build_model(name: str, n: int, shape: dict):
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    from linearformers import (
        LinformerConfig,
        LinformerForCausalLM,
        LinformerForMaskedLM,
        PerformerConfig,
        PerformerForCausalLM,
        PerformerForMaskedLM,
    )

    if name == "gpt2":
        config = GPT2Config(
            vocab_size=shape["vocab"],
            n_embd=shape["hidden"],
            n_layer=shape["layers"],
            n_head=shape["heads"],
            n_inner=shape["intermediate"],
            n_positions=max(n, 1024),
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=shape["vocab"] - 1,
            eos_token_id=shape["vocab"] - 1,
            attn_implementation="sdpa",
        )
        return GPT2LMHeadModel(config)
    common = dict(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        intermediate_size=shape["intermediate"],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=max(n, 512),
    )
    if name == "bert":
        return BertForMaskedLM(BertConfig(**common, attn_implementation="sdpa"))
    causal = name.endswith("_clm")
    if name.startswith("performer"):
        config = PerformerConfig(**common, is_decoder=causal, num_features=shape["m"], feature_redraw_interval=None)
        return (PerformerForCausalLM if causal else PerformerForMaskedLM)(config)
    if name.startswith("linformer"):
        config = LinformerConfig(**common, is_decoder=causal, projected_length=min(shape["k"], n), max_seq_length=n)
        return (LinformerForCausalLM if causal else LinformerForMaskedLM)(config)
    raise ValueError(f"unknown model {name!r}")


# ------------------------------------------------------------------------------------------------- measurement


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and ("out of memory" in str(err) or "can't allocate memory" in str(err))


class Meter:
    """Wall time of one call (CUDA events or perf_counter) and peak memory over a block of calls."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def time(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def reset(self) -> int:
        if not self.cuda:
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak_mb(self, base: int) -> float | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20


def _free(device: str, failed: bool) -> None:
    if device == "cuda" or failed:  # gc.collect costs ~0.2 s with transformers loaded: not per row on CPU
        gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure_attention(name: str, n: int, s: argparse.Namespace) -> dict:
    fn, inputs, grad = build_attention(name, n, s.device, s.dtype, s.m, s.k)
    meter = Meter(s.device)
    base = meter.reset()

    def once():
        fn(*inputs).backward(grad)
        for t in inputs:
            t.grad = None

    times = [meter.time(once) for _ in range(s.warmup + s.repeats)][s.warmup :]
    seconds = statistics.median(times)
    return {"status": "ok", "seconds": seconds, "times": times, "peak_mb": meter.peak_mb(base)}


def measure_training(name: str, n: int, s: argparse.Namespace) -> dict:
    shape = s.shape if s.quick else (GPT2_SHAPE if name in ("gpt2", "performer_clm", "linformer_clm") else BERT_SHAPE)
    torch.manual_seed(0)
    model = build_model(name, n, shape).to(s.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, shape["vocab"] - 1, (1, n), device=s.device)
    if name.endswith("_clm") or name == "gpt2":
        labels = ids  # the models shift internally
    else:
        labels = torch.full_like(ids, -100)
        labels[:, ::7] = ids[:, ::7]  # ~15% of positions carry a label, as in MLM
    meter = Meter(s.device)

    def step():
        with torch.autocast(device_type=s.device, dtype=torch.bfloat16, enabled=s.device == "cuda"):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(max(s.warmup, 1)):  # at least one: AdamW's state exists before memory is counted
        step()
    meter.reset()
    times = [meter.time(step) for _ in range(s.steps)]
    peak = meter.peak_mb(0)  # everything: weights, AdamW state, activations
    seconds = statistics.median(times)
    params = sum(p.numel() for p in model.parameters())
    return {"status": "ok", "seconds": seconds, "times": times, "tokens_per_s": n / seconds, "peak_mb": peak,
            "parameters": params}  # fmt: skip


def rows_for(section: str, name: str, s: argparse.Namespace):
    """Yield (n, row) for every length, smallest first; after an OOM the longer lengths are skipped."""
    measure = measure_attention if section == "attention" else measure_training
    stop = None
    for i, n in enumerate(s.lengths):
        if stop:
            yield n, {"status": stop}
            continue
        row, failure = None, None
        try:
            row = measure(name, n, s)
        except Unavailable as err:
            failure = ("unavailable", str(err))
        except Exception as err:  # recorded per row; the sweep goes on
            if _is_oom(err):
                failure = ("oom", "out of memory")
            else:
                refused = i == 0 and isinstance(err, (ValueError, TypeError, NotImplementedError))
                text = str(err).strip().splitlines()
                failure = (
                    "unavailable" if refused else "error",
                    f"{err.__class__.__name__}: {text[0][:300] if text else ''}",
                )
        _free(s.device, failure is not None)  # outside the except block, so the traceback's tensors are gone
        if failure:
            status, message = failure
            row = {"status": status, "message": message}
            if status == "oom":
                stop = f"skipped (oom at n={n})"
            elif status == "unavailable":
                row["status"] = stop = "not installed" if message.startswith("not installed") else status
        yield n, row


def worker(section: str, name: str, s: argparse.Namespace) -> None:
    for n, row in rows_for(section, name, s):
        print("ROW " + json.dumps({"n": n, **row}), flush=True)


def run_config(section: str, name: str, s: argparse.Namespace, argv: list[str]) -> dict[str, dict]:
    """All lengths of one kernel / model: in a subprocess (``--isolate``) or here."""
    if not s.isolate:
        return {str(n): row for n, row in rows_for(section, name, s)}
    cmd = [sys.executable, __file__, *argv, "--worker", section, name, "--lengths", *map(str, s.lengths)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=s.timeout)
        ended = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        ended = f"timeout after {s.timeout} s"
    rows = {}
    for line in out.splitlines():
        if line.startswith("ROW "):
            row = json.loads(line[4:])
            rows[str(row.pop("n"))] = row
    tail = (err.strip().splitlines() or [""])[-1][:300]
    for n in s.lengths:
        rows.setdefault(str(n), {"status": "failed", "message": f"{ended}: {tail}"})
    return rows


# --------------------------------------------------------------------------------------------------- reporting


def attention_ratios(rows: dict) -> dict:
    out = {}
    for name, by_n in rows.items():
        if name.startswith("sdpa"):
            continue
        ref = rows.get(_sdpa_reference(name), {})
        for n, row in by_n.items():
            base = ref.get(n, {})
            if row.get("status") == "ok" and base.get("status") == "ok":
                entry = {"speedup_vs_sdpa": base["seconds"] / row["seconds"]}
                if row.get("peak_mb") is not None and base.get("peak_mb"):
                    entry["memory_vs_sdpa"] = row["peak_mb"] / base["peak_mb"]
                out.setdefault(name, {})[n] = entry
    return out


def training_ratios(rows: dict) -> dict:
    out = {}
    for name, ref_name in REFERENCE_MODEL.items():
        for n, row in rows.get(name, {}).items():
            base = rows.get(ref_name, {}).get(n, {})
            if row.get("status") == "ok" and base.get("status") == "ok":
                entry = {f"tokens_per_s_vs_{ref_name}": row["tokens_per_s"] / base["tokens_per_s"]}
                if row.get("peak_mb") is not None and base.get("peak_mb"):
                    entry[f"memory_vs_{ref_name}"] = row["peak_mb"] / base["peak_mb"]
                out.setdefault(name, {})[n] = entry
    return out


# Issue 31's H100 targets: (kernel prefix, length, least speedup vs SDPA of the same masking, most memory vs SDPA's)
ATTENTION_TARGETS = [
    ("favor_causal/", 4096, 1.0, 2.0),
    ("favor_causal/", 16384, 3.0, 2.0),
    ("favor_causal/", 65536, 10.0, 2.0),
    ("favor/", 16384, 3.0, None),
    ("hedgehog", 16384, 3.0, None),
    ("linformer", 4096, 2.0, None),
    ("linformer", 16384, 5.0, None),
    ("hybrid_causal", 16384, 1.5, None),
    ("hybrid_causal", 65536, 5.0, None),
    ("linformer_hybrid", 16384, 1.0, None),
]
# (model, reference model, length, least tokens/s ratio); peak training memory at most the reference's
TRAINING_TARGETS = [("performer_clm", "gpt2", 16384, 1.3), ("performer_clm", "gpt2", 65536, 2.5),
                    ("linformer_mlm", "bert", 16384, 1.2)]  # fmt: skip


def _matches(name: str, prefix: str) -> bool:
    return name.startswith(prefix) if prefix.endswith("/") else name == prefix or name.startswith(prefix + "/")


def targets(result: dict) -> list[dict]:
    """The H100 targets of issue 31, each met / MISSED / not measured: the best row of each kernel family
    (e.g. the fastest backend of ``favor_causal/``) against SDPA of the same masking."""
    att = result.get("attention", {}).get("rows", {})
    trn = result.get("training", {}).get("rows", {})
    found = []

    def add(target, measured, ok):
        verdict = "not measured" if ok is None else ("met" if ok else "MISSED")
        found.append({"target": target, "measured": measured, "verdict": verdict})

    for prefix, n, speed_min, mem_max in ATTENTION_TARGETS:
        base = att.get(_sdpa_reference(prefix), {}).get(str(n), {})
        rows = {name: by_n.get(str(n), {}) for name, by_n in att.items() if _matches(name, prefix)}
        ok_rows = {name: row for name, row in rows.items() if row.get("status") == "ok"}
        label = f"{prefix.rstrip('/')} fwd+bwd >= {speed_min}x SDPA at {n}" + (
            f", peak memory <= {mem_max}x SDPA's" if mem_max else ""
        )
        if not ok_rows or base.get("status") != "ok" or base.get("peak_mb") is None:
            add(label, f"{len(ok_rows)} rows ok / SDPA {base.get('status', 'not run')}", None)
            continue
        name, row = min(ok_rows.items(), key=lambda item: item[1]["seconds"])
        speed = base["seconds"] / row["seconds"]
        mem = row["peak_mb"] / base["peak_mb"] if base["peak_mb"] else float("inf")
        ok = speed >= speed_min and (mem_max is None or mem <= mem_max)
        add(label, f"{name}: {speed:.2f}x, memory {mem:.2f}x SDPA's", ok)
    for name, ref_name, n, want in TRAINING_TARGETS:
        row, base = trn.get(name, {}).get(str(n), {}), trn.get(ref_name, {}).get(str(n), {})
        label = f"{name} training step at {n} >= {want}x {ref_name} tokens/s, peak memory <= {ref_name}'s"
        if row.get("status") != "ok" or base.get("status") != "ok" or base.get("peak_mb") is None:
            add(label, f"{row.get('status', 'not run')} / {ref_name} {base.get('status', 'not run')}", None)
            continue
        got = row["tokens_per_s"] / base["tokens_per_s"]
        measured = f"{got:.2f}x ({row['tokens_per_s']:.0f} vs {base['tokens_per_s']:.0f} tok/s), "
        measured += f"{row['peak_mb']:.0f} vs {base['peak_mb']:.0f} MB"
        add(label, measured, got >= want and row["peak_mb"] <= base["peak_mb"])
    return found


def _cell_time(row: dict, ratio: float | None) -> str:
    if row.get("status") != "ok":
        return row.get("status", "-")
    return f"{row['seconds'] * 1e3:.2f} ms" + (f" ({ratio:.2f}x)" if ratio is not None else "")


def _cell_mem(row: dict, ratio: float | None) -> str:
    if row.get("status") != "ok":
        return row.get("status", "-")
    if row.get("peak_mb") is None:
        return "n/a"
    return f"{row['peak_mb']:.0f} MB" + (f" ({ratio:.2f})" if ratio is not None else "")


def _table(title: str, rows: dict, lengths: list[str], cell) -> None:
    print(f"\n{title}\n")
    print("| | " + " | ".join(lengths) + " |")
    print("|---" + "|---:" * len(lengths) + "|")
    for name, by_n in rows.items():
        print(f"| {name} | " + " | ".join(cell(name, n, by_n.get(n, {})) for n in lengths) + " |")


def report(result: dict) -> None:
    header = result["header"]
    print(f"\ndevice: {header['device']}; torch {header['torch']}, transformers {header['transformers']}, "
          f"fla {header['fla']}")  # fmt: skip
    if header["device_type"] == "cpu":
        print(f"note: CPU run, time.perf_counter timing, float32, {CPU_MEMORY_NOTE}")
    if "attention" in result:
        sec = result["attention"]
        rows, ratios = sec["rows"], sec["ratios"]
        lengths = sorted({n for by_n in rows.values() for n in by_n}, key=int)
        _table(
            f"Attention, forward + backward ({sec['dtype']}): median time (speedup vs SDPA of the same masking)",
            rows,
            lengths,
            lambda name, n, row: _cell_time(row, ratios.get(name, {}).get(n, {}).get("speedup_vs_sdpa")),
        )
        _table(
            "Attention peak memory above inputs (ratio to SDPA of the same masking)",
            rows,
            lengths,
            lambda name, n, row: _cell_mem(row, ratios.get(name, {}).get(n, {}).get("memory_vs_sdpa")),
        )
    if "training" in result:
        sec = result["training"]
        rows, ratios = sec["rows"], sec["ratios"]
        lengths = sorted({n for by_n in rows.values() for n in by_n}, key=int)

        def tok(name, n, row):
            if row.get("status") != "ok":
                return row.get("status", "-")
            ref = REFERENCE_MODEL.get(name)
            ratio = ratios.get(name, {}).get(n, {}).get(f"tokens_per_s_vs_{ref}")
            return f"{row['tokens_per_s']:.0f}" + (f" ({ratio:.2f}x {ref})" if ratio is not None else "")

        _table(
            f"Training step ({sec['precision']}, AdamW, batch 1): tokens/s (ratio to GPT-2 / BERT)", rows, lengths, tok
        )
        _table("Training step peak memory", rows, lengths, lambda name, n, row: _cell_mem(row, None))
    print("\nTargets (H100):")
    for t in result["targets"]:
        print(f"  {t['target']}: {t['measured']} -> {t['verdict']}")


def plot(result: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib not installed (pip install matplotlib)"
    panels = []
    if "attention" in result:
        panels += [("attention", "seconds", "attention fwd+bwd seconds"), ("attention", "peak_mb", "attention peak MB")]
    if "training" in result:
        panels += [("training", "tokens_per_s", "training tokens/s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (section, key, label) in zip(axes[0], panels):
        for name, by_n in result[section]["rows"].items():
            pts = [(int(n), r[key]) for n, r in by_n.items() if r.get("status") == "ok" and r.get(key) is not None]
            if pts:
                pts.sort()
                ax.plot([p[0] for p in pts], [max(p[1], 1e-6) for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    header = result["header"]
    fig.suptitle(f"{header['device']} (torch {header['torch']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"written: {path}"


def make_header(s: argparse.Namespace) -> dict:
    import transformers

    import linearformers

    if s.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    else:
        device = f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    try:
        from importlib.metadata import version

        fla = version("fla-core")
    except Exception:
        try:
            import fla

            fla = getattr(fla, "__version__", "installed")
        except ImportError:
            fla = "not installed"
    try:  # BENCH_COMMIT: a copy of the tree whose .git is not the tree's own (a lent GPU machine) says it
        commit = (
            os.environ.get("BENCH_COMMIT")
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).parent,
            ).stdout.strip()
        )
    except Exception:
        commit = "unknown"
    return {
        "device": device,
        "device_type": s.device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "linearformers": linearformers.__version__,
        "fla": fla,
        "python": platform.python_version(),
        "commit": commit,
        "load_average_before": list(os.getloadavg()),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/gpu.py " + " ".join(sys.argv[1:]),
        "timing": "CUDA events" if s.device == "cuda" else "time.perf_counter",
        "memory": "torch.cuda.max_memory_allocated" if s.device == "cuda" else CPU_MEMORY_NOTE,
    }


# ------------------------------------------------------------------------------------------------------- main


def parse(argv=None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="lengths 64 128, tiny models, in-process")
    parser.add_argument("--lengths", type=int, nargs="+", help=f"default {LENGTHS}")
    parser.add_argument("--only", choices=("attention", "training"), help="run one section, keep the other's JSON")
    parser.add_argument("--kernels", nargs="+", help="attention kernels to run (default: all found)")
    parser.add_argument("--models", nargs="+", choices=MODELS, help="training models to run (default: all)")
    parser.add_argument("--warmup", type=int, help="untimed runs first (default 2; quick 1)")
    parser.add_argument("--repeats", type=int, help="timed attention runs, median reported (default 5; quick 1)")
    parser.add_argument("--steps", type=int, help="timed training steps, median reported (default 3; quick 1)")
    parser.add_argument("--threads", type=int, help="CPU threads with --device cpu (default 2; quick 1)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per kernel / model subprocess")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, help="default: on, off with --quick")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of gpu.json and gpu.png")
    parser.add_argument("--worker", nargs=2, metavar=("SECTION", "NAME"), help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else list(argv)
    s = parser.parse_args(raw)
    # what a worker subprocess needs of the command line: everything but the selection and outputs
    s.threads = s.threads or (1 if s.quick else 2)  # quick: 1, as spinning OpenMP threads crawl on a busy box
    forward = ["--device", s.device, "--threads", str(s.threads)] + (["--quick"] if s.quick else [])
    s.lengths = s.lengths or (QUICK_LENGTHS if s.quick else LENGTHS)
    s.warmup = s.warmup if s.warmup is not None else (1 if s.quick else 2)
    s.repeats = s.repeats if s.repeats is not None else (1 if s.quick else 5)
    s.steps = s.steps if s.steps is not None else (1 if s.quick else 3)
    s.isolate = (not s.quick) if s.isolate is None else s.isolate
    forward += ["--warmup", str(s.warmup), "--repeats", str(s.repeats), "--steps", str(s.steps)]
    s.dtype = torch.bfloat16 if s.device == "cuda" else torch.float32
    s.shape = QUICK_SHAPE if s.quick else None
    # attention m and k; the layer keeps its 12 x 64 shape in quick mode
    s.m = s.k = 32 if s.quick else 256
    if s.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --device cpu --quick for a smoke run")
    if s.device == "cpu":
        torch.set_num_threads(s.threads)
    return s, forward


def main(argv=None) -> None:
    s, forward = parse(argv)
    if s.worker:
        worker(s.worker[0], s.worker[1], s)
        return
    s.out.mkdir(parents=True, exist_ok=True)
    path = s.out / "gpu.json"
    previous = json.loads(path.read_text()) if (s.only and path.exists()) else {}
    result = {"header": make_header(s)}
    for section in ("attention", "training"):
        if s.only and s.only != section and section in previous:
            result[section] = previous[section]  # kept from an earlier run; its own command is recorded in it
    sections = [s.only] if s.only else ["attention", "training"]
    print(f"{result['header']['device']}: lengths {s.lengths}, isolate={s.isolate}", flush=True)
    for section in sections:
        if section == "attention":
            found = attention_kernels()
            unknown = sorted(set(s.kernels or ()) - set(found))
            if unknown:
                sys.exit(f"--kernels: unknown {unknown}; this checkout has {found}")
            names = s.kernels or found
            meta = {"dtype": str(s.dtype).replace("torch.", ""), "heads": HEADS, "head_dim": DIM, "batch": 1,
                    "m": s.m, "k": s.k, "fla_call": "chunk_linear_attn(phi_q, phi_k, v, scale=1.0, normalize=True)",
                    "linear_call": "linear_attention(phi_q, phi_k, v, causal=True, backend=...)"}  # fmt: skip
        else:
            names = s.models or list(MODELS)
            precision = "fp32 weights, bf16 autocast" if s.device == "cuda" else "float32, no autocast"
            shapes = {"quick": QUICK_SHAPE} if s.quick else {"gpt2": GPT2_SHAPE, "bert": BERT_SHAPE}
            meta = {"precision": precision, "shapes": shapes, "batch": 1, "optimizer": "AdamW(lr=1e-4)"}
        sec = result[section] = {**meta, "command": result["header"]["command"], "rows": {}, "ratios": {}}
        for name in names:
            t0 = time.perf_counter()
            sec["rows"][name] = run_config(section, name, s, forward)
            shown = ", ".join(
                f"{n}: {r['seconds'] * 1e3:.2f} ms" if r.get("status") == "ok" else f"{n}: {r['status']}"
                for n, r in sec["rows"][name].items()
            )
            print(f"{section:9s} {name:28s} {shown}  [{time.perf_counter() - t0:.1f} s]", flush=True)
            sec["ratios"] = (attention_ratios if section == "attention" else training_ratios)(sec["rows"])
            result["targets"] = targets(result)
            path.write_text(json.dumps(result, indent=2))  # after every row: a killed run keeps what it measured
    result["targets"] = targets(result)
    report(result)
    result["header"]["plot"] = plot(result, s.out / "gpu.png")
    print(f"\nplot: {result['header']['plot']}\njson: {path}")
    path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
