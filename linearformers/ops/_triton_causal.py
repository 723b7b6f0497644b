"""Causal linear attention as fused Triton kernels: the chunked form of :mod:`_favor_chunked`, with the state carried
in registers from chunk to chunk, and the FAVOR+ feature maps computed inside the kernels.

    out_t = Σ_{s <= t} (phi_q,t · phi_k,s) v_s / Σ_{s <= t} phi_q,t · phi_k,s         (padded keys left out)

Kernels (``_forward``, ``_backward_q``, ``_backward_kv``). The grid is (batch·heads, m / BM, d / BD): a program owns
one (BM, BD) block of the state S = Σ phi_k vᵀ (and BM entries of z = Σ phi_k), float32 in registers, and walks the
chunks of C positions in order. Per chunk it builds its BM features of the chunk's queries and keys (loaded, or
computed from q, k and BM rows of the projection: they never reach HBM), the intra-chunk scores tril(phi_q phi_kᵀ)
(C x C, partial over its BM features) in SRAM, and adds

    N += tril(phi_q phi_kᵀ) V + phi_q S,     D += rowsum(tril(phi_q phi_kᵀ)) + phi_q z

to float32 buffers with ``tl.atomic_add``: every m-block's share of N and D adds up to the whole (phi_q·phi_k is a
sum over features), so out = N / D afterwards, in a last small kernel (``_normalize``, which writes it in v's dtype
and counts the lost positions). Then S += phi_kᵀ V, z += Σ phi_k.

Segments. batch·heads·(m / BM)·(d / BD) programs would leave most of a GPU idle (48 for 12 heads and m = 256 on an
H100's 132 multiprocessors), so the sequence is also cut into P segments of whole chunks, walked in parallel
(:func:`_segments`: about four programs per multiprocessor). A first pass (``_segment_sums``) sums each segment's
phi_kᵀ V and phi_k (P (m, d) states per head); each segment's walk starts from the sum of those before it (and the
initial state), which its programs add up themselves (a few tiles each). Backward does the same with the queries'
Σ phi_q gnᵀ and Σ phi_q gd, summed over the segments after each one.

Backward, with gn = g / D and gd = -(g · out) / D (dL/dN and dL/dD, from the saved output and D, by ``_backward_prep``;
float32, gn in bf16 for bf16 inputs since it only enters bf16 products):

    dphi_q,t = Σ_{s <= t, same chunk} (gn_t·v_s + gd_t) phi_k,s + S gn_t + z gd_t       (forward walk, ``_backward_q``)
    dphi_k,s = Σ_{t >= s, same chunk} (gn_t·v_s + gd_t) phi_q,t + dS v_s + dz            (reverse walk, ``_backward_kv``)
    dv_s     = Σ_{t >= s, same chunk} (phi_q,t·phi_k,s) gn_t + dSᵀ phi_k,s

with dS = Σ_{t in later chunks} phi_q,t gn_tᵀ and dz = Σ phi_q,t gd_t carried in registers; after the walk they are
the gradient of the initial state. Each program's share (partial over d-blocks for the feature gradients, over
m-blocks for dv) is again atomically added. Through the FAVOR+ maps (inside the kernels, as in
``_favor_chunked._through_features``): du = dphi · phi (softmax) or dphi where W x' > 0 (relu), dx = s^½ du W, less
s x Σ_m du for the softmax map's keys (their -|x'|²/2); the queries' per-row terms cancel in N / D.

The softmax map's queries are taken relative to their largest exponent over all m features (a factor per query,
which cancels in N / D, but must be the same in every m-block): a first small kernel (``_offsets``) computes
it, one float per position.

Kept for backward: the inputs, the output in v's dtype (bf16 rounds gd's g · out to the precision of the operands it
feeds), D in float32, the queries' offsets, the initial state and the keys' segment sums (P (m, d) float32 per
head: 12 heads x 6 segments x 256 x 64 x 4 bytes = 4.7 MB, whatever n); nothing of size (n, m) and, in the walk
form, no per-chunk state (the chunk form's, below, are kept). Backward recomputes the features only.

Precision (see _precision). Exponents, features, states, scores, D and every sum are float32. For bf16 inputs the
products' operands are bf16 (tensor cores), as in the chunked backend: features, v, scores, the state read by the
queries, gn; the exponents' product x W runs as two bf16 products, x W_hi + x W_lo with W = W_hi + W_lo, exact to
~2⁻¹⁶ since x is bf16 already, so the features keep float32 accuracy. Under the interpreter, whose bf16 products
are wrong, the same operands are float32 values rounded to bf16. float32 and fp16 inputs compute in float32
throughout (``input_precision="ieee"``: no TF32). float64 is refused (:func:`refusal`).

Keys of large norm: keys' features are taken at offset 0 (exp(-|w - k'|²/2) <= 1), as in the chunked backend; a
position whose every visible key underflowed has D = 0 and is counted in ``lost``, so favor_attention redoes such
calls with the per-position offsets of :func:`_favor_chunked.favor_causal_offsets`.

Two forms. The walks above carry the state in registers and compute everything on the way (the "walk" form). The
"chunks" form splits the work the way fla's chunked kernels do, with the features still made inside the
kernels: the walks only carry the state, storing it before every chunk (``_states``: S, z per chunk, (b·h, n / C,
m, d) in bf16 for bf16 inputs, the precision its products read it at; ``_dstates``: the queries' dS, dz after every
chunk, in backward), and then one program per chunk (``_chunk_out``; ``_chunk_grads_q``, ``_chunk_grads_kv``)
computes its outputs or its input gradients over every m-block in turn, summing them in registers: no atomic adds,
no (n, d) float32 buffers, each gradient written once in its own dtype, and a grid of b·h·n / C programs that
needs no segments. It costs the stored states: m d / C values per position (256 for m = 256, d = 64, C = 64), kept
from forward to backward, which reads them rather than walking the keys again (the walk form keeps no state). By
default ("auto") the kernels take it on CUDA at the widths it was checked at on a GPU and the walk elsewhere
(:func:`_chunk_form`); ``TUNING["form"]`` = "chunks" or "walk" picks one; the sweep (benchmarks/triton_sweep.py
--forms) times both.

The forward and the backward are custom ops (``torch.library``) with autograd and fake (shape) implementations, so
torch.compile keeps each as one node, without a graph break. Triton is imported on first use (:func:`kernels`), so
the library imports without it. Off CUDA the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is first imported), which the CPU tests use.
"""

from __future__ import annotations

import functools
import math
import os
from types import SimpleNamespace

import torch

from ._precision import outside_autocast

DEFAULT_CHUNK = 64
_ROWS = 64  # positions per program of the elementwise kernels (_normalize, _backward_prep)
MAPS = {"features": 0, "softmax": 1, "relu": 2}
# Launch settings, chosen by benchmarks/triton_sweep.py on an H100 (C = 64, 4 warps, no software pipelining, four
# programs per multiprocessor: the fastest of 48 settings for the fused softmax map at 4K, 16K and 64K; pipelining
# stages hold more tiles in shared memory and registers, which a program carrying its state cannot spare). The sweep
# overrides them here; None keeps these defaults.
DEFAULT_WARPS, DEFAULT_STAGES, DEFAULT_PROGRAMS_PER_SM = 4, 1, 4
FORMS = ("chunks", "walk")  # module docstring, "Two forms"
# None: the chunk form where its compiled kernels were checked on a GPU (:func:`_chunk_form`), the walk elsewhere; the
# chunk form is the faster of the two there (benchmarks/triton_sweep.py --forms), and at head_dim 16 its compiled
# kernels gave wrong outputs where the interpreter's are right
DEFAULT_FORM = None
# the chunk-parallel form's warps per program: 4 ran it fastest on an H200 at 16K and 64K (benchmarks/triton_sweep.py
# --forms), although ptxas reports a few hundred bytes of register spills there that 8 warps avoid
DEFAULT_CHUNK_WARPS = 4
# the chunk-parallel kernels' narrowest tiles of d, head_dim and features: compiled by Triton 3.6 for an H200, their
# products gave wrong sums where a tile of 64 rows met a second operand 16 wide, or 32 wide over 64 summed
# (benchmarks/forms_check.py --states; results/h200/forms_widths*.log: v's d in such tiles broke the outputs; with d
# padded they came right, and the gradients, whose products also take the features' tiles of 32 at m = 32, stayed
# wrong). Features padded too are not checked on a GPU yet, hence "auto" (_chunk_form) only at the widths that were
CHUNK_MIN_TILE = 64
# two diagnosis switches for the chunk form on a GPU (benchmarks/forms_check.py): "anywhere" lets "chunks" take the
# widths not checked there, "state_dtype" ("float32") stores the per-chunk states at full precision
TUNING: dict[str, int | str | bool | None] = {
    "warps": None, "stages": None, "programs_per_sm": None, "form": None, "chunk_warps": None, "anywhere": False,
    "state_dtype": None,
}  # fmt: skip


def form() -> str:
    """The form asked for: "chunks" (states stored per chunk, outputs and gradients chunk-parallel), "walk"
    (everything in the walks) or "auto" (the chunk form at the widths :func:`_chunk_form` knows right on a GPU, the
    walk elsewhere); TUNING["form"] overrides the default."""
    return TUNING["form"] or DEFAULT_FORM or "auto"


_FOUND: dict[str, bool] = {}  # whether triton imports, checked once (a plain dict: torch.compile traces it)


def triton_importable() -> bool:
    """Whether ``import triton`` succeeds here."""
    if "triton" not in _FOUND:
        try:
            import triton  # noqa: F401
        except ImportError:
            _FOUND["triton"] = False
        else:
            _FOUND["triton"] = True
    return _FOUND["triton"]


def refusal(
    v: torch.Tensor, num_features: int, chunk_size: int | None, *, inputs: tuple[torch.Tensor, ...] = ()
) -> str | None:
    """Why the Triton kernels cannot run this call, or None when they can. ``inputs``: the other tensors the kernels
    read (q and k, or the features), whose dtypes and widths count too."""
    for t in (v, *inputs):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"it computes float32, bfloat16 and float16 inputs, got {t.dtype} (backend='chunked' takes it)"
    widths = [("num_features", num_features), ("v's head_dim", v.shape[-1])]
    widths += [("the head_dim of q and k", t.shape[-1]) for t in inputs[:1]]
    for name, value in widths:
        if value % 16:
            return f"{name} must be a multiple of 16 (its tile width), got {value}"
    if chunk_size is not None and (chunk_size < 16 or chunk_size & (chunk_size - 1)):
        return f"chunk_size must be a power of two >= 16 (its tile height), got {chunk_size}"
    return where_refusal(v)


def where_refusal(t: torch.Tensor) -> str | None:
    """Why no Triton kernel can run on ``t`` here (no triton, or not CUDA and not interpreted), or None."""
    if not triton_importable():
        return "triton is not installed (pip install triton)"
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"it runs on CUDA tensors, these are on {t.device.type} (TRITON_INTERPRET=1 interprets it on the CPU)"
    return None


def _block(size: int) -> int:
    """The widest tile of 64, 32 or 16 that divides ``size`` (a multiple of 16)."""
    return next(b for b in (64, 32, 16) if size % b == 0)


def kernels():
    """The kernels, imported on first use (Triton with them). Named one by one: the Hub export follows
    ``from .module import name`` to the files a model needs."""
    from ._triton_causal_kernels import (
        _backward_kv,
        _backward_prep,
        _backward_q,
        _chunk_grads_kv,
        _chunk_grads_q,
        _chunk_out,
        _dstates,
        _forward,
        _normalize,
        _offsets,
        _segment_sums,
        _states,
    )

    return SimpleNamespace(
        _backward_kv=_backward_kv,
        _backward_prep=_backward_prep,
        _backward_q=_backward_q,
        _chunk_grads_kv=_chunk_grads_kv,
        _chunk_grads_q=_chunk_grads_q,
        _chunk_out=_chunk_out,
        _dstates=_dstates,
        _forward=_forward,
        _normalize=_normalize,
        _offsets=_offsets,
        _segment_sums=_segment_sums,
        _states=_states,
    )


class _Launch:
    """One call's shapes, grid and the kernels' compile-time settings."""

    def __init__(self, q, v, w, feature_map, chunk, scale, eps):
        b, h, n, d = v.shape
        self.cuda = v.device.type == "cuda"
        self.chunk, self.scale, self.eps = chunk, scale, eps
        self.b, self.h, self.n, self.d = b, h, n, d
        self.m = q.shape[-1] if feature_map == "features" else w.shape[0]
        xd = q.shape[-1]  # what the kernels read per row of q and k: m for given features, head_dim otherwise
        self.grid = (b * h, self.m // _block(self.m), d // _block(d))
        self.warps = TUNING["warps"] or DEFAULT_WARPS
        self.options = {"num_warps": self.warps, "num_stages": TUNING["stages"] or DEFAULT_STAGES}
        # bf16 operands for bf16 inputs; under the interpreter, float32 operands rounded to bf16 (see _operand)
        ops = (1 if v.device.type == "cuda" else 2) if v.dtype == torch.bfloat16 else 0
        self.constants = dict(
            M=self.m,
            D=d,
            XD=xd,
            XDP=1 << (xd - 1).bit_length(),
            C=chunk,
            BM=_block(self.m),
            BD=_block(d),
            MAP=MAPS[feature_map],
            OPS=ops,
            PREC="tf32" if ops == 1 else "ieee",  # bf16 operands ignore it; float32 ones stay float32 (no TF32)
        )


def _or(t, fallback):
    """A tensor for a pointer argument that the kernel does not read (its flag is off)."""
    return fallback if t is None else t


_FORWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? w, Tensor? key_weights, Tensor? s0, Tensor? z0, str feature_map, "
    "float scale, float eps, int chunk) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_BACKWARD_SCHEMA = (
    "(Tensor g, Tensor q, Tensor k, Tensor v, Tensor? w, Tensor? key_weights, Tensor qoff, Tensor? s0, Tensor? z0, "
    "Tensor out, Tensor den, Tensor sums, Tensor z_sums, Tensor hs, Tensor hz, str feature_map, float scale, "
    "float eps, int chunk) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor)"
)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors (asked once per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _program_target(device: torch.device) -> int:
    """How many programs a grid wants: four per multiprocessor on CUDA, 8 interpreted."""
    if device.type != "cuda":
        return 8
    return (TUNING["programs_per_sm"] or DEFAULT_PROGRAMS_PER_SM) * _multiprocessors(device)


def _segments(launch: _Launch, device: torch.device) -> tuple[int, int]:
    """(P, L): the sequence cut into P segments of L positions (whole chunks), walked in parallel, so that the grid
    has about four programs per multiprocessor (at batch·heads·(m / BM)·(d / BD) programs, one segment each, an H100
    would run 48 for 12 heads, m = 256); the segments' sums come from one more pass (:func:`_segment_sums`). The
    interpreter takes 8 programs, so that the CPU tests cross segments."""
    chunks = -(-launch.n // launch.chunk)
    programs = launch.grid[0] * launch.grid[1] * launch.grid[2]
    target = _program_target(device)
    per_segment = -(-chunks // max(1, min(chunks, -(-target // programs))))
    length = per_segment * launch.chunk
    return -(-launch.n // length), length


def _segment_sums(kern, launch, x, y, g, w, key_weights, qoff, segments, *, queries):
    """Each segment's sums, ((b·h·P, m, d), (b·h·P, m)) float32, which the walks add up to their starting states
    (:func:`_triton_causal_kernels._start_state`): keys (x = k, y = v), Σ phi_k vᵀ and Σ phi_k; queries (x = q, y = gn,
    g = gd), Σ phi_q gnᵀ and Σ phi_q gd."""
    (count, length), b, h, m, d = segments, launch.b, launch.h, launch.m, launch.d
    sums = torch.empty(b * h * count, m, d, dtype=torch.float32, device=y.device)
    z_sums = torch.empty(b * h * count, m, dtype=torch.float32, device=y.device)
    kern._segment_sums[(b * h * count, *launch.grid[1:])](
        x, y, _or(g, qoff), _or(w, qoff), _or(key_weights, qoff), qoff, sums, z_sums, launch.n, h, count, length,
        launch.scale, math.sqrt(launch.scale), launch.eps, HAS_KEY_WEIGHTS=key_weights is not None, QUERIES=queries,
        **launch.options, **launch.constants,
    )  # fmt: skip
    return sums, z_sums


def _prepare(q, k, v, w, key_weights, feature_map, scale, eps, chunk):
    q, k, v = (t.contiguous() for t in (q, k, v))
    w = None if w is None else w.float().contiguous()
    key_weights = None if key_weights is None else key_weights.float().contiguous()
    launch = _Launch(q, v, w, feature_map, chunk, scale, eps)
    return q, k, v, w, key_weights, launch, _segments(launch, v.device)


def _chunk_form(launch: _Launch) -> bool:
    """Whether this call takes the chunk-parallel form. "auto" takes it only at the widths its compiled kernels were
    checked at on a GPU: bf16 on CUDA, v's head_dim 64 and tiles of 64 features (m = 128, 256, ...). At head_dim 16 and
    m = 32 its compiled gradient kernels (Triton 3.6, H200) gave wrong input gradients, and at 8 warps an illegal
    address, where the interpreter's are right; the walk form computes the other widths. "chunks" takes it everywhere
    but at unchecked widths on CUDA (unless TUNING["anywhere"]); the interpreter, whose results are right, takes every
    width."""
    checked = launch.d == 64 and launch.m % 64 == 0 and launch.constants["XD"] >= 64 and launch.constants["OPS"] == 1
    chosen = form()
    if chosen == "walk":
        return False
    if chosen == "auto":
        return checked
    return checked or not launch.cuda or bool(TUNING["anywhere"])


def _chunk_constants(launch: _Launch) -> dict:
    """The chunk-parallel kernels' compile-time settings: a program owns a chunk's whole d (DP: its power of two),
    reads q, k in tiles of XDP columns and the features in blocks of BM, each at least CHUNK_MIN_TILE wide (columns
    past d are zeros, features past m are masked to zero: MASK_M), so that every product's tiles are 64 wide."""
    cst = {key: value for key, value in launch.constants.items() if key != "BD"}
    dp = max(CHUNK_MIN_TILE, 1 << (launch.d - 1).bit_length())
    bm = max(CHUNK_MIN_TILE, cst["BM"])  # features past m masked where the tile is wider than what is left
    return {
        **cst, "DP": dp, "XDP": max(CHUNK_MIN_TILE, cst["XDP"]), "BM": bm, "MASK_M": launch.m % bm != 0,
        **_chunk_options(launch),
    }  # fmt: skip


def _chunk_options(launch: _Launch) -> dict:
    """The chunk-parallel form's launch options: its own warps, the walk's pipelining stages."""
    return {**launch.options, "num_warps": TUNING["chunk_warps"] or DEFAULT_CHUNK_WARPS}


def _states(kern, launch, segments, k, v, w, key_weights, qoff, s0, z0, sums):
    """The keys' walk (chunk-parallel form): the state before every chunk, H (b·h, NC, m, d) (bf16 where the
    products take bf16 operands, else float32) and HZ (b·h, NC, m) float32, and the final S, z."""
    b, h, n, d, m = launch.b, launch.h, launch.n, launch.d, launch.m
    (count, length), nc, dev = segments, -(-n // launch.chunk), v.device
    hs = torch.empty(b * h, nc, m, d, dtype=_state_dtype(launch), device=dev)
    hz = torch.empty(b * h, nc, m, dtype=torch.float32, device=dev)
    s_out = torch.empty(b * h * count, m, d, dtype=torch.float32, device=dev)
    z_out = torch.empty(b * h * count, m, dtype=torch.float32, device=dev)
    kern._states[(b * h * count, *launch.grid[1:])](
        k, v, _or(w, qoff), _or(key_weights, qoff), qoff, _or(s0, s_out), _or(z0, z_out), *(sums or (s_out, z_out)),
        hs, hz, s_out, z_out, n, nc, h, count, length, launch.scale, math.sqrt(launch.scale), launch.eps,
        HAS_KEY_WEIGHTS=key_weights is not None, HAS_S0=s0 is not None, HAS_SUMS=sums is not None,
        **_chunk_options(launch), **launch.constants,
    )  # fmt: skip
    return hs, hz, s_out, z_out


def _run_forward(q, k, v, w, key_weights, s0, z0, feature_map, scale, eps, chunk, *, normalize):
    """The forward in the chosen form (TUNING["form"]): (out in v's dtype when ``normalize``, else N (b·h, n, d)
    float32; D (b·h·n + 1) float32, whose last entry counts the lost positions when ``normalize``; the queries'
    offsets (b·h, n); final S, z; the keys' segment sums (b·h·P, m, d), (b·h·P, m), empty (0,) for one segment)."""
    kern = kernels()
    q, k, v, w, key_weights, launch, segments = _prepare(q, k, v, w, key_weights, feature_map, scale, eps, chunk)
    b, h, n, d, m = launch.b, launch.h, launch.n, launch.d, launch.m
    cst = launch.constants
    dev = v.device
    qoff = torch.empty(b * h, n, dtype=torch.float32, device=dev)  # read by the softmax map only
    if feature_map == "softmax":
        kern._offsets[(b * h, -(-n // chunk))](
            q, w, qoff, n, scale, math.sqrt(scale), m, cst["XD"], cst["XDP"], chunk, cst["BM"], True, cst["OPS"],
            cst["PREC"],
        )  # fmt: skip
    count, length = segments
    sums = _segment_sums(kern, launch, k, v, None, w, key_weights, qoff, segments, queries=False) if count > 1 else None
    s0, z0 = (None, None) if s0 is None else (s0.contiguous(), z0.contiguous())
    den = torch.zeros(b * h * n + 1, dtype=torch.float32, device=dev)  # and the lost count
    # where the first real key is, per batch: positions before it see none, and are not lost
    first = None if key_weights is None or not normalize else (key_weights.cumsum(1) == 0).sum(1, dtype=torch.int32)
    chunked = _chunk_form(launch)
    if chunked:
        hs, hz, s_out, z_out = _states(kern, launch, segments, k, v, w, key_weights, qoff, s0, z0, sums)
        result = (
            torch.empty(b, h, n, d, dtype=v.dtype, device=dev)
            if normalize
            else torch.empty(b * h, n, d, dtype=torch.float32, device=dev)
        )
        kern._chunk_out[(b * h, -(-n // chunk))](
            q, k, v, _or(w, qoff), _or(key_weights, qoff), qoff, hs, hz, _or(first, den), result, den, result, n,
            hs.shape[1], h, scale, math.sqrt(scale), eps, HAS_KEY_WEIGHTS=key_weights is not None,
            HAS_FIRST=first is not None, NORMALIZE=normalize, **_chunk_constants(launch),
        )  # fmt: skip
    else:
        result = torch.zeros(b * h, n, d, dtype=torch.float32, device=dev)
        s_out = torch.empty(b * h * count, m, d, dtype=torch.float32, device=dev)
        z_out = torch.empty(b * h * count, m, dtype=torch.float32, device=dev)
        kern._forward[(b * h * count, *launch.grid[1:])](
            q, k, v, _or(w, qoff), _or(key_weights, qoff), qoff, _or(s0, s_out), _or(z0, z_out), *(sums or (s_out, z_out)),
            result, den, s_out, z_out, n, h, count, length, scale, math.sqrt(scale), eps,
            HAS_KEY_WEIGHTS=key_weights is not None, HAS_S0=s0 is not None, HAS_SUMS=sums is not None, **launch.options,
            **cst,
        )  # fmt: skip
        if normalize:
            num, result = result, torch.empty(b, h, n, d, dtype=v.dtype, device=dev)
            kern._normalize[(b * h, -(-n // _ROWS))](
                num, den, _or(first, den), result, n, h, d, 1 << (d - 1).bit_length(), _ROWS, first is not None
            )
    if count > 1:
        s_out, z_out = s_out.view(b, h, count, m, d)[:, :, -1], z_out.view(b, h, count, m)[:, :, -1]
    s_out, z_out = s_out.reshape(b, h, m, d).contiguous(), z_out.reshape(b, h, m).contiguous()
    if sums is None:  # one segment: no sums to keep
        sums = (den.new_empty(0), den.new_empty(0))
    if not chunked:  # the walk stores no states
        hs, hz = den.new_empty(0), den.new_empty(0)
    return result, den, qoff, s_out, z_out, *sums, hs, hz


def linear_sums(q, k, v, w, key_weights, s0, z0, feature_map, scale, eps, chunk):
    """The forward's sums, not yet divided: (N (b·h, n, d) float32, D (b·h·n + 1) float32, the queries' offsets,
    final S, z, the keys' segment sums): the hybrid kernels divide them their own way."""
    return _run_forward(q, k, v, w, key_weights, s0, z0, feature_map, scale, eps, chunk, normalize=False)[:7]


def _forward(q, k, v, w, key_weights, s0, z0, feature_map, scale, eps, chunk):
    """The kernels' forward: (out (b, h, n, d) in v's dtype, D (b·h·n + 1) float32 whose last entry counts the lost
    positions, the queries' offsets (b·h, n), final S, z, the segments' starting states (b·h·P, m, d), (b·h·P, m)
    for backward, empty (0,) for one segment, and the chunk form's per-chunk states H, HZ, empty for the walk)."""
    return _run_forward(q, k, v, w, key_weights, s0, z0, feature_map, scale, eps, chunk, normalize=True)


def output_grad_dtype(v: torch.Tensor) -> torch.dtype:
    """The dtype the backward kernels read dL/dN in: bf16 where the products take bf16 operands (it enters only
    products, as bf16, so half the memory), else float32."""
    return torch.bfloat16 if v.dtype == torch.bfloat16 else torch.float32


def _backward(g, q, k, v, w, key_weights, qoff, s0, z0, out, den, sums, z_sums, hs, hz, feature_map, scale, eps, chunk):
    """The kernels' backward: dL/dq, dL/dk, dL/dv in their dtypes, dL/dS_0, dL/dz_0 (empty without a state)."""
    b, h, n, d = v.shape
    gn = torch.empty(b * h, n, d, dtype=output_grad_dtype(v), device=v.device)
    gd = torch.empty(b * h, n, dtype=torch.float32, device=v.device)
    kernels()._backward_prep[(b * h, -(-n // _ROWS))](
        g.contiguous(), out, den, gn, gd, n, d, 1 << (d - 1).bit_length(), _ROWS
    )  # rows with no real key (D = 0): no gradient
    dq, dk, dv, ds_first, dz_first = linear_grads(
        gn, gd, q, k, v, w, key_weights, qoff, s0, z0, sums, z_sums, feature_map, scale, eps, chunk, final=True,
        states=(hs, hz) if hs.numel() else None,
    )  # fmt: skip
    del gn, gd  # freed before any casts, and each float32 gradient as soon as it is cast: a lower peak
    dq = dq.to(q.dtype)
    dk = dk.to(k.dtype)
    dv = dv.to(v.dtype)
    return dq, dk, dv, ds_first, dz_first


def linear_grads(
    gn, gd, q, k, v, w, key_weights, qoff, s0, z0, sums, z_sums, feature_map, scale, eps, chunk, *, final=False,
    states=None
):  # fmt: skip
    """The backward from dL/dN (b·h, n, d) in :func:`output_grad_dtype` and dL/dD (b·h, n) float32: dL/dq, dL/dk,
    dL/dv (b, h, n, ·), float32 or, ``final``, in q's, k's and v's dtypes where the form writes each once (the chunk
    form; the walk's are sums of atomic adds, float32), and dL/dS_0, dL/dz_0 (empty without a state). ``states``:
    the chunk form's per-chunk states (H, HZ) kept from forward, or None to make them again."""
    kern = kernels()
    q, k, v, w, key_weights, launch, segments = _prepare(q, k, v, w, key_weights, feature_map, scale, eps, chunk)
    s0, z0 = (None, None) if s0 is None else (s0.contiguous(), z0.contiguous())
    if not _chunk_form(launch):
        return _walk_grads(
            kern, launch, segments, gn, gd, q, k, v, w, key_weights, qoff, s0, z0, sums, z_sums, scale, eps
        )
    b, h, n, d, m = launch.b, launch.h, launch.n, launch.d, launch.m
    (count, length), nc, dev = segments, -(-n // chunk), v.device
    if states is None:
        keys = (sums, z_sums) if count > 1 else None  # the keys' segment sums, kept from forward
        states = _states(kern, launch, segments, k, v, w, key_weights, qoff, s0, z0, keys)[:2]
    hs, hz = states
    del states
    later = _segment_sums(kern, launch, q, gn, gd, w, key_weights, qoff, segments, queries=True) if count > 1 else None
    dh = torch.empty_like(hs)
    dhz = torch.empty_like(hz)
    ds0 = torch.empty(b * h * count, m, d, dtype=torch.float32, device=dev)
    dz0 = torch.empty(b * h * count, m, dtype=torch.float32, device=dev)
    walk = {key: value for key, value in launch.constants.items() if key != "HAS_KEY_WEIGHTS"}
    kern._dstates[(b * h * count, *launch.grid[1:])](
        q, _or(w, qoff), qoff, gn, gd, *(later or (ds0, dz0)), dh, dhz, ds0, dz0, n, nc, count, length, scale,
        math.sqrt(scale), eps, HAS_LATER=later is not None, **_chunk_options(launch), **walk,
    )  # fmt: skip
    del later
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype if final else torch.float32, device=dev) for t in (q, k, v))
    common = dict(HAS_KEY_WEIGHTS=key_weights is not None, **_chunk_constants(launch))
    args = (n, nc, h, scale, math.sqrt(scale), eps)
    grid = (b * h, nc)
    kern._chunk_grads_q[grid](q, k, v, _or(w, qoff), _or(key_weights, qoff), qoff, hs, hz, gn, gd, dq, *args, **common)
    del hs, hz
    kern._chunk_grads_kv[grid](
        q, k, v, _or(w, qoff), _or(key_weights, qoff), qoff, dh, dhz, gn, gd, dk, dv, *args, **common
    )
    if s0 is None:  # no initial state to differentiate
        return dq, dk, dv, ds0.new_empty(0), dz0.new_empty(0)
    # the first segment's walk ends at the start
    return dq, dk, dv, ds0.view(b, h, count, m, d)[:, :, 0].contiguous(), dz0.view(b, h, count, m)[:, :, 0].contiguous()


def _walk_grads(kern, launch, segments, gn, gd, q, k, v, w, key_weights, qoff, s0, z0, sums, z_sums, scale, eps):
    """The walk form's backward (see :func:`linear_grads`)."""
    b, h, n, d, m = launch.b, launch.h, launch.n, launch.d, launch.m
    count, length = segments
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
    ds0 = torch.empty(b * h * count, m, d, dtype=torch.float32, device=v.device)
    dz0 = torch.empty(b * h * count, m, dtype=torch.float32, device=v.device)
    sums = (sums, z_sums) if count > 1 else None  # the keys' segment sums, kept from forward
    later = _segment_sums(kern, launch, q, gn, gd, w, key_weights, qoff, segments, queries=True) if count > 1 else None
    grid = (b * h * count, *launch.grid[1:])
    w_arg, keep_arg = _or(w, qoff), _or(key_weights, qoff)
    common = dict(HAS_KEY_WEIGHTS=key_weights is not None, **launch.options, **launch.constants)
    root = math.sqrt(scale)
    kern._backward_q[grid](
        q, k, v, w_arg, keep_arg, qoff, _or(s0, ds0), _or(z0, dz0), *(sums or (ds0, dz0)), gn, gd, dq, n, h, count,
        length, scale, root, eps, HAS_S0=s0 is not None, HAS_SUMS=sums is not None, **common,
    )  # fmt: skip
    kern._backward_kv[grid](
        q, k, v, w_arg, keep_arg, qoff, gn, gd, dk, dv, *(later or (ds0, dz0)), ds0, dz0, n, h, count, length, scale,
        root, eps, HAS_LATER=later is not None, **common,
    )  # fmt: skip
    if s0 is None:  # no initial state to differentiate
        return dq, dk, dv, ds0.new_empty(0), dz0.new_empty(0)
    # the first segment's walk ends at the start
    return dq, dk, dv, ds0.view(b, h, count, m, d)[:, :, 0].contiguous(), dz0.view(b, h, count, m)[:, :, 0].contiguous()


def _state_dtype(launch: _Launch) -> torch.dtype:
    """The dtype the chunk form stores its per-chunk states in: bf16 where the products read them as bf16."""
    return torch.bfloat16 if launch.constants["OPS"] == 1 and TUNING["state_dtype"] != "float32" else torch.float32


def _forward_fake(q, k, v, w, key_weights, s0, z0, feature_map, scale, eps, chunk):
    b, h, n, d = v.shape
    m = q.shape[-1] if feature_map == "features" else w.shape[0]
    launch = _Launch(q, v, w, feature_map, chunk, scale, eps)
    count = _segments(launch, v.device)[0]
    sums = ((b * h * count, m, d), (b * h * count, m)) if count > 1 else ((0,), (0,))
    shapes = ((b * h * n + 1,), (b * h, n), (b, h, m, d), (b, h, m), *sums)
    nc = -(-n // chunk)
    kept = (
        (v.new_empty((b * h, nc, m, d), dtype=_state_dtype(launch)), v.new_empty((b * h, nc, m), dtype=torch.float32))
        if _chunk_form(launch)
        else (v.new_empty(0, dtype=torch.float32), v.new_empty(0, dtype=torch.float32))
    )
    return v.new_empty(v.shape), *(v.new_empty(shape, dtype=torch.float32) for shape in shapes), *kept


def _backward_fake(
    g, q, k, v, w, key_weights, qoff, s0, z0, out, den, sums, z_sums, hs, hz, feature_map, scale, eps, chunk
):
    b, h, _, d = v.shape
    m = q.shape[-1] if feature_map == "features" else w.shape[0]
    grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    if s0 is None:
        return *grads, v.new_empty(0, dtype=torch.float32), v.new_empty(0, dtype=torch.float32)
    return *grads, v.new_empty((b, h, m, d), dtype=torch.float32), v.new_empty((b, h, m), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, w, key_weights, s0, z0, feature_map, scale, eps, chunk = inputs
    out, den, qoff, _, _, sums, z_sums, hs, hz = output
    ctx.settings = (feature_map, scale, eps, chunk)
    ctx.set_materialize_grads(False)  # the outputs other than out take no gradient: no zeros made for them
    # the chunk form's per-chunk states too: backward reads them rather than walking the keys again
    ctx.save_for_backward(q, k, v, w, key_weights, qoff, s0, z0, out, den, sums, z_sums, hs, hz)


@outside_autocast  # loss.backward() may be called inside autocast
def _autograd_backward(ctx, g, *_not_differentiated):  # D, the offsets, the final state, the sums, the states
    if g is None:  # out was not used
        return (None,) * 11
    saved = ctx.saved_tensors  # read once: non-reentrant activation checkpointing unpacks each saved tensor once
    dq, dk, dv, ds0, dz0 = _backward_op(g, *saved, *ctx.settings)
    state = saved[6] is not None  # s0: an initial state was given
    return dq, dk, dv, None, None, ds0 if state else None, dz0 if state else None, None, None, None, None


# Custom ops: torch.compile keeps each whole, one node in its graph (no graph break, nothing traced inside)
_forward_op = torch.library.custom_op(
    "linearformers::triton_causal_linear", _forward, mutates_args=(), schema=_FORWARD_SCHEMA
)
_backward_op = torch.library.custom_op(
    "linearformers::triton_causal_linear_backward", _backward, mutates_args=(), schema=_BACKWARD_SCHEMA
)
_forward_op.register_fake(_forward_fake)
_backward_op.register_fake(_backward_fake)
_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def triton_causal_linear(q, k, v, w, key_weights, feature_map, scale, eps, chunk, s0=None, z0=None):
    """Causal linear attention through the Triton kernels (module docstring), as custom ops. Inputs: q, k
    (b, h, n, d) with w (m, d) and feature_map "softmax" or "relu", or the features phi_q, phi_k (b, h, n, m) with w
    None and feature_map "features"; v (b, h, n, d_v); key_weights (b, n) float (1 real, 0 padded) or None; scale, eps
    (the maps'); chunk C (a power of two >= 16); s0 (b, h, m, d_v), z0 (b, h, m): the initial state at offset 0, or
    None. Gradients reach q, k, v and the initial state. Returns (out in v's dtype, S (b, h, m, d_v), z (b, h, m)
    float32, lost): the final state (detached) and the count (0-dim, float32) of positions that see a real key yet
    whose every visible key underflowed."""
    # contiguous before the op: the op keeps its inputs for backward, which then reads them as they are (views
    # would be copied again there)
    q, k, v = (t.contiguous() for t in (q, k, v))
    out, den, _, s, z, *_ = _forward_op(
        q, k, v, w, key_weights, s0, z0, feature_map, float(scale), float(eps), int(chunk)
    )
    return out, s.detach(), z.detach(), den[-1]
