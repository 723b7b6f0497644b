"""The native CPU kernels: causal FAVOR+ (favor_causal.cpp) and the bidirectional hybrid's inference
(hybrid_bidirectional.cpp), on the GEMM tile of tile.h. Compiled into one library with the system's C++ compiler at
first use, cached, and loaded with ctypes. No build step at install time and no torch headers: a plain shared
library on float32 pointers, built in a few seconds. Used on x86-64 Linux CPUs with AVX2 and FMA. Causal FAVOR+:
float32 work with head_dim, num_features and chunk_size multiples of 16 (``available()`` and ``supports()``);
everything else takes the portable chunked backend (``_favor_chunked``; the choice is made in ``backends``). Feature
map "features" takes precomputed nonnegative feature maps phi(q), phi(k) (b, h, n, m) in place of q, k and a
projection (see ``_linear_native``). The hybrid: :func:`hybrid_bidirectional_forward`, whose refusals
``ops/hybrid.py`` gives.

``LINEARFORMERS_NATIVE=0`` turns it off; ``LINEARFORMERS_CACHE`` moves the build cache (default
``$XDG_CACHE_HOME/linearformers`` or ``~/.cache/linearformers``).

A cached library is loaded only after it is checked against the size and SHA-256 written beside it
(``native-<digest>.so.sha256``) at build time: mapping a truncated library (a full disk, a killed copy, a
bad sync of a shared home) raises SIGBUS in the process that touches the missing pages, and every later process
would load the same file. A library that fails the check, or has no record, is rebuilt, with a warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("favor_causal.cpp", "hybrid_bidirectional.cpp")]
_HEADER = Path(__file__).with_name("tile.h")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno"]
_LOCK = threading.Lock()
_STATE: dict = {}  # "lib": the loaded library or None when unavailable; "pool": the worker threads
# default chunks per saved state (512 positions at chunk 32): forward keeps the state at each block start until
# backward ends, so fewer, wider blocks keep less memory, and backward rebuilds a block's states from its start
_BLOCK_CHUNKS = 16
# hybrid_bidirectional.cpp's BLK: the walk's blocks of queries and keys, the far blocks it can choose among
HYBRID_BLOCK = 32
# favor_causal.cpp's codes for the feature map fused into its tiles, or "features" given precomputed
MAP_CODES = {"softmax": 0, "relu": 1, "features": 2}


def _map_code(feature_map: str) -> int:
    if feature_map not in MAP_CODES:
        raise ValueError(f"unknown native feature map {feature_map!r}; choose one of {sorted(MAP_CODES)}")
    return MAP_CODES[feature_map]


def _check_features(q, k, v) -> None:
    """Feature map "features": phi(q), phi(k) (b, h, n, m) alike and v (b, h, n, d); the library trusts these shapes."""
    if k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"features mode takes phi_q, phi_k (b, h, n, m) and v (b, h, n, d), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )


def _block_chunks(block_chunks) -> int:
    """Chunks per saved state: ``_BLOCK_CHUNKS`` (read at call time) when None, else a positive int."""
    if block_chunks is None:
        return _BLOCK_CHUNKS
    if isinstance(block_chunks, bool) or not isinstance(block_chunks, int) or block_chunks <= 0:
        raise ValueError(f"block_chunks must be a positive int, got {block_chunks!r}")
    return block_chunks


def _cpu_supported() -> bool:
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma"} <= set(flags.split())


def _cache_dir() -> Path:
    if os.environ.get("LINEARFORMERS_CACHE"):
        return Path(os.environ["LINEARFORMERS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "linearformers"


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ / c++ / $CXX) on PATH")
    source = b"".join(path.read_bytes() for path in (*_SOURCES, _HEADER))
    digest = hashlib.sha256(source + " ".join([compiler, *_FLAGS]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"native-{digest}.so"
    if target.exists():
        problem = _verify(target)
        if problem is None:
            return target
        logger.warning("linearformers: cached native kernel %s %s; rebuilding it", target, problem)
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent processes (DDP ranks) never load a half-written file, and a
    # process that already mapped an older copy keeps its own inode
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    fd, partial_record = tempfile.mkstemp(suffix=".sha256", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, *map(str, _SOURCES), "-o", partial], check=True, capture_output=True, timeout=300
        )
        _fsync(partial)
        Path(partial_record).write_text(_record(Path(partial).read_bytes()))
        _fsync(partial_record)
        # a process that checks between the two renames sees a mismatch and rebuilds too: seconds, never a bad load
        os.replace(partial, target)
        os.replace(partial_record, _record_path(target))
        _fsync(target.parent, directory=True)
    finally:
        for leftover in (partial, partial_record):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return target


def _record_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _record(data: bytes) -> str:
    """The check written beside a library: its size in bytes and its SHA-256."""
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}\n"


def _verify(library: Path) -> str | None:
    """None when ``library`` matches the size and SHA-256 recorded beside it, else what is wrong."""
    try:
        expected = _record_path(library).read_text()
    except OSError:
        return "has no size / checksum record"
    try:
        data = library.read_bytes()
    except OSError as error:
        return f"cannot be read ({error})"
    if _record(data) != expected:
        return f"does not match its record ({len(data)} bytes; recorded: {expected.split(' ')[0]})"
    return None


def _fsync(path, directory: bool = False) -> None:
    """Flush a file, or a directory's entries, to disk; best effort for a directory, which not every OS opens."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def _load():
    lib = ctypes.CDLL(str(_build()))
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.lf_favor_causal_forward.argtypes = [p] * 12 + [i] * 10 + [f, f]
    lib.lf_favor_causal_backward.argtypes = [p] * 13 + [i] * 9 + [f, f]
    lib.lf_hybrid_bidirectional_forward.argtypes = [p] * 28 + [i] * 10 + [f, f, f]
    lib.lf_favor_causal_forward.restype = lib.lf_favor_causal_backward.restype = i
    lib.lf_hybrid_bidirectional_forward.restype = i
    return lib


def available() -> bool:
    """Whether the native kernels are built and loaded (building them on first call)."""
    if "lib" not in _STATE:
        with _LOCK:
            if "lib" not in _STATE:
                lib = None
                # the source is absent from Hub remote code (transformers copies .py files only): no kernel, quietly
                wanted = os.environ.get("LINEARFORMERS_NATIVE", "1") != "0" and all(
                    path.exists() for path in (*_SOURCES, _HEADER)
                )
                if wanted and _cpu_supported():
                    try:
                        lib = _load()
                    except Exception as error:  # no compiler, a failed build: the chunked backend runs instead
                        detail = getattr(error, "stderr", b"") or b""
                        logger.warning(
                            "linearformers: native CPU kernels unavailable (%s %s); using the PyTorch backends",
                            error,
                            detail.decode(errors="replace")[-500:],
                        )
                _STATE["lib"] = lib
    return _STATE["lib"] is not None


def supports(v: torch.Tensor, m: int, chunk: int) -> bool:
    """Whether the kernel runs this call: CPU tensors, head_dim, m and chunk multiples of 16 (its tile width)."""
    return v.device.type == "cpu" and v.shape[-1] % 16 == 0 and m % 16 == 0 and chunk % 16 == 0 and available()


def _reset_pool_in_child() -> None:
    _STATE.pop("pool", None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pool_in_child)


def _run(fn, rows: int) -> None:
    """fn(b0, b1) over [0, rows), split among torch.get_num_threads() threads (the GIL is released in C)."""
    workers = max(1, min(torch.get_num_threads(), rows))
    bounds = [rows * i // workers for i in range(workers + 1)]
    if workers == 1:
        codes = [fn(0, rows)]
    else:
        pool, size = _STATE.get("pool", (None, 0))
        if pool is None or size < workers - 1:
            if pool is not None:  # more threads asked for since: the old pool's idle threads end
                pool.shutdown(wait=False)
            pool = ThreadPoolExecutor(max_workers=workers - 1, thread_name_prefix="linearformers")
            _STATE["pool"] = (pool, workers - 1)
        futures = [pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, workers)]
        codes = [fn(bounds[0], bounds[1])] + [future.result() for future in futures]
    if 2 in codes:
        raise MemoryError("the native CPU kernel could not allocate its work space")
    if any(codes):
        raise RuntimeError(f"the native CPU kernel refused its arguments (codes {codes})")


def _launch(
    entry: str, tensors, rows: int, settings, counts: torch.Tensor | None = None, int64_at=(), strided_at=()
) -> None:
    """The library's ``entry`` on raw pointers to ``tensors`` (None for an absent mask) and then ``counts`` (int64,
    forward's lost positions), then ``b0, b1`` and ``settings``, over [0, rows) split among threads. It reads
    float32 memory (int64 at the places ``int64_at``) laid out contiguously (at the places ``strided_at``, its last
    dimension only, the entry taking the other strides), so anything else is refused here rather than misread
    there."""
    for i, t in enumerate(tensors):
        dtype = torch.int64 if i in int64_at else torch.float32
        packed = t is None or (t.stride(-1) == 1 if i in strided_at else t.is_contiguous())
        if t is not None and not (t.dtype == dtype and t.device.type == "cpu" and packed):
            raise ValueError(f"the native kernel takes contiguous {dtype} CPU tensors, got {t.dtype} {t.device}")
    if not available():
        raise RuntimeError("the native CPU kernels are unavailable on this machine")
    fn = getattr(_STATE["lib"], entry)
    pointers = [None if t is None else ctypes.c_void_p(t.data_ptr()) for t in tensors]
    if counts is not None:
        pointers.append(ctypes.c_void_p(counts.data_ptr()))
    _run(lambda b0, b1: fn(*pointers, b0, b1, *settings), rows)


def _geometry(q, k, v, w, feature_map):
    """(b, h, n, d, m, w as the kernel reads it): m from the features (feature map "features", w None) or from w."""
    b, h, n = q.shape[:3]
    if feature_map == "features":
        _check_features(q, k, v)
        return b, h, n, v.shape[-1], q.shape[-1], None
    return b, h, n, v.shape[-1], w.shape[0], w.contiguous()


def forward(
    q, k, v, w, key_weights, feature_map: str, scale: float, eps: float, chunk: int, n_valid: int, block_chunks=None
):
    """q, k, v: float32 contiguous (b, h, n, d), n a multiple of chunk; key_weights: float32 (b, n) or None.
    feature map "features": q, k are phi(q), phi(k) (b, h, n, m), m = q.shape[-1], and w is None (scale, eps unused).
    block_chunks: chunks per saved state, None for ``_BLOCK_CHUNKS``.
    Returns out (b, h, n, d), den (b, h, n, 1), starts (b h, blocks, m, d), zstarts (b h, blocks, m),
    S (b, h, m, d), z (b, h, m), the lost count (0-dim) and the spacing of the saved states in chunks, for
    backward."""
    code, per_block = _map_code(feature_map), _block_chunks(block_chunks)
    b, h, n, d, m, w = _geometry(q, k, v, w, feature_map)
    blocks = -(-(n // chunk) // per_block)
    new = lambda *shape: torch.empty(*shape, dtype=torch.float32)  # noqa: E731
    out, den = new(b, h, n, d), new(b, h, n, 1)
    starts, zstarts, s_final, z_final = new(b * h, blocks, m, d), new(b * h, blocks, m), new(b, h, m, d), new(b, h, m)
    lost = torch.zeros(b * h, dtype=torch.int64)
    tensors = (q, k, v, key_weights, w, out, den, starts, zstarts, s_final, z_final)
    settings = (h, n, n_valid, d, m, chunk, per_block, code, scale, eps)
    _launch("lf_favor_causal_forward", tensors, b * h, settings, counts=lost)
    return out, den, starts, zstarts, s_final, z_final, lost.sum(), per_block


def backward(
    q,
    k,
    v,
    w,
    key_weights,
    feature_map: str,
    scale: float,
    eps: float,
    chunk: int,
    g,
    out,
    den,
    starts,
    zstarts,
    per_block: int,
):
    """Gradients dq, dk, dv (float32, (b, h, n, d)) of forward's outputs; g: float32 contiguous like out.
    feature map "features": dq, dk are d phi(q), d phi(k) (b, h, n, m) (0 for padded keys), w is None."""
    code, per_block = _map_code(feature_map), _block_chunks(per_block)
    b, h, n, d, m, w = _geometry(q, k, v, w, feature_map)
    dq, dk = (torch.empty(q.shape, dtype=torch.float32) for _ in range(2))
    dv = torch.empty(b, h, n, d, dtype=torch.float32)
    tensors = (q, k, v, key_weights, w, g, out, den, starts, zstarts, dq, dk, dv)
    settings = (h, n, d, m, chunk, per_block, code, scale, eps)
    _launch("lf_favor_causal_backward", tensors, b * h, settings)
    return dq, dk, dv


def hybrid_bidirectional_forward(
    q,
    k,
    v,
    pq,
    pk,
    ell,
    gamma,
    valid,
    linear,
    sink,
    window: int,
    scale: float,
    headroom: float,
    hedgehog=None,
    query_form=None,
    key_form=None,
    bound: float = 1.0,
    lse: bool = False,
    chosen=None,
):
    """The bidirectional hybrid's output (b, h, n, d), float32: q, k, v (b, h, n, d) and pq, pk (b, h, n, m)
    float32; ell (b, h, n) or None; gamma (h,); valid, linear (b, n) bool; sink None or (keys, values (b, h, S, d),
    positions (b, S) int64, validity (b, S) bool), as ops/hybrid.py's _hybrid_core takes them. With ``hedgehog``
    = (W_q, b_q, W_k, b_k) ((h, d, m / 2), (h, m / 2)), pq and pk are None and the walk makes Hedgehog's features
    itself, a block at a time: no (n, m) feature tensors. ``query_form`` (a (h, d), b (h,)): ell_t = q_t·a_h + b_h
    made in the walk, in place of ell; ``key_form`` (a, b), with hedgehog: phi_k times exp(bound tanh((k_s·a_h +
    b_h) / bound)), made in the walk. With ``lse``, also each query's log normalizer (b, h, n, 1), as
    ops/hybrid.py's _hybrid_core gives it. ``chosen`` (b, h, nb, K) int64, nb = ceil(n / 32): the key blocks of
    32 each query block of 32 scores exactly (ops/far_blocks.py's choice with blocks of 32, -1 for none), or None."""
    b, h, n, d = q.shape
    contiguous = lambda x: None if x is None else x.float().contiguous()  # noqa: E731
    flags = lambda x: x.to(torch.float32).contiguous()  # noqa: E731
    # q, k, v are read in place, through their strides (a model's heads are views of its projections)
    q, k, v = (x.float() for x in (q, k, v))
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    strides = [torch.tensor([x.stride(0), x.stride(1), x.stride(2)], dtype=torch.int64) for x in (q, k, v)]
    if sink is None:
        sinks, sink_k, sink_v, sink_pos, sink_valid = 0, None, None, None, None
    else:
        sink_k, sink_v = contiguous(sink[0]), contiguous(sink[1])
        sink_pos, sink_valid, sinks = sink[2].long().contiguous(), flags(sink[3]), sink[0].shape[2]
    if hedgehog is None:
        map_code, m, maps = 0, pq.shape[-1], (None,) * 4
    else:
        map_code, m = 1, 2 * hedgehog[0].shape[-1]
        maps = tuple(contiguous(x) for x in hedgehog)
    forms = tuple(contiguous(x) for form in (query_form, key_form) for x in (form or (None, None)))
    # out laid out (b, n, h, d), as a model merges its heads: its (b, h, n, d) view is what returns
    out = torch.empty(b, n, h, d, dtype=torch.float32).transpose(1, 2)
    log_norm = torch.empty(b, h, n, 1, dtype=torch.float32) if lse else None
    if out.numel() == 0:  # no batch, head or position: nothing to walk (empty tensors have no data to point at)
        return (out, log_norm) if lse else out
    strides.append(torch.tensor([out.stride(0), out.stride(1), out.stride(2)], dtype=torch.int64))
    tensors = (
        q, k, v, *(contiguous(x) for x in (pq, pk, ell, gamma)), flags(valid), flags(linear),
        sink_k, sink_v, sink_pos, sink_valid, out, *strides[:3], *maps, *forms, strides[3], log_norm,
        None if chosen is None else chosen.long().reshape(b * h, *chosen.shape[2:]).contiguous(),
    )  # fmt: skip
    picks = 0 if chosen is None else chosen.shape[-1]
    settings = (h, n, d, m, window, sinks, map_code, picks, scale, headroom, bound)
    _launch(
        "lf_hybrid_bidirectional_forward",
        tensors,
        b * h,
        settings,
        int64_at={11, 14, 15, 16, 25, 27},
        strided_at={0, 1, 2, 13},
    )
    return (out, log_norm) if lse else out
