"""FAVOR+ (Choromanski et al., 2021, "Rethinking Attention with Performers").

All functions take tensors shaped (batch, heads, length, head_dim) and return the same layout. Feature maps,
sums and the final division run in float32 whatever the input dtype, so bf16/fp16 inputs stay finite, and in
float64 for float64 inputs; the output is cast back to the dtype of ``v``. An ambient ``torch.autocast`` changes
none of this (see _precision).

Stabilization. The positive softmax features are exp(w·x - |x|²/2) / sqrt(m) (Lemma 1). Implementations
usually subtract the maximum over *all keys* before exp, which reads future tokens in causal mode (and,
together with an additive epsilon, changes past outputs). Here every key feature is shifted by a constant
that depends on the feature only, never on other tokens:

    phi_k(k)_i = exp(w_i·k - |k|²/2 - |w_i|²/2) = exp(-|w_i - k|² / 2)     (always in (0, 1])
    phi_q(q)_i = exp(w_i·q - |q|²/2 + |w_i|²/2 - max_j[...])                (per-query max, in (0, 1])

The two shifts cancel in phi_q·phi_k, and the per-query max cancels between numerator and denominator. Each
feature of a key depends on that key alone, so causal outputs never see the future, and for keys of moderate
norm the recurrent decoding state needs no rescaling. Keys of large norm (|k| scale^½ beyond ~15), whose
features underflow float32 at this offset, are taken relative to a maximum of earlier key exponents instead:
a running one (bidirectional), a prefix one per position (causal; rare calls only), and the decoding state's
offset M (see favor_step).

The random features. Every function here takes them as ``random_features``: the matrix W (num_features m, head_dim)
drawn by :func:`feature_maps.draw_random_features`, whose rows w_i are the random directions above (a Performer
keeps it as its ``random_features`` buffer). The code calls it ``w`` once it is in the compute dtype. It is a
fixed draw: the ops do not differentiate through it.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_mask, check_qkv, renamed_keywords
from ._favor_blockwise import BIDIRECTIONAL_BLOCK, FavorBidirectional
from ._favor_chunked import (
    DEFAULT_CHUNK,
    FavorBidirectionalChunked,
    FavorCausalChunked,
    favor_causal_offsets,
    half_operands,
)
from ._favor_native import FavorCausalNative
from ._precision import outside_autocast
from ._triton_bidirectional import triton_bidirectional_linear
from ._triton_causal import triton_causal_linear
from .backends import NATIVE_CHUNK, TRITON_CHUNK, choose_backend
from .feature_maps import RANDOM_FEATURE_MAPS, compute_dtype, favor_exponents, random_feature_map
from .reference import favor_reference

_TINY = 1e-30  # floor for denominators that are exactly zero (every key padded), never reached otherwise


@renamed_keywords("0.3.0", projection="random_features", kernel="feature_map", kernel_eps="feature_eps")
@outside_autocast
def favor_features(
    x: torch.Tensor,
    random_features: torch.Tensor,
    *,
    is_query: bool,
    feature_map: str = "softmax",
    scale: float | None = None,
    feature_eps: float = 1e-3,
) -> torch.Tensor:
    """Feature map phi: (batch, heads, length, head_dim) -> (batch, heads, length, num_features), float32 (float64
    for float64 x).

    ``feature_map="softmax"``: the stabilized positive random features of Lemma 1 (:func:`feature_maps.favor_positive`);
    phi_q(q)·phi_k(k) is proportional, per query, to the unbiased estimate of exp(scale * q·k).
    ``feature_map="relu"``: the generalized kernel phi(x) = ReLU(W x') + eps (Section 2.2,
    :func:`feature_maps.relu_features`), the same map for queries and keys; x' = x * scale**0.5.
    ``random_features``: the random features W (num_features, head_dim) drawn by :func:`draw_random_features`.
    """
    features = random_feature_map(
        x, random_features, is_query=is_query, feature_map=feature_map, scale=scale, eps=feature_eps
    )
    return features.to(compute_dtype(x))


def _exponents(x, w, scale, *, is_query):
    """The softmax features' exponents in float32 (float64 for float64 x), (b, h, n, m):
    :func:`feature_maps.favor_exponents`."""
    return favor_exponents(x, w, is_query=is_query, scale=scale).to(compute_dtype(x))


def _masked_inputs(
    phi_k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero phi(k) and v at padded positions so they leave both numerator and denominator."""
    v = v.to(phi_k.dtype)
    if key_padding_mask is None:
        return phi_k, v
    key_weights = key_padding_mask[:, None, :, None]
    return phi_k * key_weights, v * key_weights


def _check_favor_args(q, k, v, random_features, key_padding_mask, feature_map, *, causal: bool) -> torch.Tensor | None:
    check_qkv(q, k, v, same_length=causal)
    if not isinstance(random_features, torch.Tensor):
        raise TypeError(f"random_features must be a torch.Tensor, got {type(random_features).__name__}")
    if feature_map not in RANDOM_FEATURE_MAPS:
        raise ValueError(f"unknown FAVOR+ feature map {feature_map!r}; choose one of {RANDOM_FEATURE_MAPS}")
    if random_features.dim() != 2 or random_features.shape[1] != q.shape[-1]:
        raise ValueError(
            f"random_features must be shaped (num_features, head_dim={q.shape[-1]}), got {tuple(random_features.shape)}"
        )
    return check_mask(key_padding_mask, k.shape[0], k.shape[2])


@renamed_keywords("0.3.0", projection="random_features")
def favor_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    random_features: torch.Tensor,
    *,
    causal: bool = False,
    chunk_size: int | None = None,
    initial_state: tuple[torch.Tensor, ...] | None = None,
    return_state: bool = False,
    backend: str | None = None,
) -> str:
    """The backend :func:`favor_attention` runs for these arguments, one of ``backends.BACKENDS``: the name it
    dispatches on, so asking this is how a test, a benchmark or a user learns which code a call takes. A named
    backend that cannot run the call raises the ValueError the call would. ``random_features``: the random features
    (num_features, head_dim) drawn by :func:`draw_random_features`, as :func:`favor_attention` takes them.

    Continued prefills (``initial_state``) run "chunked" whatever is named: the state's offset M needs the chunked
    form with per-position offsets. One choice depends on the data and shows only after the call: a causal
    softmax call whose keys are of large norm (a position lost every key at offset 0) is redone in that form too,
    and then the state it returns (``return_state=True``) has M < 0 (the prefix maximum of the key exponents),
    where the backend's own pass hands over M = 0."""
    _check_favor_args(q, k, v, random_features, None, "softmax", causal=causal)
    return _chosen_backend(q, k, v, random_features, causal, chunk_size, initial_state, return_state, backend)


def _chosen_backend(q, k, v, random_features, causal, chunk_size, initial_state, return_state, backend) -> str:
    state_in = initial_state is not None
    chosen = choose_backend(
        backend,
        v,
        random_features.shape[0],
        chunk_size,
        causal=causal,
        state_in=state_in,
        state_out=return_state,
        inputs=(q, k),
    )
    return "chunked" if state_in else chosen


@renamed_keywords("0.3.0", projection="random_features", kernel="feature_map", kernel_eps="feature_eps")
@outside_autocast
def favor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    random_features: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    feature_map: str = "softmax",
    scale: float | None = None,
    chunk_size: int | None = None,
    block_size: int | None = None,
    feature_eps: float = 1e-3,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_state: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """FAVOR+ attention  out = D⁻¹ (phi(Q) (phi(K)ᵀ V)),  D = diag(phi(Q) (phi(K)ᵀ 1))   (Eq. 7-9).

    Args:
        q, k, v: (batch, heads, length, head_dim).
        random_features: the random features W (num_features, head_dim) drawn by :func:`draw_random_features` (a
            Performer's ``random_features`` buffer): a fixed draw, not differentiated through.
        causal: position t attends to keys <= t, through chunked prefix sums (Section 2.6).
        key_padding_mask: (batch, length), True / 1 for real tokens; padded keys leave both sums.
        chunk_size: causal chunk C; None: 64 for the chunked backend (see _favor_chunked) and the Triton kernels, 32
            for the native walk. Bidirectional with backend="triton": the kernels' tile of positions (default 64).
        block_size: positions per block: the bidirectional kernel builds its feature maps this many positions at a
            time (default 256), and the native walk keeps its state for backward every block (rounded to whole
            chunks; default 16 chunks). Memory against per-block overhead; results do not depend on it.
        initial_state: causal only, the state of an earlier call: (S, z, M), or (S, z) for M = 0, with
            S (b, h, m, d_v), z (b, h, m) and the offset M (b, h); see :func:`favor_step`.
        return_state: causal only, also return the final state (S, z, M) for recurrent decoding.
        backend: None, "chunked", "triton", "native" (causal), "blockwise" (bidirectional) or "reference"; see
            :mod:`backends` (None: causal, the Triton kernels on CUDA, the compiled CPU walk where it runs and the
            chunked backend elsewhere;
            bidirectional, the Triton kernels on CUDA, the blockwise kernel on the CPU and the chunked one elsewhere
            and under torch.compile on the CPU); :func:`favor_backend` names the one a call takes.
            Causal softmax calls whose keys are of large norm (every visible key's features underflowed at offset
            0), and softmax continued prefills, run the chunked form with per-position offsets
            (:func:`_favor_chunked.favor_causal_offsets`) whatever the backend.

    Memory, per head. The native walk keeps the state at each block start and O(n d) of inputs and outputs; the
    chunked backend keeps q, k, v and the output for backward and holds O(n (m + m d / C + C)) while it runs
    (bidirectional: O(n m)); the blockwise kernel holds O(block_size m) of feature maps at a time; the
    bidirectional Triton kernels keep O(n d) and KV, m (d + 1), and write no feature map.

    Returns:
        (batch, heads, length, head_dim) in v's dtype, and the state when ``return_state``.
    """
    mask = _check_favor_args(q, k, v, random_features, key_padding_mask, feature_map, causal=causal)
    if (initial_state is not None or return_state) and not causal:
        raise ValueError("initial_state and return_state apply to causal FAVOR+ only")
    for name, value in (("chunk_size", chunk_size), ("block_size", block_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(f"favor_attention needs v's head_dim equal to q's, got {v.shape[-1]} and {q.shape[-1]}")
    if random_features.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "random_features is a fixed draw of random features, not a parameter: favor_attention does not "
            "differentiate through it; pass random_features.detach() (models keep it as a buffer)"
        )
    state_in = initial_state is not None
    chosen = _chosen_backend(q, k, v, random_features, causal, chunk_size, initial_state, return_state, backend)
    if chosen == "reference":
        return favor_reference(
            q,
            k,
            v,
            random_features,
            causal=causal,
            key_padding_mask=mask,
            feature_map=feature_map,
            scale=scale,
            feature_eps=feature_eps,
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    w = random_features.to(device=q.device, dtype=compute_dtype(v))  # float64 inputs: float64 math throughout
    key_weights = None if mask is None else mask[:, None, :, None].float()
    if chosen == "blockwise":  # hand-written backwards that recompute the feature maps, in both
        return FavorBidirectional.apply(
            q, k, v, w, key_weights, feature_map, scale, feature_eps, block_size or BIDIRECTIONAL_BLOCK
        )
    if not causal and chosen == "triton":  # both products with the feature maps computed inside the kernels
        mask_f = None if mask is None else mask.float()
        return triton_bidirectional_linear(
            q, k, v, w, mask_f, feature_map, scale, feature_eps, chunk_size or TRITON_CHUNK
        )
    if not causal:
        return FavorBidirectionalChunked.apply(
            q, k, v, w, key_weights, feature_map, scale, feature_eps, half_operands(v)
        )
    if state_in:
        initial_state = _unpack_state(initial_state, q, v, w)
        if feature_map == "softmax":  # offsets per position, continuing from the state's own
            out, state = favor_causal_offsets(q, k, v, w, key_weights, scale, chunk_size, initial_state)
        else:  # ReLU features need no offset: the chunked backend takes the state as true sums (offset 0)
            s0, z0 = _at_offset_zero(initial_state)
            out, s, z, _ = FavorCausalChunked.apply(
                q,
                k,
                v,
                w,
                key_weights,
                feature_map,
                scale,
                feature_eps,
                chunk_size or DEFAULT_CHUNK,
                torch.cat([s0, z0[..., None]], -1),
                half_operands(v),
            )
            state = (s, z, torch.zeros_like(initial_state[2]))
        return (out, state) if return_state else out
    if chosen == "native":
        chunk = chunk_size or NATIVE_CHUNK
        block_chunks = None if block_size is None else max(1, block_size // chunk)
        out, s, z, lost = FavorCausalNative.apply(
            q, k, v, w, key_weights, feature_map, scale, feature_eps, chunk, block_chunks
        )
    elif chosen == "triton":  # the feature maps computed inside the kernels
        mask_f = None if mask is None else mask.float()
        chunk = chunk_size or TRITON_CHUNK
        out, s, z, lost = triton_causal_linear(q, k, v, w, mask_f, feature_map, scale, feature_eps, chunk, None, None)
    else:
        out, s, z, lost = FavorCausalChunked.apply(
            q,
            k,
            v,
            w,
            key_weights,
            feature_map,
            scale,
            feature_eps,
            chunk_size or DEFAULT_CHUNK,
            None,
            half_operands(v),
        )
    state = (s, z, s.new_zeros(s.shape[:2]))  # both run at offset M = 0
    if feature_map == "softmax":
        out, state = _redone_if_lost(lost, out, state, q, k, v, w, key_weights, scale, chunk_size)
    return (out, state) if return_state else out


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense (contiguous) gradient: torch.cond's backward needs its branches'
    input gradients laid out alike, and autograd's gradient of a slice (v inside [v, 1]) is a strided view."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _redone_if_lost(lost, out, state, q, k, v, w, key_weights, scale, chunk_size):
    """(out, state) of a causal softmax call, redone with per-position offsets (favor_causal_offsets) when it lost
    positions: keys of large norm whose every feature underflowed at offset 0. Eagerly, one host sync per call reads
    the count; under torch.compile the choice is a ``torch.cond`` on the device, so the graph does not break and
    no sync is needed (both branches are traced, one runs)."""

    def redo(q, k, v, w, *_):
        q, k, v = (_DenseGrad.apply(t) for t in (q, k, v))
        redone, (s, z, m) = favor_causal_offsets(q, k, v, w, key_weights, scale, chunk_size)
        # dense and alias-free, as torch.cond wants its branches' outputs
        return redone.contiguous(), *(t.detach().contiguous().clone() for t in (s, z, m))

    def keep_fast(q, k, v, w, fast, s, z, m):  # hands on dense gradients, as the other branch's zeros are
        return tuple(_DenseGrad.apply(t).contiguous().clone() for t in (fast, s, z, m))

    if torch.compiler.is_compiling():
        # dense operands and gradients: a branch gives the operands it does not use zero gradients laid out as those
        # operands are, and the ones it uses what _DenseGrad hands on; inductor wants both branches' alike
        operands = tuple(t.contiguous() for t in (q, k, v, w, out, *state))
        out, *state = torch.cond(lost > 0, redo, keep_fast, operands)
        return out, tuple(state)
    if bool(lost):
        out, *state = redo(q, k, v, w)
        return out, tuple(state)
    return out, state


_OFFSET_SLACK = 30.0  # a state's offset moves down only once everything in it sits this far (in e-folds) below


def _unpack_state(state, q, v, w):
    """(S, z, M) in w's dtype (float32, float64 for float64 inputs) from a state given as (S, z, M), (S, z)
    (M = 0) or None (empty), with its shapes checked."""
    b, h = q.shape[:2]
    m, d = w.shape[0], v.shape[-1]
    if state is None:
        s = torch.zeros(b, h, m, d, dtype=w.dtype, device=q.device)
        return s, s.new_zeros(b, h, m), s.new_zeros(b, h)
    if not isinstance(state, (tuple, list)) or len(state) not in (2, 3):
        raise TypeError(f"a FAVOR+ state is a tuple (S, z) or (S, z, M), got {type(state).__name__}")
    if not all(isinstance(t, torch.Tensor) for t in state):
        raise TypeError("a FAVOR+ state holds tensors: (S, z) or (S, z, M)")
    s, z = state[0], state[1]
    offset = state[2] if len(state) == 3 else torch.zeros(b, h, dtype=w.dtype, device=s.device)
    expected = ((b, h, m, d), (b, h, m), (b, h))
    if (tuple(s.shape), tuple(z.shape), tuple(offset.shape)) != expected:
        raise ValueError(
            f"the state must be S {expected[0]}, z {expected[1]} and M {expected[2]} for these inputs, got "
            f"{tuple(s.shape)}, {tuple(z.shape)} and {tuple(offset.shape)}"
        )
    return s.to(w.dtype), z.to(w.dtype), offset.to(w.dtype)


def _at_offset_zero(state):
    """(S, z) of a (S, z, M) state as true sums, exp(M) S and exp(M) z."""
    s, z, offset = state
    factor = torch.exp(offset)
    return s * factor[..., None, None], z * factor[..., None]


def _state_level(z, offset):
    """log of the largest entry of z in absolute terms, M + log max z: -inf for an empty state."""
    return offset + torch.log(z.detach().amax(-1))


def _moved_offset(offset, top, level):
    """The state's next offset, per (batch, head): up to the new key's top exponent when that exceeds it (its
    features would pass 1), down to the highest of the key and the state when both sit more than _OFFSET_SLACK
    e-folds below it (they would head for float32's underflow); otherwise unchanged, so a state of moderate keys
    stays at offset 0, as the chunked walk leaves it."""
    target = torch.maximum(top, level)
    move = ((top > offset) | (target < offset - _OFFSET_SLACK)) & torch.isfinite(target)
    return torch.where(move, target, offset)


@renamed_keywords("0.3.0", projection="random_features", kernel="feature_map", kernel_eps="feature_eps")
@outside_autocast
def favor_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    random_features: torch.Tensor,
    state: tuple[torch.Tensor, ...] | None,
    *,
    key_padding_mask: torch.Tensor | None = None,
    feature_map: str = "softmax",
    scale: float | None = None,
    feature_eps: float = 1e-3,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One recurrent decoding step of causal FAVOR+ for new tokens of length 1.

    S_t = S_{t-1} + phi(k_t) v_tᵀ,  z_t = z_{t-1} + phi(k_t),  out_t = phi(q_t) S_t / phi(q_t)·z_t.
    State sizes are fixed: S (b, h, m, d_v), z (b, h, m), so a step costs the same at any context length.

    The state is (S, z, M): S and z are kept relative to an offset M (b, h), the true sums being exp(M) S and
    exp(M) z; a (S, z) state means M = 0. Key features are at most 1 at offset 0 and keys of moderate norm leave
    M at 0. A key whose features would underflow there (|k| scale^½ beyond ~15) or pass 1 moves M, rescaling S and
    z by the same factor, which cancels in out_t, so such keys count in decoding as they do in
    :func:`favor_attention`. ``random_features``: the random features (num_features, head_dim) drawn by
    :func:`draw_random_features`, the same draw as the prefill's. ``key_padding_mask`` (batch, 1) drops a padded
    new token from the state. Returns (out, (S, z, M)).
    """
    mask = _check_favor_args(q, k, v, random_features, key_padding_mask, feature_map, causal=True)
    if q.shape[2] != 1:
        raise ValueError(f"favor_step takes one new token, got length {q.shape[2]}; use favor_attention to prefill")
    w = random_features.to(device=q.device, dtype=compute_dtype(v))  # float64 inputs: float64 math throughout
    s0, z0, offset = _unpack_state(state, q, v, w)
    phi_q = favor_features(
        q, random_features, is_query=True, feature_map=feature_map, scale=scale, feature_eps=feature_eps
    )
    if feature_map == "relu":  # bounded features: the state stays at offset 0
        phi_k = favor_features(
            k, random_features, is_query=False, feature_map=feature_map, scale=scale, feature_eps=feature_eps
        )
        (s0, z0), offset = _at_offset_zero((s0, z0, offset)), torch.zeros_like(offset)
    else:
        u = _exponents(k, w, q.shape[-1] ** -0.5 if scale is None else scale, is_query=False)  # (b, h, 1, m)
        if mask is not None:  # before exp: a padded key may sit far above the state's offset (inf x 0)
            u = u.masked_fill(~mask[:, None, :, None], -math.inf)
        top = u.amax(-1)[..., 0]  # (b, h)
        level = _state_level(z0, offset)
        moved = _moved_offset(offset, top, level)
        # 1 where M stays; an empty state (z = 0, so S = 0) takes 0, not exp of a gap that may overflow
        factor = torch.where(torch.isfinite(level), torch.exp(offset - moved), torch.zeros_like(level))
        s0, z0, offset = s0 * factor[..., None, None], z0 * factor[..., None], moved
        phi_k = torch.exp(u - offset[..., None, None])
    phi_k, vf = _masked_inputs(phi_k, v, mask)
    s_new = torch.matmul(phi_k.transpose(-1, -2), vf) + s0  # (b, h, m, d)
    z_new = phi_k.squeeze(2) + z0
    num = torch.matmul(phi_q, s_new)
    den = torch.matmul(phi_q, z_new.unsqueeze(-1))
    return (num / den.clamp_min(_TINY)).to(v.dtype), (s_new, z_new, offset)
