"""Linear attention on precomputed features: the entry any feature map runs through (see :mod:`feature_maps`).

    out_t = Σ_s (phi_q,t · phi_k,s) v_s / Σ_s phi_q,t · phi_k,s        (s <= t when causal; padded keys left out)

The features carry no offset here (a learned map's or the ReLU map's are bounded; FAVOR+'s own entry,
:func:`favor.favor_attention`, keeps offsets for keys of large norm), so the decoding state is (S, z) =
(Σ phi_k vᵀ, Σ phi_k), float32 (float64 for float64 inputs), (b, h, m, d) and (b, h, m). Backends are chosen in
:mod:`backends`.
"""

from __future__ import annotations

import torch

from ._checks import check_mask
from ._favor_chunked import DEFAULT_CHUNK, FavorBidirectionalChunked, FavorCausalChunked, half_operands
from ._linear_native import LinearCausalNative
from ._precision import outside_autocast
from ._triton_bidirectional import triton_bidirectional_linear
from ._triton_causal import triton_causal_linear
from .backends import NATIVE_CHUNK, TRITON_CHUNK, choose_backend
from .reference import linear_reference

_TINY = 1e-30


def _check_features(phi_q, phi_k, v, *, same_length):
    for name, t in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be shaped (batch, heads, length, features), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(
            f"phi_q and phi_k need the same number of features, got {phi_q.shape[-1]} and {phi_k.shape[-1]}"
        )
    if phi_k.shape[:3] != v.shape[:3]:
        raise ValueError(f"phi_k {tuple(phi_k.shape)} and v {tuple(v.shape)} must share batch, heads and length")
    if phi_q.shape[:2] != v.shape[:2]:
        raise ValueError(f"phi_q {tuple(phi_q.shape)} and v {tuple(v.shape)} must share batch and heads")
    if same_length and phi_q.shape[2] != phi_k.shape[2]:
        raise ValueError(f"causal attention needs as many queries as keys, got {phi_q.shape[2]} and {phi_k.shape[2]}")
    if same_length and phi_q.shape[2] == 0:
        raise ValueError("phi_q, phi_k, v have length 0: causal attention needs at least one token")


def _state(state, b, h, m, d, device, dtype):
    """(S, z) in ``dtype`` (float32, float64 for float64 inputs) from a state given as (S, z), or (S, z, M) with
    M = 0, or None (empty); shapes checked."""
    if state is None:
        s = torch.zeros(b, h, m, d, dtype=dtype, device=device)
        return s, s.new_zeros(b, h, m)
    if not isinstance(state, (tuple, list)) or len(state) not in (2, 3):
        raise TypeError(f"a linear-attention state is a tuple (S, z), got {type(state).__name__}")
    if not all(isinstance(t, torch.Tensor) for t in state):
        raise TypeError("a linear-attention state holds tensors: (S, z)")
    s, z = state[0], state[1]
    if len(state) == 3 and bool((state[2] != 0).any()):
        raise ValueError("a linear-attention state has no offset; this one has M != 0 (a FAVOR+ state: use favor_step)")
    if (tuple(s.shape), tuple(z.shape)) != ((b, h, m, d), (b, h, m)):
        raise ValueError(
            f"the state must be S {(b, h, m, d)} and z {(b, h, m)}, got {tuple(s.shape)} and {tuple(z.shape)}"
        )
    return s.to(dtype), z.to(dtype)


def _work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32, float64 when any input is float64: float64 in, float64 math."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _key_weights(mask):
    """The Triton kernels' key mask: (b, n) float, 1 for real keys, or None."""
    return None if mask is None else mask.float()


def linear_backend(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    chunk_size: int | None = None,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_state: bool = False,
    backend: str | None = None,
) -> str:
    """The backend :func:`linear_attention` runs for these arguments, one of ``backends.BACKENDS`` ("blockwise"
    aside: it fuses the FAVOR+ map): the name it dispatches on, so asking this is how a test, a benchmark or a user
    learns which code a call takes. A named backend that cannot run the call raises the ValueError the call
    would."""
    _check_features(phi_q, phi_k, v, same_length=causal)
    return _chosen_backend(phi_q, phi_k, v, causal, chunk_size, initial_state, return_state, backend)


def _chosen_backend(phi_q, phi_k, v, causal, chunk_size, initial_state, return_state, backend) -> str:
    return choose_backend(
        backend,
        v,
        phi_q.shape[-1],
        chunk_size,
        causal=causal,
        state_in=initial_state is not None,
        state_out=return_state,
        fused=False,
        inputs=(phi_q, phi_k),
    )


@outside_autocast
def linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_state: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Linear attention of precomputed nonnegative features (module docstring).

    Args:
        phi_q, phi_k: (batch, heads, length, m) features of the queries and keys, from any :class:`FeatureMap`.
        v: (batch, heads, length, d_v).
        causal: position t attends to keys <= t.
        key_padding_mask: (batch, length), True / 1 for real tokens; padded keys leave both sums.
        chunk_size: causal chunk; None: each backend's default (64 chunked and triton, 32 native).
        initial_state: causal only, the (S, z) of an earlier call (continued prefill).
        return_state: causal only, also return the final (S, z).
        backend: None (see :mod:`backends`; :func:`linear_backend` names the one a call takes), "reference",
            "chunked", "triton" or "native" (causal); bidirectional "triton" runs only when named (its fused-map form
            is the FAVOR+ default on CUDA), with chunk_size its tile of positions.

    Gradients reach phi_q, phi_k and v (and the initial state), so a learned map trains through any backend.
    Returns (batch, heads, length, d_v) in v's dtype, and the state when ``return_state``.
    """
    _check_features(phi_q, phi_k, v, same_length=causal)
    mask = check_mask(key_padding_mask, phi_k.shape[0], phi_k.shape[2])
    if (initial_state is not None or return_state) and not causal:
        raise ValueError("initial_state and return_state apply to causal attention only")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    b, h, _, m = phi_q.shape
    d = v.shape[-1]
    chosen = _chosen_backend(phi_q, phi_k, v, causal, chunk_size, initial_state, return_state, backend)
    if chosen == "reference":
        return linear_reference(phi_q, phi_k, v, causal=causal, key_padding_mask=mask)
    key_weights = None if mask is None else mask[:, None, :, None].float()
    if not causal and chosen == "triton":  # named only
        return triton_bidirectional_linear(
            phi_q, phi_k, v, None, _key_weights(mask), "features", 1.0, 0.0, chunk_size or TRITON_CHUNK
        )
    if not causal:
        return FavorBidirectionalChunked.apply(
            phi_q, phi_k, v, None, key_weights, "features", 1.0, 0.0, half_operands(v)
        )
    if chosen == "native":
        out, s, z = LinearCausalNative.apply(phi_q, phi_k, v, key_weights, chunk_size or NATIVE_CHUNK, None)
        return (out, (s, z)) if return_state else out
    s_in = z_in = None
    if initial_state is not None:
        s_in, z_in = _state(initial_state, b, h, m, d, v.device, _work_dtype(phi_q, phi_k, v))
    if chosen == "triton":
        out, s, z, _ = triton_causal_linear(
            phi_q, phi_k, v, None, _key_weights(mask), "features", 1.0, 0.0, chunk_size or TRITON_CHUNK, s_in, z_in
        )
        return (out, (s, z)) if return_state else out
    s0 = None
    if initial_state is not None:
        s0 = torch.cat([s_in, z_in[..., None]], -1)
    out, s, z, _ = FavorCausalChunked.apply(
        phi_q, phi_k, v, None, key_weights, "features", 1.0, 0.0, chunk_size or DEFAULT_CHUNK, s0, half_operands(v)
    )
    return (out, (s, z)) if return_state else out


@outside_autocast
def linear_step(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One decoding step for new tokens of length 1: S += phi_k vᵀ, z += phi_k, out = phi_q S / phi_q·z.

    The state's size is fixed, so a step costs the same at any context length. ``key_padding_mask`` (batch, 1)
    drops a padded new token from the state. Returns (out in v's dtype, (S, z))."""
    _check_features(phi_q, phi_k, v, same_length=True)
    if phi_q.shape[2] != 1:
        raise ValueError(
            f"linear_step takes one new token, got length {phi_q.shape[2]}; use linear_attention to prefill"
        )
    mask = check_mask(key_padding_mask, phi_k.shape[0], 1)
    b, h, _, m = phi_q.shape
    work = _work_dtype(phi_q, phi_k, v)
    s0, z0 = _state(state, b, h, m, v.shape[-1], v.device, work)
    pk, vf = phi_k.to(work), v.to(work)
    if mask is not None:
        key_weights = mask[:, None, :, None].to(work)
        pk, vf = pk * key_weights, vf * key_weights
    s = s0 + pk.transpose(-1, -2) @ vf
    z = z0 + pk[:, :, 0]
    pq = phi_q.to(work)
    num = pq @ s
    den = pq @ z[..., None]
    out = torch.where(den > _TINY, num / den.clamp_min(_TINY), torch.zeros_like(num))
    return out.to(v.dtype), (s, z)
