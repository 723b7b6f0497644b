"""Sliding-window softmax + linear attention inside one head (LoLCATs, Zhang et al. 2024, arXiv 2410.10254).

Query t takes exact softmax scores on its window W(t) and linear feature scores on every other key it may see:

    causal:         W(t) = {s : t - w < s <= t},   linear keys s <= t - w
    bidirectional:  W(t) = {s : |s - t| < w},      linear keys |s - t| >= w

    a_ts = gamma_h exp(scale q_t·k_s - c_t)   (s in W(t)),      b_ts = phi_q,t · phi_k,s   (linear keys)
    out_t = (Σ_s a_ts v_s + Σ_s b_ts v_s) / (Σ_s a_ts + Σ_s b_ts)

Attention sinks (``sinks`` = S > 0; StreamingLLM, Xiao et al. 2024): the first S real tokens of each sequence join
every query's window, W(t) ∪ {its sinks it may see}, and leave the linear part. all-MiniLM-L6-v2 puts 21-26% of its
attention on [CLS] in four of its six layers (benchmarks/attention_mass.py), far from most queries' windows, and a
spike on one key is what a linear map follows worst.

c_t is the largest window logit of query t over real keys, the paper's stabilizer on the softmax part only: it
keeps every a_ts in (0, gamma_h], and, as in the paper, it makes gamma's effective weight against the linear part
query-dependent (the window part is gamma exp(-c_t) times the unstabilized scores). Padded keys leave both parts;
a query with no real key outputs 0. :func:`reference.hybrid_reference` is the (n x n) definition.

Features on the softmax's own scale (``query_log_scale`` ℓ, (b, h, n)): the linear scores become

    b_ts = exp(ℓ_t - c_t) phi_q,t · phi_k,s

so that exp(ℓ_t) phi_q,t · phi_k,s estimates exp(scale q_t·k_s) and both parts carry the same exp(-c_t): with
gamma = 1 the hybrid then estimates softmax attention over all the keys. For FAVOR+'s positive features
(:func:`feature_maps.favor_positive`), whose query features have their row maximum u_t taken off and which lack
the estimator's 1/m, ℓ_t = u_t - log m. A learned map's scores are taken as they are (ℓ = None): the paper's form;
or with a learned ℓ_t = q_t·a_h + b_h (``PerformerConfig.hybrid_query_scale``), which is then this same scale.
The computation takes c'_t = max(c_t, ℓ_t - R), R = 50, off both parts instead of c_t, a factor per query that
cancels in the normalization, with exp(ℓ_t - c'_t) formed from the logs in float32: every window score stays at
most gamma_h and the linear factor at most e^R (5e21), so nothing overflows however far ℓ_t lies above the window
logits, while the window part underflows only where ℓ_t passes them by more than R + 87 (float32's smallest
normal is e^-87). Where ℓ_t - c_t <= R, this is exactly the definition above.

Computed by blocks of B = w // L queries, L = 2 (L = 1 for w = 1): L B is w or w - 1, so around query block c the
frame of keys [(c - L) B, (c + 1) B) (causal) or [(c - L) B, (c + L + 1) B) (bidirectional) holds every key of its
queries' windows, every key outside the frame is a linear key, and the frame's keys are all in the window but in
its first block (and, bidirectional, its last), where the window and the in-frame linear keys meet: a frame of 2.5 w
keys rather than 3 w at L = 1, and linear scores on 2 blocks of w / 2 keys rather than on the frame. The keys
outside the frame come in through block states: the per-block sums phi_kᵀ [v, 1] of the blocks before c - L (and
after c + L, bidirectional), summed, never subtracted, so no cancellation. The sinks come in beside the frame: each
query's S scores against the S sink keys, masked where the sink lies in its window (counted there) or, causal,
ahead of it; their features are zeroed before any linear sum. Time O(n (w (m + d) + m d + S d)), memory
O(n (w + S) + (n / w) m d), m features, d head_dim. On the CPU the query blocks go through in passes whose window
scores stay within 16 MB (_PASS_BYTES says why); elsewhere in one pass. The block states come by pieces of at most
64 blocks: sums carried from the pieces before and after, plus one product of a 0 / 1 matrix with the block sums
around the piece. Where autograd records nothing (inference) on the CPU, a pass makes its scores in place, one
batched product per head over views of the frames (no copy of them), and the in-frame linear scores on the edge
blocks alone; with ℓ in float32, ATen's fused softmax attention computes the window part of all the blocks first
(outputs and log-sum-exps, no scores in memory), and the passes add the rest. Bidirectional inference on the CPU
takes the compiled walk of _native/hybrid_bidirectional.cpp instead, where it can run (backend "native"; the same
blocks, one (batch, head) row per thread), and :func:`hedgehog_hybrid_attention` has that walk make Hedgehog's
features and the learned scales itself, a block at a time. Bidirectional inference on CUDA takes one Triton program
per block of queries (:mod:`_triton_hybrid_bidirectional`, backend "triton").

Bidirectional, with ℓ, ``select_blocks`` K: each block of B queries also gives exact scores to the K blocks of B far
keys its mean query prefers (:mod:`far_blocks`, where the definition and its cost are), in the same normalizer.

Decoding keeps (S, z), the linear sums over keys that left the window, the last w - 1 keys, values and key
features with their validity, and the sinks' keys and values with their validity and their distance from the
newest token: memory per step is constant in the context length (:func:`hybrid_step`).

Everything is computed in float32 (float64 for float64 inputs) with autocast off; outputs come in v's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ._checks import check_mask, check_qkv, check_window_sinks_gamma
from ._native import HYBRID_BLOCK, hybrid_bidirectional_forward
from ._native import available as native_available
from ._precision import LOG_SCALE_HEADROOM, outside_autocast
from ._triton_hybrid import refusal as _kernel_refusal
from ._triton_hybrid import triton_causal_hybrid
from ._triton_hybrid_bidirectional import block_size as _bidirectional_block
from ._triton_hybrid_bidirectional import refusal as _bidirectional_refusal
from ._triton_hybrid_bidirectional import triton_bidirectional_hybrid
from .backends import native_walk_enabled, triton_refusal
from .far_blocks import add_far_blocks, choose_far_blocks

HYBRID_BACKENDS = ("chunked", "native", "triton")  # what hybrid_attention may name

# ATen's fused softmax attention on the CPU, (out, logsumexp) of q (B, H, L, E) against k, v (B, H, S, E) with an
# additive mask broadcast over B and H; it reads strided views (the frames) in place
_FUSED_SOFTMAX = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

# the most bytes of window scores one pass of the CPU core makes: glibc serves an allocation above its mmap
# threshold (which it raises by itself to at most 32 MB) from a fresh mapping and unmaps it when freed, so a step
# whose temporaries pass it pays their page faults again every call; a pass's tensors stay below it, the heap
# keeps them for the next pass and the next step (docs/attention-and-backends.md, "Long sequences on a CPU")
_PASS_BYTES = 16 * 2**20

# above this many bytes of window scores in one call, the passes are checkpointed under autograd: backward keeps
# their inputs and makes the scores again, one pass at a time: at long lengths that cuts the peak by about a third
# in about the same time, while at a few thousand positions it costs time for little memory (measured on the CPU,
# one layer forward + backward, m = 128); hence a threshold between the two
_RECOMPUTE_BYTES = 64 * 2**20

# L of the module docstring: the blocks on each side of a query block that hold keys of its window. 2 against 1:
# frames of 2.5 w keys and linear scores on w of them, not 3 w and 3 w, at twice the block states, which the CPU
# inference of a long document gains from; more blocks add states and calls for little
_SIDE_BLOCKS = 2

# the most query blocks whose states one 0 / 1 product makes (_block_states): its cost per block grows with them
_STATE_BLOCKS = 64


class HybridState(NamedTuple):
    """Decoding state after a causal pass. ``s`` (b, h, m, d) and ``z`` (b, h, m): Σ phi_k vᵀ and Σ phi_k over the
    real keys that have left the window, sinks excepted, in the compute dtype; ``k``, ``v``, ``phi_k``
    (b, h, w - 1, ·): the last w - 1 positions, oldest first, in the inputs' dtype (a sink's phi_k is zero: it never
    joins the linear part); ``valid`` (b, w - 1) bool: False for padding and for the empty places of a window not
    yet full. ``sink_k``, ``sink_v`` (b, h, S, ·): the sinks' keys and values in the inputs' dtype, in the order
    they came; ``sink_valid`` (b, S) bool: False for sinks not seen yet; ``sink_distance`` (b, S) int64: how many
    positions lie from each sink to the end of the state (1 for the newest position). S = 0 without sinks."""

    s: torch.Tensor
    z: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    phi_k: torch.Tensor
    valid: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_valid: torch.Tensor
    sink_distance: torch.Tensor


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_inputs(q, k, v, phi_q, phi_k, gamma, window, query_log_scale, sinks):
    check_qkv(q, k, v, same_length=True)
    for name, t in () if phi_q is None else (("phi_q", phi_q), ("phi_k", phi_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.dim() != 4 or t.shape[:3] != q.shape[:3]:
            raise ValueError(
                f"{name} must be shaped (batch, heads, length, features) = {tuple(q.shape[:3])} + (m,), "
                f"got {tuple(t.shape)}"
            )
    if phi_q is not None and phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(
            f"phi_q and phi_k need the same number of features, got {phi_q.shape[-1]} and {phi_k.shape[-1]}"
        )
    check_window_sinks_gamma("window", window, sinks, gamma, q.shape[1])
    if query_log_scale is not None:
        if not isinstance(query_log_scale, torch.Tensor):
            raise TypeError(f"query_log_scale must be a torch.Tensor or None, got {type(query_log_scale).__name__}")
        if not query_log_scale.is_floating_point():
            raise TypeError(f"query_log_scale must be a floating-point tensor, got {query_log_scale.dtype}")
        if tuple(query_log_scale.shape) != tuple(q.shape[:3]):
            raise ValueError(
                f"query_log_scale must be shaped (batch, heads, length) = {tuple(q.shape[:3])}, got "
                f"{tuple(query_log_scale.shape)}"
            )
    if torch.compiler.is_compiling():
        return  # reading the values back would sync the host and break the compiled graph
    if bool(((gamma < 0) | ~torch.isfinite(gamma)).any()):
        raise ValueError("gamma must be finite and nonnegative (keep it positive, e.g. the exp of a parameter)")
    if query_log_scale is not None and not bool(torch.isfinite(query_log_scale).all()):
        raise ValueError("query_log_scale must be finite")


def _far_block_choice(q, k, valid, linear, window, blocks, block=HYBRID_BLOCK) -> torch.Tensor:
    """The kernels' ``chosen``: the far blocks of ``block`` keys each query block takes (b, h, nb, K), -1 where
    fewer lie far."""
    index, real = choose_far_blocks(q, k, valid, linear, window, blocks, block)
    return torch.where(real, index, torch.full_like(index, -1))


def _check_selection(blocks, block_size, causal, query_log_scale) -> None:
    for name, value, low in (("select_blocks", blocks, 0), ("select_block_size", block_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    if not blocks:
        return
    if causal:
        raise ValueError(
            "select_blocks applies to bidirectional attention: a causal state would have to keep every key to "
            "choose among; use select_blocks=0"
        )
    if query_log_scale is None:
        raise ValueError(
            "select_blocks needs query_log_scale: the chosen keys' exact scores and the linear scores must lie on "
            "one scale (FAVOR+'s softmax features or a learned query scale)"
        )


def _check_state(state, b, h, w, sinks, d, m, dv, dtype, device) -> HybridState:
    fields = len(HybridState._fields)
    if (
        not isinstance(state, (tuple, list))
        or len(state) != fields
        or not all(isinstance(t, torch.Tensor) for t in state)
    ):
        raise TypeError(f"a hybrid-attention state is a HybridState {HybridState._fields} of {fields} tensors")
    state = HybridState(*state)
    p = w - 1
    want = {
        "s": (b, h, m, dv),
        "z": (b, h, m),
        "k": (b, h, p, d),
        "v": (b, h, p, dv),
        "phi_k": (b, h, p, m),
        "valid": (b, p),
        "sink_k": (b, h, sinks, d),
        "sink_v": (b, h, sinks, dv),
        "sink_valid": (b, sinks),
        "sink_distance": (b, sinks),
    }
    for name, shape in want.items():
        got = tuple(getattr(state, name).shape)
        if got != shape:
            raise ValueError(f"the state's {name} must be shaped {shape} for window={w}, sinks={sinks}, got {got}")
    return HybridState(
        state.s.to(device=device, dtype=dtype),
        state.z.to(device=device, dtype=dtype),
        state.k,
        state.v,
        state.phi_k,
        state.valid.bool(),
        state.sink_k,
        state.sink_v,
        state.sink_valid.bool(),
        state.sink_distance.long(),
    )


def sink_slots(
    valid: torch.Tensor, sinks: int, seen_before: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens are sinks: the first ``sinks`` real tokens of each row, counting the ``seen_before`` (b,) real
    tokens of earlier calls (None: none). valid (b, n) bool. Returns is_sink (b, n) bool and slot (b, S, n) bool,
    slot[b, j, s] True where token s is sink j."""
    rank = valid.long().cumsum(-1)  # (b, n): 1 for the first real token
    if seen_before is not None:
        rank = rank + seen_before[:, None]
    is_sink = valid & (rank <= sinks)
    slot = is_sink[:, None, :] & (rank[:, None, :] - 1 == torch.arange(sinks, device=valid.device)[None, :, None])
    return is_sink, slot


def _blocks_per_pass(b: int, h: int, blk: int, frame: int, nb: int, itemsize: int, device: torch.device) -> int:
    """Query blocks per pass of the core: all of them off the CPU (one pass, fewest launches); on the CPU as many
    as keep a pass's (b, h, blocks, blk, frame) scores within _PASS_BYTES, at least one."""
    per_block = b * h * blk * frame * itemsize
    if device.type != "cpu" or per_block == 0:  # an empty batch or no heads: nothing to split
        return nb
    return max(1, min(nb, _PASS_BYTES // per_block))


def _window_pass(qb, pqb, kf, vf, pkf, win, lin, t, ell, state, gamma, sink, window, causal):
    """One pass of the core over the nq query blocks qb (b, h, nq, blk, d), already times the logit scale: their
    window, sink and in-frame linear scores against the frame keys, plus the linear part of the keys outside the
    frame through state (b, h, nq, m, d + 1). win, lin (b, 1, nq, blk, frame) bool: the frame keys in each query's
    window, and its in-frame linear keys; t (nq, blk, 1) the queries' positions. Returns the accumulated
    [numerator, denominator, c] (b, h, nq, blk, d + 2), c the stabilizer both sums carry as exp(-c)."""
    logits = (qb @ kf.transpose(-1, -2)).masked_fill(~win, float("-inf"))
    c = logits.amax(-1, keepdim=True)
    if sink is not None:  # the sinks a query sees outside its window: exact scores, beside the window's
        sink_logits = _sink_logits(qb, t, sink, window, causal)
        c = torch.maximum(c, sink_logits.amax(-1, keepdim=True))
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))  # no real key in the window: a = 0 anyway
    if ell is not None:
        c = torch.maximum(c, ell - LOG_SCALE_HEADROOM)  # c'_t (module docstring): a per-query factor, cancels
        pqb = pqb * torch.exp(ell - c)  # <= e^R: scales the in-frame linear scores and the block states alike
    g = gamma.to(qb.dtype)[None, :, None, None, None]
    scores = g * torch.exp(logits - c)
    scores = scores + (pqb @ pkf.transpose(-1, -2)) * lin
    acc = scores @ vf  # (b, h, nq, blk, d + 1)
    if sink is not None:
        acc = acc + ((g * torch.exp(sink_logits - c)).flatten(2, 3) @ _with_ones(sink[1])).view_as(acc)
    return torch.cat([acc + pqb @ state, c], -1)


def _window_pass_untracked(qb, pqb, kf, vf, pkf, win, lin, t, ell, state, gamma, sink, window, causal, out, c_out):
    """:func:`_window_pass` where autograd records nothing (inference), into out (b, h, nq, blk, d + 1): the same
    sums, with the scores made and combined in place, a few passes over them fewer. gamma goes into the stabilizer
    (g exp(x - c) = exp(x - c + log g)). win: (b, 1, nq, blk, frame) as there, or the (blk, frame) window
    pattern alone where every frame key is real. The in-frame linear keys lie in the frame's first block (and,
    bidirectional, its last) alone, so their scores are made there, times lin (blk, frame), their pattern alone
    as 0 / 1: the window scores are zero outside the window, and the linear scores of padded keys and sinks are
    already zero (their features are). c_out (b, h, nq, blk, 1) or None: where to write the stabilizer c."""
    b, h, nq, blk, _ = qb.shape
    logits = _bmm_rows(qb, kf.transpose(-1, -2), qb.new_empty(b, h, nq, blk, kf.shape[-2]))
    if win.dim() == 2:  # every frame key real: win is the (blk, frame) pattern, which is all True but at the edges
        for cols in (slice(0, blk), slice(-blk, None)):
            logits[..., cols].masked_fill_(~win[:, cols], float("-inf"))
    else:
        logits.masked_fill_(~win, float("-inf"))
    c = logits.amax(-1, keepdim=True)
    if sink is not None:
        sink_logits = _sink_logits(qb, t, sink, window, causal)
        c = torch.maximum(c, sink_logits.amax(-1, keepdim=True))
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    if ell is not None:
        c = torch.maximum(c, ell - LOG_SCALE_HEADROOM)
        pqb = pqb * torch.exp(ell - c)
    if c_out is not None:
        c_out.copy_(c)
    c_window = c - torch.log(gamma.to(qb.dtype))[None, :, None, None, None]  # +inf where gamma is 0: scores 0
    scores = logits.sub_(c_window).exp_()
    edge = qb.new_empty(b, h, nq, blk, blk)
    for cols in (slice(0, blk),) if causal else (slice(0, blk), slice(-blk, None)):
        scores[..., cols].addcmul_(_bmm_rows(pqb, pkf[..., cols, :].transpose(-1, -2), edge), lin[:, cols])
    _bmm_rows(scores, vf, out)
    if sink is not None:
        out += (torch.exp(sink_logits.sub_(c_window)).flatten(2, 3) @ _with_ones(sink[1])).view_as(out)
    for x, y, o in _rows(pqb, state, out):
        o.baddbmm_(x, y)
    return out


def _window_softmax_fused(qb, kf, vf, in_window, reals, out):
    """The window part of every query block at once, where the queries carry their scale ℓ, on the CPU: ATen's
    fused softmax attention (its flash kernel) of qb (b, h, nb, blk, d), already times the logit scale, over the
    frame views kf, vf (b, h, nb, frame, ·) in place, masked to each query's window and the real keys. It never
    makes the (blk, frame) scores; it writes each query's normalized window output into out[..., :d] and its
    log-sum-exp L_t into out[..., d] (b, h, nb, blk, d + 1), -inf where the window holds no real key.
    in_window: the (blk, frame) pattern; reals: (b, nb, frame) bool, the frame keys that are real."""
    d = qb.shape[-1]
    for i in range(qb.shape[0]):  # the mask (blocks, blk, frame) is per sequence, shared by the heads
        mask = in_window & reals[i, :, None, :]
        bias = torch.zeros(mask.shape, dtype=qb.dtype, device=qb.device).masked_fill_(~mask, float("-inf"))
        o, lse = _FUSED_SOFTMAX(qb[i], kf[i], vf[i, ..., :d], attn_mask=bias[None], scale=1.0)
        out[i, ..., :d].copy_(o)
        out[i, ..., d].copy_(lse.masked_fill_(~mask.any(-1), float("-inf")))  # the kernel gives 0 there
    return out


def _window_pass_fused(qb, pqb, pkf, vf, lin, t, ell, state, gamma, sink, window, causal, out, c_out):
    """:func:`_window_pass_untracked` after :func:`_window_softmax_fused`, whose window outputs and L_t out holds:
    the rest of the pass. With ℓ both parts carry the same per-query factor (module docstring), so the stabilizer
    may be c = max(L_t, the sinks' logits, ℓ_t - R) rather than the largest window logit: gamma exp(L_t - c) times
    the window output is then the window's numerator, gamma exp(L_t - c) its denominator. Then the in-frame
    linear scores on the edge blocks, the sinks and the block states are added as there; c goes to c_out as
    there."""
    b, h, nq, blk, d = qb.shape
    lse = out[..., d:]  # (b, h, nq, blk, 1)
    c = lse.clone()
    if sink is not None:
        sink_logits = _sink_logits(qb, t, sink, window, causal)
        c = torch.maximum(c, sink_logits.amax(-1, keepdim=True))
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    c = torch.maximum(c, ell - LOG_SCALE_HEADROOM)
    pqb = pqb * torch.exp(ell - c)
    if c_out is not None:
        c_out.copy_(c)
    c_window = c - torch.log(gamma.to(qb.dtype))[None, :, None, None, None]  # +inf where gamma is 0: scores 0
    weight = torch.exp(lse - c_window)  # 0 where the window holds no real key or gamma is 0
    out[..., :d].mul_(weight)
    out[..., d:].copy_(weight)
    edge = qb.new_empty(b, h, nq, blk, blk)
    for cols in (slice(0, blk),) if causal else (slice(0, blk), slice(-blk, None)):
        scores = _bmm_rows(pqb, pkf[..., cols, :].transpose(-1, -2), edge).mul_(lin[:, cols])
        for x, y, o in _rows(scores, vf[..., cols, :], out):
            o.baddbmm_(x, y)
    if sink is not None:
        out += (torch.exp(sink_logits.sub_(c_window)).flatten(2, 3) @ _with_ones(sink[1])).view_as(out)
    for x, y, o in _rows(pqb, state, out):
        o.baddbmm_(x, y)
    return out


def _pad_buffer(x: torch.Tensor, lead: int, after: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (b, h, lead + n + after, width) buffer of x's dtype and device whose first lead and last after rows are
    zero, and the view of its n rows between, for the caller to fill."""
    b, h, n, _ = x.shape
    buf = x.new_empty(b, h, lead + n + after, width)
    buf[:, :, :lead].zero_()
    buf[:, :, lead + n :].zero_()
    return buf, buf[:, :, lead : lead + n]


def _rows(*tensors: torch.Tensor):
    """The (batch, head) rows of 5-d tensors, each a 3-d view."""
    b, h = tensors[0].shape[:2]
    return ((*(x[i, j] for x in tensors),) for i in range(b) for j in range(h))


def _bmm_rows(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x @ y for 5-d (b, h, blocks, ·, ·) tensors, one bmm per (batch, head) row: a row of a frame view is a
    3-d tensor whose matrices overlap in memory, which bmm reads in place, while matmul over all rows would copy
    the frames out first (the rows' strides do not merge). Returns out."""
    for xr, yr, o in _rows(x, y, out):
        torch.bmm(xr, yr, out=o)
    return out


def _with_ones(x: torch.Tensor) -> torch.Tensor:
    """[x, 1] along the last dimension: values whose products give the numerator and the denominator together."""
    return torch.cat([x, torch.ones_like(x[..., :1])], -1)


def _sink_logits(qb, t, sink, window, causal):
    """The queries' (b, h, nq, blk, S) logits against the sinks they see outside their window, -inf elsewhere."""
    sink_k, _, sink_pos, sink_valid = sink
    sink_dist = t[None] - sink_pos[:, None, None, :]  # (b, nq, blk, S): t - s
    near = ((sink_dist >= 0) & (sink_dist < window)) if causal else (sink_dist.abs() < window)
    sees = sink_valid[:, None, None, :] & ~near & ((sink_dist >= 0) if causal else True)
    logits = (qb.flatten(2, 3) @ sink_k.transpose(-1, -2)).view(*qb.shape[:4], -1)
    return logits.masked_fill(~sees[:, None], float("-inf"))


def _block_states(sums, step, side, causal, base):
    """Per pass of ``step`` query blocks, the linear state of each of its blocks c (b, h, nq, m, d + 1): the sums
    (b, h, nb, m, d + 1) of the blocks up to c - side - 1 (and from c + side + 1, bidirectional), plus base (b, h,
    m, d + 1) or None. Made by pieces of at most _STATE_BLOCKS blocks (each pass's split evenly): the carries from
    the pieces' ends, summed from the left and from the right, and the blocks a piece's own and side blocks around
    it hold, picked by one product with a 0 / 1 matrix (on the CPU faster than cumsums over these (m, d + 1)
    blocks; the pieces bound its cost per block). Only sums, so no cancellation."""
    b, h, nb = sums.shape[:3]
    pieces = []  # (first block, blocks) of every piece, passes in order
    for c0 in range(0, nb, step):
        nq = min(step, nb - c0)
        size = -(-nq // -(-nq // _STATE_BLOCKS))
        pieces.append([(a, min(size, c0 + nq - a)) for a in range(c0, c0 + nq, size)])
    flat = [piece for pass_pieces in pieces for piece in pass_pieces]
    rights = [None] * len(flat)  # each piece's sums of the blocks from its end + side on
    if not causal:
        right = torch.zeros_like(sums[:, :, 0])
        for j in reversed(range(len(flat))):
            rights[j] = right
            a, size = flat[j]
            right = right + sums[:, :, a + side : a + size + side].sum(2)
    left = torch.zeros_like(sums[:, :, 0])  # the sums of the blocks before the piece's first - side
    j = 0
    for pass_pieces in pieces:
        parts = []
        for a, size in pass_pieces:
            lo, hi = max(a - side, 0), min(a + size + side, nb)
            near = torch.arange(lo, hi, device=sums.device) - torch.arange(a, a + size, device=sums.device)[:, None]
            pick = (near < -side) if causal else (near.abs() > side)  # (size, hi - lo): j - c
            part = (pick.to(sums.dtype) @ sums[:, :, lo:hi].flatten(3)).view(b, h, size, *sums.shape[3:])
            carry = left if causal else left + rights[j]
            parts.append(part + (carry if base is None else carry + base)[:, :, None])
            left = left + sums[:, :, lo : max(a + size - side, lo)].sum(2)
            j += 1
        yield parts[0] if len(parts) == 1 else torch.cat(parts, 2)


def _hybrid_core(q, k, v, pq, pk, gamma, window, causal, valid, linear, scale, base, log_scale, sink, lse=False):
    """All inputs in the compute dtype; valid (b, n) bool: real keys; linear (b, n) bool: the real keys that may
    join the linear part (sinks do not); base (b, h, m, d + 1) added to every block's state, or None; log_scale
    (b, h, n), the queries' ℓ, or None; sink: None, or (keys (b, h, S, d), values (b, h, S, d), positions (b, S)
    int64 in this call's frame of positions (negative: before it), validity (b, S) bool). Returns (b, h, n, d);
    with ``lse``, also each query's log normalizer log(Σ_s (a_ts + b_ts)) with both parts taken at c_t = 0
    (b, h, n, 1), -inf where a query has no real key."""
    b, h, n, d = q.shape
    side = _SIDE_BLOCKS if window >= _SIDE_BLOCKS else 1
    blk = window // side
    pad_end = (-n) % blk
    nb = (n + pad_end) // blk
    lead = side * blk  # the frame's keys before its query block
    frame = (side + 1) * blk if causal else (2 * side + 1) * blk
    after = pad_end if causal else lead + pad_end
    # padded keys and sinks leave the linear sums (and the frame scores)
    linear_keys = linear[:, None, :, None].to(pk.dtype)
    tracked = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, pq, pk, gamma, log_scale, base, *(sink or ()))
    )
    # the in-place pass where autograd records nothing on the CPU; not in a compiled graph, which fuses the general
    # form itself and would break at the in-place pass's per-pass check of the padding, nor on a GPU, where its
    # products per (batch, head) row would be one kernel launch each
    general = tracked or torch.compiler.is_compiling() or q.device.type != "cpu"
    # k, [v, 1] (numerator and denominator together) and the kept pk between zero rows, lead before and after after
    # them: the frames' margins; where the in-place pass runs, each written once, straight into its buffer
    if general:
        k_pad, v_pad, pk_pad = (F.pad(x, (0, 0, lead, after)) for x in (k, _with_ones(v), pk * linear_keys))
    else:
        k_pad, rows = _pad_buffer(k, lead, after, d)
        rows.copy_(k)
        v_pad, rows = _pad_buffer(v, lead, after, d + 1)
        rows[..., :d].copy_(v)
        rows[..., d].fill_(1.0)
        pk_pad, rows = _pad_buffer(pk, lead, after, pk.shape[-1])
        torch.mul(pk, linear_keys, out=rows)
    step = _blocks_per_pass(b, h, blk, frame, nb, q.element_size(), q.device)

    # every pass's pieces are split off views of whole-sequence tensors, so the backward puts each input's gradient
    # together once (a split's backward is one cat) rather than once per pass
    def passes(x):  # one pass: the tensor itself, with no split (whose backward would copy the gradient)
        return (x,) if step >= nb else x.split(step, 2)

    def frames(x_pad):  # padded -> per pass (b, h, nq, frame, e): keys [c blk - lead, c blk - lead + frame)
        return passes(x_pad.unfold(2, frame, blk).transpose(-1, -2))

    def blocks(x):  # (b, h, n, e) -> (b, h, nb, blk, e); a view of x when n fills its blocks (F.pad copies)
        return (F.pad(x, (0, 0, 0, pad_end)) if pad_end else x).view(b, h, nb, blk, x.shape[-1])

    kfs, vfs, pkfs = frames(k_pad), frames(v_pad), frames(pk_pad)
    q_blocks = blocks(q * scale)  # the scale on n x d, not on the scores
    qbs, pqbs = passes(q_blocks), passes(blocks(pq))
    # query t = c blk + i against frame key s = c blk - lead + j lies t - s = lead + i - j from it in every block c:
    # one (blk, frame) pattern of window and in-frame linear keys, and per pass which frame keys are real
    dist = lead + torch.arange(blk, device=q.device)[:, None] - torch.arange(frame, device=q.device)
    in_window = ((dist >= 0) & (dist < window)) if causal else (dist.abs() < window)
    outside = (dist >= window) if causal else ~in_window  # the keys it may see outside its window
    reals = passes(F.pad(valid, (lead, after)).unfold(1, frame, blk)[:, None, :, None, :])
    ells = [None] * len(qbs) if log_scale is None else passes(blocks(log_scale[..., None]))

    pk_blocks, v_blocks = (x[:, :, lead : lead + nb * blk].unflatten(2, (nb, blk)) for x in (pk_pad, v_pad))
    # per-block phi_kᵀ [v, 1], (b, h, nb, m, d + 1); the blocks are views of the padded buffers, read in place
    # without autograd (one product per head), copied by matmul with it
    pk_blocks = pk_blocks.transpose(-1, -2)
    if general:
        sums = pk_blocks @ v_blocks
    else:
        sums = _bmm_rows(pk_blocks, v_blocks, q.new_empty(b, h, nb, pk.shape[-1], d + 1))
    states = _block_states(sums, step, side, causal, base)  # each pass's (b, h, nq, m, d + 1)

    scores_bytes = b * h * nb * blk * frame * q.element_size()  # the window scores of the whole call
    recompute = tracked and len(qbs) > 1 and scores_bytes > _RECOMPUTE_BYTES
    outs, acc = [], None if general else q.new_empty(b, h, nb, blk, d + 1)
    stabilizer = None if general or not lse else q.new_empty(b, h, nb, blk, 1)
    fused = not general and log_scale is not None and q.dtype == torch.float32 and _FUSED_SOFTMAX is not None
    if fused:  # the window part of all the blocks in one call: the kernel makes no scores to keep in passes
        frames_all = (x.unfold(2, frame, blk).transpose(-1, -2) for x in (k_pad, v_pad))
        reals_all = F.pad(valid, (lead, after)).unfold(1, frame, blk)
        _window_softmax_fused(q_blocks, *frames_all, in_window, reals_all, acc)
    for i, (qb, state) in enumerate(zip(qbs, states)):
        nq, c0 = qb.shape[2], i * step
        t = torch.arange(i * step * blk, (i * step + nq) * blk, device=q.device).view(nq, blk, 1)
        if general:
            args = (qb, pqbs[i], kfs[i], vfs[i], pkfs[i], in_window & reals[i], outside & reals[i], t, ells[i])
            args = (*args, state, gamma, sink, window, causal)
            # in passes, each pass is checkpointed: backward keeps its inputs (views of the whole-sequence tensors
            # and its state), not its (blocks, blk, frame) scores, and makes them again when it reaches the pass
            outs.append(checkpoint(_window_pass, *args, use_reentrant=False) if recompute else _window_pass(*args))
        else:
            if fused:
                args = (qb, pqbs[i], pkfs[i], vfs[i], outside.to(q.dtype), t, ells[i], state)
                c_out = None if stabilizer is None else stabilizer[:, :, c0 : c0 + nq]
                _window_pass_fused(*args, gamma, sink, window, causal, acc[:, :, c0 : c0 + nq], c_out)
                continue
            win = in_window if bool(reals[i].all()) else in_window & reals[i]
            args = (qb, pqbs[i], kfs[i], vfs[i], pkfs[i], win, outside.to(q.dtype), t, ells[i], state)
            c_out = None if stabilizer is None else stabilizer[:, :, c0 : c0 + nq]
            _window_pass_untracked(*args, gamma, sink, window, causal, acc[:, :, c0 : c0 + nq], c_out)
    if not general:
        num, den = acc.view(b, h, nb * blk, d + 1)[:, :, :n].split((d, 1), -1)
        out = (num / den).masked_fill_(den <= 0, 0.0)  # 0/0 where a query has no real key: output 0
        if not lse:
            return out
        return out, _log_normalizer(den, stabilizer.view(b, h, nb * blk, 1)[:, :, :n])

    acc = torch.cat(outs, 2).reshape(b, h, nb * blk, d + 2)[:, :, :n]
    num, den, c = acc[..., :d], acc[..., d : d + 1], acc[..., d + 1 :]
    safe = torch.where(den > 0, den, torch.ones_like(den))
    out = torch.where(den > 0, num / safe, torch.zeros_like(num))
    return (out, _log_normalizer(den, c)) if lse else out


def _log_normalizer(den: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """log(den) + c, the log of a normalizer den summed at the stabilizer c; -inf where den is 0."""
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, torch.log(safe) + c, torch.full_like(den, float("-inf")))


def _native_refusal(q, v, m, causal, tracked, dtypes=(), scale=None) -> str | None:
    """Why the native bidirectional walk (_native/hybrid_bidirectional.cpp) cannot run a call with m features, or
    None; dtypes: those of the other inputs it reads; scale: the logit scale (None: head_dim ** -0.5)."""
    d = q.shape[-1]
    if scale is not None and not scale > 0:
        return f"it takes a positive logit scale, got {scale}"
    if causal:
        return "the native hybrid walk is bidirectional only"
    if tracked:
        return "it computes no gradients, and autograd records this call (run it under torch.no_grad())"
    if q.device.type != "cpu":
        return "it runs on CPU tensors"
    if torch.float64 in (q.dtype, v.dtype, *dtypes):
        return "it computes in float32 (float64 inputs take 'chunked')"
    if v.shape[-1] != d:
        return f"it needs the value dim equal to head_dim, got {v.shape[-1]} and {d}"
    if d % 16 or m % 16:
        return f"head_dim and num_features must be multiples of 16, got {d} and {m}"
    if torch.compiler.is_compiling():
        return "it does not run inside a compiled graph"
    if not native_walk_enabled():
        return "it is switched off (set_native_walk(False))"
    if not native_available():
        return "the native CPU kernels are unavailable on this machine"
    return None


def hybrid_backend(
    backend: str | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    window: int,
    sinks: int,
    causal: bool,
    stateful: bool,
    tracked: bool = False,
    scale: float | None = None,
    select_blocks: int = 0,
    select_block_size: int = 32,
) -> str:
    """The backend a :func:`hybrid_attention` call takes: "chunked", "native" or "triton" (its ``backend``
    argument); ``tracked``: whether autograd records the call; ``scale``: its logit scale; ``select_blocks``,
    ``select_block_size``: its far blocks."""
    if backend is not None and backend not in HYBRID_BACKENDS:
        raise ValueError(f"backend must be None or one of {HYBRID_BACKENDS} for hybrid attention, got {backend!r}")
    if backend == "chunked":
        return "chunked"
    if backend == "native" or (backend is None and v.device.type != "cuda"):
        dtypes = (k.dtype, phi_q.dtype, phi_k.dtype)
        reason = _native_refusal(q, v, phi_q.shape[-1], causal, tracked, dtypes, scale)
        if backend == "native" and reason:
            raise ValueError(f"backend='native' cannot run this call: {reason}")
        return "chunked" if reason else "native"
    if causal:
        reason = _kernel_refusal(window, sinks, stateful)
    else:
        reason = _bidirectional_refusal(sinks, tracked, select_blocks, select_block_size)
    reason = reason or triton_refusal(v, phi_q.shape[-1], None, inputs=(q, k, phi_q, phi_k))
    if backend == "triton":
        if reason:
            raise ValueError(f"backend='triton' cannot run this call: {reason}")
        return "triton"
    return "chunked" if reason else "triton"


def _sinks(kc, vc, new_valid, sinks, p, past):
    """The sinks among a call's new tokens (the kept positions' sink status was settled before: their phi_k is
    zero): is_sink (b, n) bool, and None without sinks, else (keys (b, h, S, d), values (b, h, S, d_v), positions
    (b, S) int64 in the call's frame, validity (b, S) bool), the slots filled before keeping theirs. kc, vc carry
    the p kept positions first."""
    b, n = new_valid.shape
    if not sinks:
        return torch.zeros_like(new_valid), None
    seen_before = past.sink_valid.sum(-1) if past is not None else new_valid.new_zeros(b, dtype=torch.long)
    is_sink, slot = sink_slots(new_valid, sinks, seen_before)
    sink_valid = slot.any(-1)
    where = (slot.long() * torch.arange(n, device=kc.device)).sum(-1)  # (b, S): each sink's place, 0 if none yet

    def pick(x):  # (b, h, S, ·): the sinks' rows of x, zero in the slots not filled
        rows = x[:, :, p:].gather(2, where[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))
        return torch.where(sink_valid[:, None, :, None], rows, 0.0)

    sink_k, sink_v = pick(kc), pick(vc)
    sink_pos = where + p
    if past is not None:  # slots filled before keep their sink
        old = past.sink_valid
        sink_k = torch.where(old[:, None, :, None], past.sink_k.to(kc.dtype), sink_k)
        sink_v = torch.where(old[:, None, :, None], past.sink_v.to(vc.dtype), sink_v)
        sink_pos = torch.where(old, p - past.sink_distance, sink_pos)
        sink_valid = sink_valid | old
    return is_sink, (sink_k, sink_v, sink_pos, sink_valid)


@outside_autocast
def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    gamma: torch.Tensor,
    window: int,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: HybridState | None = None,
    return_state: bool = False,
    query_log_scale: torch.Tensor | None = None,
    sinks: int = 0,
    backend: str | None = None,
    select_blocks: int = 0,
    select_block_size: int = 32,
) -> torch.Tensor | tuple[torch.Tensor, HybridState]:
    """Sliding-window softmax + linear attention (module docstring).

    Args:
        q, k: (batch, heads, n, head_dim); v: (batch, heads, n, d_v).
        phi_q, phi_k: (batch, heads, n, m) nonnegative features of q and k (any feature map).
        gamma: (heads,) nonnegative weight of the window part, kept positive by its owner (e.g. exp of a parameter).
        window: positive int w: causal, t sees t - w < s <= t exactly; bidirectional, |s - t| < w.
        causal: see above; the linear part then holds only keys s <= t - w.
        key_padding_mask: (batch, n), True / 1 for real tokens.
        scale: softmax logit scale, head_dim ** -0.5 by default.
        initial_state: causal only, the state of an earlier call (continued prefill / decoding).
        return_state: causal only, also return the :class:`HybridState` after these tokens.
        query_log_scale: (batch, heads, n) finite ℓ_t, or None: the linear scores of query t are multiplied by
            exp(ℓ_t - c_t), which puts features on the softmax's scale (FAVOR+: ℓ_t = u_t - log m, module
            docstring). Per query, so a state carries nothing of it: pass each call its own queries' ℓ.
        sinks: S >= 0, the number of attention sinks: the first S real tokens of each sequence (counted from the
            start of the state's sequence when one is given) take exact scores from every query that sees them, as
            if in its window, and never the linear part (default 0).
        backend: None, "chunked" (this module's blocks, in PyTorch), "native" (_native/hybrid_bidirectional.cpp:
            bidirectional inference on the CPU, float32 math, head_dim = value dim and num_features multiples of
            16, where autograd records nothing) or "triton" (causal, :mod:`_triton_hybrid`: window <= 128, up to
            16 sinks, no initial_state; bidirectional, :mod:`_triton_hybrid_bidirectional`: where autograd records
            nothing, up to 16 sinks, far blocks of a power of two from 16 to 128; float32, bf16 or fp16). None
            takes "triton" on CUDA tensors where it can run (and :func:`backends.set_triton_kernels` leaves it on),
            "native" on CPU tensors where it can run (and :func:`backends.set_native_walk` leaves it on), else
            "chunked"; a named backend that cannot run raises a ValueError saying why.
        select_blocks: K >= 0, bidirectional with ``query_log_scale`` only: each block of ``select_block_size``
            queries chooses the K blocks of ``select_block_size`` far keys whose mean key its mean query scores
            highest, and its queries score their keys exactly, as in the window (:mod:`far_blocks`; default 0,
            none).
        select_block_size: B >= 1, the size of those blocks (default 32).

    Gradients reach q, k, v, phi_q, phi_k, gamma and query_log_scale. Returns (batch, heads, n, d_v) in v's dtype
    (and the state).
    """
    _check_inputs(q, k, v, phi_q, phi_k, gamma, window, query_log_scale, sinks)
    if (initial_state is not None or return_state) and not causal:
        raise ValueError("initial_state and return_state apply to causal attention only")
    _check_selection(select_blocks, select_block_size, causal, query_log_scale)
    tracked = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, phi_q, phi_k, gamma, query_log_scale)
    )
    stateful = initial_state is not None
    chosen = hybrid_backend(
        backend, q, k, v, phi_q, phi_k, window, sinks, causal, stateful, tracked, scale, select_blocks,
        select_block_size,
    )  # fmt: skip
    b, h, n, d = q.shape
    m, dv = phi_q.shape[-1], v.shape[-1]
    mask = check_mask(key_padding_mask, b, n)
    valid = torch.ones(b, n, dtype=torch.bool, device=q.device) if mask is None else mask
    dtype = _compute_dtype(q, k, v, phi_q, phi_k)
    scale = d**-0.5 if scale is None else scale
    qc, kc, vc, pqc, pkc = (x.to(dtype) for x in (q, k, v, phi_q, phi_k))
    ell = None if query_log_scale is None else query_log_scale.to(dtype)
    base = None
    p = 0
    past = None
    if initial_state is not None:
        past = _check_state(initial_state, b, h, window, sinks, d, m, dv, dtype, q.device)
        p = window - 1
        base = torch.cat([past.s, past.z[..., None]], -1)
        # the kept window's keys come first, with zero queries whose rows are dropped below
        qc = torch.cat([qc.new_zeros(b, h, p, d), qc], 2)
        pqc = torch.cat([pqc.new_zeros(b, h, p, m), pqc], 2)
        ell = None if ell is None else torch.cat([ell.new_zeros(b, h, p), ell], 2)
        kc = torch.cat([past.k.to(dtype), kc], 2)
        vc = torch.cat([past.v.to(dtype), vc], 2)
        pkc = torch.cat([past.phi_k.to(dtype), pkc], 2)
    new_valid = valid
    if past is not None:
        valid = torch.cat([past.valid, valid], 1)
    is_sink, sink = _sinks(kc, vc, new_valid, sinks, p, past)
    linear = valid & ~torch.cat([valid.new_zeros(b, p), is_sink], 1)
    if chosen == "triton":  # no initial state: p = 0, and the kernels take the inputs in their own dtypes
        sink_pos = torch.zeros(b, 0, dtype=torch.long, device=q.device)
        if sink is not None:
            sink_pos = torch.where(sink[3], sink[2], -1)
        where = dict(valid=valid, linear=linear, sink_pos=sink_pos, query_log_scale=query_log_scale, scale=scale)
        if causal:
            out = triton_causal_hybrid(q, k, v, phi_q, phi_k, gamma, window, **where)
        else:
            block = _bidirectional_block(select_blocks, select_block_size)
            picked = _far_block_choice(qc, kc, valid, linear, window, select_blocks, block) if select_blocks else None
            out = triton_bidirectional_hybrid(q, k, v, phi_q, phi_k, gamma, window, **where, chosen=picked, block=block)
    elif select_blocks:  # bidirectional: no state, p = 0; the hybrid's output and normalizer, then the far blocks
        args = (qc, kc, vc, pqc, pkc, ell, gamma, valid, linear, sink, window, scale, LOG_SCALE_HEADROOM)
        if chosen == "native" and select_block_size == HYBRID_BLOCK:  # the walk scores its choice itself
            picked = _far_block_choice(qc, kc, valid, linear, window, select_blocks)
            return hybrid_bidirectional_forward(*args, chosen=picked).to(v.dtype)
        if chosen == "native":
            out, log_norm = hybrid_bidirectional_forward(*args, lse=True)
        else:
            out, log_norm = _hybrid_core(
                qc, kc, vc, pqc, pkc, gamma, window, causal, valid, linear, scale, base, ell, sink, lse=True
            )
        args = (qc, kc, vc, pqc, pkc, gamma.to(dtype), ell, valid, linear, window, select_blocks, select_block_size)
        out = add_far_blocks(out, log_norm, *args, scale).to(v.dtype)
    elif chosen == "native":  # bidirectional: no state, p = 0
        args = (qc, kc, vc, pqc, pkc, ell, gamma, valid, linear, sink, window, scale, LOG_SCALE_HEADROOM)
        out = hybrid_bidirectional_forward(*args).to(v.dtype)
    else:
        out = _hybrid_core(qc, kc, vc, pqc, pkc, gamma, window, causal, valid, linear, scale, base, ell, sink)
        out = out[:, :, p:].to(v.dtype)
    if not return_state:
        return out
    # the state: keys before the last w - 1 positions join (S, z); the last w - 1 stay (invalid places in front
    # when fewer came)
    num_window_keys = window - 1
    total = kc.shape[2]
    leaving = max(total - num_window_keys, 0)
    pk_out = pkc[:, :, :leaving] * linear[:, None, :leaving, None].to(dtype)
    s_new = pk_out.transpose(-1, -2) @ vc[:, :, :leaving]
    z_new = pk_out.sum(2)
    if past is not None:
        s_new, z_new = s_new + past.s, z_new + past.z
    k_all = torch.cat([k.new_zeros(b, h, num_window_keys, d), past.k if past else k.new_zeros(b, h, 0, d), k], 2)
    v_all = torch.cat([v.new_zeros(b, h, num_window_keys, dv), past.v if past else v.new_zeros(b, h, 0, dv), v], 2)
    phi_k = phi_k * ~is_sink[:, None, :, None]  # a sink's features stay out of the linear part when it leaves
    f_all = torch.cat(
        [phi_k.new_zeros(b, h, num_window_keys, m), past.phi_k if past else phi_k.new_zeros(b, h, 0, m), phi_k], 2
    )
    valid_all = torch.cat([valid.new_zeros(b, num_window_keys), valid], 1)
    last = slice(valid_all.shape[1] - num_window_keys, None)
    if sink is None:
        sinks_out = (k.new_zeros(b, h, 0, d), v.new_zeros(b, h, 0, dv), valid.new_zeros(b, 0))
        distance = torch.zeros(b, 0, dtype=torch.long, device=q.device)
    else:
        sinks_out = (sink[0].to(k.dtype), sink[1].to(v.dtype), sink[3])
        distance = torch.where(sink[3], total - sink[2], torch.zeros_like(sink[2]))
    state = HybridState(
        s_new, z_new, k_all[:, :, last], v_all[:, :, last], f_all[:, :, last], valid_all[:, last], *sinks_out, distance
    )
    return out, state


@outside_autocast
def hedgehog_hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    gamma: torch.Tensor,
    window: int,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    query_scale: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_scale: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_scale_bound: float = 1.0,
    sinks: int = 0,
    select_blocks: int = 0,
) -> torch.Tensor:
    """Bidirectional :func:`hybrid_attention` with Hedgehog's features and the learned log scales made inside the
    native walk, a block at a time. Features: phi(x) = [softmax(x W + b), softmax(-(x W + b))]
    (:class:`feature_maps.HedgehogFeatureMap`) from ``weights`` = (W_q, b_q, W_k, b_k), (heads, head_dim, m / 2)
    and (heads, m / 2). Scales, from (a (heads, head_dim), b (heads,)) pairs: ``query_scale`` gives
    query_log_scale ℓ_t = q_t·a_h + b_h; ``key_scale`` multiplies phi_k by exp(r_s), r_s = R tanh((k_s·a_h + b_h)
    / R), R = ``key_scale_bound``. The result is hybrid_attention(q, k, v, phi(q), phi(k) exp(r), gamma, window,
    causal=False, query_log_scale=ℓ, ...), computed without the (batch, heads, n, m) feature tensors or any other
    per-position temporary, each of which would be a fresh mapping whose pages fault in again at every call at a
    long document's length. Inference only, on the CPU: :func:`hedgehog_refusal` says why a call cannot run, and
    such a call raises a ValueError saying so. ``select_blocks``: as hybrid_attention's, with blocks of
    HYBRID_BLOCK = 32 (the walk's own). Returns (batch, heads, n, head_dim) in v's dtype."""
    _check_inputs(q, k, v, None, None, gamma, window, None, sinks)
    h, d = q.shape[1], q.shape[-1]
    if select_blocks and query_scale is None:
        raise ValueError("select_blocks needs query_scale: the linear scores on the softmax's scale")
    _check_selection(select_blocks, HYBRID_BLOCK, False, True)
    named = [("weights", weights, ("W_q", "b_q", "W_k", "b_k"))]
    named += [
        (name, pair, (f"{name}[0]", f"{name}[1]"))
        for name, pair in (("query_scale", query_scale), ("key_scale", key_scale))
        if pair is not None
    ]
    for name, group, parts in named:
        if (
            not isinstance(group, (tuple, list))
            or len(group) != len(parts)
            or not all(isinstance(t, torch.Tensor) for t in group)
        ):
            raise TypeError(f"{name} must be a tuple of {len(parts)} tensors ({', '.join(parts)})")
    half = weights[0].shape[-1]
    shapes = [(weights, ((h, d, half), (h, half)) * 2)] + [(pair, ((h, d), (h,))) for _, pair, _ in named[1:]]
    for (_, _, parts), (group, wanted) in zip(named, shapes):
        for part, t, shape in zip(parts, group, wanted):
            if tuple(t.shape) != shape:
                raise ValueError(f"{part} must be shaped {shape}, got {tuple(t.shape)}")
    if isinstance(key_scale_bound, bool) or not isinstance(key_scale_bound, (int, float)) or not key_scale_bound > 0:
        raise ValueError(f"key_scale_bound must be a positive number, got {key_scale_bound!r}")
    inputs = (q, k, v, *weights, gamma, *(query_scale or ()), *(key_scale or ()))
    reason = hedgehog_refusal(q, v, 2 * half, inputs, scale)
    if reason:
        raise ValueError(f"hedgehog_hybrid_attention cannot run this call: {reason}")
    b, n = q.shape[0], q.shape[2]
    mask = check_mask(key_padding_mask, b, n)
    valid = torch.ones(b, n, dtype=torch.bool, device=q.device) if mask is None else mask
    qc, kc, vc = (x.float() for x in (q, k, v))
    is_sink, sink = _sinks(kc, vc, valid, sinks, 0, None)
    scale = d**-0.5 if scale is None else scale
    args = (qc, kc, vc, None, None, None, gamma, valid, valid & ~is_sink, sink, window, scale, LOG_SCALE_HEADROOM)
    forms = {"query_form": query_scale, "key_form": key_scale, "bound": float(key_scale_bound)}
    if select_blocks:
        forms["chosen"] = _far_block_choice(qc, kc, valid, valid & ~is_sink, window, select_blocks)
    return hybrid_bidirectional_forward(*args, hedgehog=weights, **forms).to(v.dtype)


def hedgehog_refusal(
    q: torch.Tensor,
    v: torch.Tensor,
    num_features: int,
    inputs: tuple[torch.Tensor | None, ...] = (),
    scale: float | None = None,
) -> str | None:
    """Why :func:`hedgehog_hybrid_attention` cannot run a call with these q, v and ``num_features`` (the m of
    Hedgehog's map), or None. ``inputs``: the call's other tensors (None for absent ones), whose dtypes it reads
    and of which autograd must record none; ``scale``: its logit scale (None: head_dim ** -0.5)."""
    present = [t for t in inputs if isinstance(t, torch.Tensor)]
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in present)
    return _native_refusal(q, v, num_features, False, tracked, tuple(t.dtype for t in present), scale)


def hybrid_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    gamma: torch.Tensor,
    window: int,
    state: HybridState | None,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    query_log_scale: torch.Tensor | None = None,
    sinks: int = 0,
) -> tuple[torch.Tensor, HybridState]:
    """One causal decoding step (tokens of length 1) from the state of a prefill or of earlier steps (None: the
    first token). Reads the w - 1 kept keys, the new one and (S, z): constant memory and time in the context length.
    ``query_log_scale`` (batch, heads, 1): the new query's ℓ, and ``sinks``, as in :func:`hybrid_attention`.
    Returns (out (batch, heads, 1, d_v) in v's dtype, the new state)."""
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[2] != 1:
        raise ValueError(f"hybrid_step takes one new token, got length {q.shape[2]}; use hybrid_attention to prefill")
    return hybrid_attention(
        q,
        k,
        v,
        phi_q,
        phi_k,
        gamma,
        window,
        causal=True,
        key_padding_mask=key_padding_mask,
        scale=scale,
        initial_state=state,
        return_state=True,
        query_log_scale=query_log_scale,
        sinks=sinks,
    )
