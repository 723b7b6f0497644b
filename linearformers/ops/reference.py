"""Plain quadratic references for every attention kernel: the definitions, written to be read, not to be fast.

Each function builds the full (n x n) or (n x k) score matrix with ordinary autograd, in the dtype of its inputs
(call them in float64 for an oracle), and applies masks explicitly. They share one rule with the fast kernels: a
query that sees no real key (or no written slot) outputs 0. Tensors are (batch, heads, length, head_dim).

The fast paths in favor.py, linformer.py and local.py must agree with these; tests/ops/test_reference.py
checks that, and checks the references themselves against exact softmax attention where the maths says they
reduce to it. Memory is O(n² m) for FAVOR+ and O(n k d) for causal Linformer, per head: tiny inputs only.
"""

from __future__ import annotations

import math

import torch

from ._checks import renamed_keywords
from .feature_maps import relu_features


def _masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax over the allowed entries of each row of ``scores`` (..., n_q, n_k); ``allowed`` broadcasts to it.

    A row with nothing allowed is all 0 (and passes no gradient); no NaN is formed on the way."""
    has_key = allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, -math.inf).masked_fill(~has_key, 0.0)
    return torch.softmax(scores, dim=-1) * has_key


def _attend(scores: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The masked softmax of ``scores`` times v (..., n_k, d)."""
    return _masked_softmax(scores, allowed) @ v


def _key_mask(key_padding_mask: torch.Tensor | None, batch: int, n: int, device) -> torch.Tensor:
    """(batch, 1, 1, n) bool: True for real keys."""
    if key_padding_mask is None:
        return torch.ones(batch, 1, 1, n, dtype=torch.bool, device=device)
    return key_padding_mask.bool()[:, None, None, :]


def softmax_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention  softmax(Q Kᵀ · scale) V  (Vaswani et al. 2017, Eq. 1), padded keys and, when causal,
    future keys excluded."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n_q, n_k = q.shape[2], k.shape[2]
    allowed = _key_mask(key_padding_mask, k.shape[0], n_k, q.device)
    if causal:
        allowed = allowed & torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
    return _attend(q @ k.transpose(-1, -2) * scale, allowed, v)


@renamed_keywords("0.3.0", projection="random_features", kernel="feature_map", kernel_eps="feature_eps")
def favor_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    random_features: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    feature_map: str = "softmax",
    scale: float | None = None,
    feature_eps: float = 1e-3,
) -> torch.Tensor:
    """FAVOR+ as the (n x n) matrix A = phi(Q) phi(K)ᵀ, row-normalized:  out = D⁻¹ A V,  D = diag(A 1)
    (Choromanski et al. 2021, Eq. 7-9), with A lower-triangular when causal and padded keys' columns removed.

    x' = x · scale^½ and w_i the rows of ``random_features`` (m of them).

    * ``feature_map="softmax"``: the positive random features of Lemma 1, phi(x)_i = exp(w_i·x' - |x'|²/2) / √m,
      whose product estimates exp(q'·k'). Factors that depend on the query alone (exp(-|q'|²/2) / m, and any
      stabilizer of favor.py) cancel in D⁻¹ A, so A is taken in log space, per (query t, key s):

          log A_ts = logsumexp_i (w_i·q'_t + w_i·k'_s - |k'_s|²/2)

      and the row normalization is a softmax of log A over the allowed keys: exact for keys of any norm.
    * ``feature_map="relu"``: phi(x) = ReLU(W x') + feature_eps for queries and keys alike (Section 2.2),
      :func:`feature_maps.relu_features`.

    Returns (batch, heads, n_q, head_dim) in v's dtype.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    w = random_features.to(device=q.device, dtype=q.dtype)
    qs, ks = q * math.sqrt(scale), k * math.sqrt(scale)
    if feature_map == "softmax":
        u_q = qs @ w.T  # (b, h, n_q, m)
        u_k = ks @ w.T - 0.5 * ks.pow(2).sum(-1, keepdim=True)  # (b, h, n_k, m)
        log_a = torch.logsumexp(u_q[:, :, :, None, :] + u_k[:, :, None, :, :], dim=-1)  # (b, h, n_q, n_k)
    elif feature_map == "relu":
        phi_q = relu_features(q, w, scale=scale, eps=feature_eps).to(q.dtype)
        phi_k = relu_features(k, w, scale=scale, eps=feature_eps).to(q.dtype)
        log_a = torch.log(phi_q @ phi_k.transpose(-1, -2))
    else:
        raise ValueError(f"unknown FAVOR+ feature map {feature_map!r}")
    n_q, n_k = q.shape[2], k.shape[2]
    allowed = _key_mask(key_padding_mask, k.shape[0], n_k, q.device)
    if causal:
        allowed = allowed & torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
    return _attend(log_a, allowed, v.to(log_a.dtype)).to(v.dtype)


def linear_reference(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Linear attention of given nonnegative features as the (n x n) matrix A = phi_q phi_kᵀ, row-normalized:
    out = D⁻¹ A V, D = diag(A 1), with A lower-triangular when causal and padded keys' columns zeroed. A row whose
    sum is 0 (no visible key) outputs 0. Computed in the features' dtype; returns v's dtype."""
    dtype = torch.promote_types(phi_q.dtype, v.dtype)
    a = phi_q.to(dtype) @ phi_k.to(dtype).transpose(-1, -2)
    allowed = _key_mask(key_padding_mask, phi_k.shape[0], phi_k.shape[2], phi_q.device)
    if causal:
        allowed = allowed & torch.ones(a.shape[-2], a.shape[-1], dtype=torch.bool, device=a.device).tril()
    a = a * allowed
    den = a.sum(-1, keepdim=True)
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, (a @ v.to(dtype)) / safe, torch.zeros_like(den)).to(v.dtype)


def _compaction(key_padding_mask, batch, n, device, dtype):
    """The (batch, n, n) 0/1 matrix C with C[b, r, s] = 1 when position s is the r-th real token of sequence b.

    C x moves the real tokens to the front in order and zeroes the rest; Cᵀ y puts rows back (padded ones 0)."""
    if key_padding_mask is None:
        return torch.eye(n, dtype=dtype, device=device).expand(batch, n, n)
    mask = key_padding_mask.bool()
    rank = mask.long().cumsum(1) - 1  # (b, n): rank among the real tokens
    slots = torch.arange(n, device=device)
    return ((rank[:, None, :] == slots[None, :, None]) & mask[:, None, :]).to(dtype)


def _compact(c, x):
    return torch.einsum("brs,bhsd->bhrd", c, x)


@renamed_keywords("0.3.0", method="projection", window="pool_stride")
def linformer_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor | None,
    f: torch.Tensor | None = None,
    *,
    projection: str = "learned",
    pool_stride: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_multiplier: torch.Tensor | None = None,
) -> torch.Tensor:
    """Linformer  out = softmax(Q (E K)ᵀ · scale) (F V)  (Wang et al. 2020, Eq. 7), E and F (k x n).

    Padding by compaction: each sequence's real tokens are moved to the front (in order) before projecting, so the
    r-th real token meets column r. Sequence projections (``f=None`` shares E):

    * ``"learned"``: E, F (k, n_max) or per head (heads, k, n_max); their first n columns are used.
    * ``"pool"``: slot j is the mean of the real tokens among compacted positions [j w, (j + 1) w), w = pool_stride.
    * ``"conv"``: slot j = Σ_t W[:, :, t] x_{j w + t}, W (d, d, w) the Conv1d weight given as e (and f).

    A slot no real token wrote to (its row of E is zero over the sequence's real positions, or its pool_stride
    positions lie past the sequence's end) takes no part in the softmax. ``dropout_multiplier``: optional
    (batch, heads, n, k) factor on the probabilities (0 or 1 / (1 - p)), for checking dropout against a mask drawn
    elsewhere. Returns (batch, heads, n, d) in q's dtype.
    """
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    kp, vp, allowed = _linformer_slots(q, k, v, e, f, projection, pool_stride, key_padding_mask)
    probs = _masked_softmax(q @ kp.transpose(-1, -2) * scale, allowed)
    if dropout_multiplier is not None:
        probs = probs * dropout_multiplier
    return (probs @ vp).to(q.dtype)


def _linformer_slots(q, k, v, e, f, projection, pool_stride, key_padding_mask):
    """Linformer's k slots of :func:`linformer_reference`: the projected keys and values (b, h, k, d) in q's dtype
    and a (b, 1 | h, 1, k) bool, True for the slots some real token wrote to."""
    b, _, n, _ = k.shape
    f = e if f is None else f
    c = _compaction(key_padding_mask, b, n, q.device, q.dtype)
    kc, vc = _compact(c, k), _compact(c, v)
    lengths = c.sum((1, 2))  # (b,): real tokens per sequence
    real = torch.arange(n, device=q.device)[None, :] < lengths[:, None]  # (b, n): compacted positions in use
    if projection == "learned":
        e_n, f_n = e[..., :n].to(q.dtype), f[..., :n].to(q.dtype)
        kp, vp = e_n @ kc, f_n @ vc  # (b, h, k, d)
        written = torch.einsum("...js,bs->b...j", (e_n != 0).to(q.dtype), real.to(q.dtype)) > 0  # (b, [h,] k)
    elif projection in ("pool", "conv"):
        slots = -(-n // pool_stride)
        pad = slots * pool_stride - n
        kw = torch.nn.functional.pad(kc, (0, 0, 0, pad)).unflatten(2, (slots, pool_stride))  # (b, h, slots, w, d)
        vw = torch.nn.functional.pad(vc, (0, 0, 0, pad)).unflatten(2, (slots, pool_stride))
        counts = torch.nn.functional.pad(real, (0, pad)).view(b, slots, pool_stride).sum(-1)  # (b, slots)
        if projection == "pool":
            kp = kw.sum(3) / counts.clamp_min(1)[:, None, :, None]
            vp = vw.sum(3) / counts.clamp_min(1)[:, None, :, None]
        else:
            kp = torch.einsum("oit,bhjti->bhjo", e.to(q.dtype), kw)
            vp = torch.einsum("oit,bhjti->bhjo", f.to(q.dtype), vw)
        written = counts > 0
    else:
        raise ValueError(f"unknown Linformer projection {projection!r}")
    return kp, vp, written.view(b, -1, 1, written.shape[-1])  # (b, 1 | h, 1, k)


@renamed_keywords("0.3.0", method="projection", window="pool_stride")
def linformer_hybrid_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor | None,
    f: torch.Tensor | None,
    gamma: torch.Tensor,
    hybrid_window: int,
    *,
    projection: str = "learned",
    pool_stride: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    sinks: int = 0,
) -> torch.Tensor:
    """Sliding-window softmax + Linformer slots inside a head, bidirectional, as (n x n) matrices: one softmax over
    query t's window keys (|s - t| < hybrid_window, real), its sinks (the first ``sinks`` real keys of the row,
    wherever they lie) and the k slots of :func:`linformer_reference` (E K, F V, by compaction), the window's and
    sinks' scores weighted by gamma_h:

        out_t = (gamma_h Σ_{s in W(t)} e^{scale q_t·k_s} v_s + Σ_j e^{scale q_t·(E K)_j} (F V)_j) / (same, 1 for v)

    A query with no real key and no written slot outputs 0. Computed in q's dtype; returns q's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n = q.shape[2]
    kp, vp, written = _linformer_slots(q, k, v, e, f, projection, pool_stride, key_padding_mask)
    i = torch.arange(n, device=q.device)
    real = _key_mask(key_padding_mask, k.shape[0], n, q.device)  # (b, 1, 1, n)
    sink = real & (real.long().cumsum(-1) <= sinks)
    win = (((i[:, None] - i[None, :]).abs() < hybrid_window) | sink) & real
    log_gamma = gamma.to(q.dtype).log()[None, :, None, None]
    scores = torch.cat([q @ k.transpose(-1, -2) * scale + log_gamma, q @ kp.transpose(-1, -2) * scale], -1)
    heads = q.shape[1]
    allowed = torch.cat([win.expand(-1, heads, n, -1), written.expand(-1, heads, n, -1)], -1)
    probs = _masked_softmax(scores, allowed)
    return (probs[..., :n] @ v + probs[..., n:] @ vp).to(q.dtype)


def causal_linformer_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor,
    f: torch.Tensor | None = None,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal Linformer with cumulative slots written by position (after ABC, Peng et al. 2022): query t reads

        K̃_t = Σ_{s≤t} E[:, s] k_sᵀ,   Ṽ_t = Σ_{s≤t} F[:, s] v_sᵀ,   out_t = softmax(q_t K̃_tᵀ · scale) Ṽ_t

    where slot j takes part only once written, i.e. when E[j, s] ≠ 0 for some s ≤ t. E, F are (k, n_max) or
    (heads, k, n_max); ``f=None`` shares E. With key padding, sequences are compacted first (t and s count real
    tokens only) and outputs at padded positions are 0. No loop: the prefix sums K̃_t, Ṽ_t of every t are one
    cumsum over an (n, k, d) tensor per head, O(n k d) memory. Returns (batch, heads, n, d) in q's dtype.
    """
    b, _, n, d = q.shape
    f = e if f is None else f
    scale = d**-0.5 if scale is None else scale
    c = _compaction(key_padding_mask, b, n, q.device, q.dtype)
    qc, kc, vc = _compact(c, q), _compact(c, k), _compact(c, v)
    # (k, n) or (h, k, n) -> (1, 1 | h, n, k, 1): column s of E, ready to scale k_s
    e_n, f_n = (p[..., :n].to(q.dtype).transpose(-1, -2).reshape(1, -1, n, p.shape[-2], 1) for p in (e, f))
    k_slots = (e_n * kc[:, :, :, None, :]).cumsum(2)  # (b, h, t, k, d): K̃_t = Σ_{s≤t} E[:, s] k_sᵀ
    v_slots = (f_n * vc[:, :, :, None, :]).cumsum(2)  # Ṽ_t
    written = (e_n[..., 0] != 0).cumsum(2) > 0  # (1, 1 | h, t, k): slot j written by position t
    probs = _masked_softmax(torch.einsum("bhtd,bhtjd->bhtj", qc, k_slots) * scale, written)
    out = torch.einsum("bhtj,bhtjd->bhtd", probs, v_slots)
    return torch.einsum("brs,bhrd->bhsd", c, out).to(q.dtype)  # back to the original positions


def local_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None = None,
    relative_bias: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention with an explicit band mask (the local heads of Longformer / BigBird):

    * causal: query i sees keys j with 0 <= i - j < window;
    * bidirectional: query i sees keys j with |i - j| <= window // 2.

    ``relative_bias`` (heads, P) is added to the logit of (i, j) at index i - j (causal) or i - j + window // 2
    (bidirectional). Returns (batch, heads, n, d) in v's dtype.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n = q.shape[2]
    i = torch.arange(n, device=q.device)
    dist = i[:, None] - i[None, :]  # (n, n): i - j
    band = ((dist >= 0) & (dist < window)) if causal else (dist.abs() <= window // 2)
    scores = q @ k.transpose(-1, -2) * scale
    if relative_bias is not None:
        index = dist if causal else dist + window // 2
        index = index.clamp(0, relative_bias.shape[1] - 1)  # outside the band: masked below anyway
        scores = scores + relative_bias.to(scores.dtype)[:, index]
    allowed = band & _key_mask(key_padding_mask, k.shape[0], n, q.device)
    return _attend(scores, allowed, v)


def hybrid_reference(
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
    query_log_scale: torch.Tensor | None = None,
    sinks: int = 0,
    select_blocks: int = 0,
    select_block_size: int = 32,
) -> torch.Tensor:
    """Sliding-window softmax + linear attention inside a head (LoLCATs, Zhang et al. 2024), as (n x n) matrices.

    Query t takes softmax scores on its window W(t) (causal: t - window < s <= t; bidirectional: |s - t| < window)
    and linear feature scores on the other keys (causal: only s <= t), normalized together:

        a_ts = gamma_h exp(scale q_t·k_s - c_t)  (s in W(t)),   b_ts = phi_q,t · phi_k,s  (s outside W(t))
        out_t = Σ_s (a_ts + b_ts) v_s / Σ_s (a_ts + b_ts)

    With ``sinks`` S, the first S real keys of each row join every window that may see them (causal: s <= t) and
    leave the linear part. c_t is the largest window logit over real keys. With ``query_log_scale`` ℓ
    (batch, heads, n), b_ts is multiplied by exp(ℓ_t - c_t) (features on the softmax's scale, see :mod:`hybrid`).
    Padded keys leave both parts; a query with no real key outputs 0. Computed in the inputs' (promoted) dtype; returns v's dtype.

    With ``select_blocks`` K (bidirectional, with ℓ): positions fall in blocks of B = ``select_block_size``; query
    block i takes the mean q̄_i of its real queries, key block j the mean k̄_j of its linear keys (real, not sinks),
    and i chooses the K blocks j with the largest q̄_i·k̄_j among those with a linear key and |i - j| B - (B - 1)
    >= window; the linear keys of the chosen blocks join the window of every query of block i.
    """
    dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), phi_q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n = q.shape[2]
    i = torch.arange(n, device=q.device)
    dist = i[:, None] - i[None, :]  # t - s
    in_window = ((dist >= 0) & (dist < window)) if causal else (dist.abs() < window)
    seen = (dist >= 0) if causal else torch.ones_like(in_window)
    real = _key_mask(key_padding_mask, k.shape[0], n, q.device)
    sink = real & (real.long().cumsum(-1) <= sinks)  # real is (b, 1, 1, n)
    win = (in_window | (sink & seen)) & real
    lin = seen & ~win & real
    if select_blocks:
        chosen = _chosen_far_keys(q, k, real, sink, window, select_blocks, select_block_size)
        win = win | (chosen & lin)
        lin = lin & ~chosen
    logits = (q.to(dtype) @ k.to(dtype).transpose(-1, -2) * scale).masked_fill(~win, -math.inf)
    c = logits.amax(-1, keepdim=True)
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    a = gamma.to(dtype)[None, :, None, None] * torch.exp(logits - c)
    b = (phi_q.to(dtype) @ phi_k.to(dtype).transpose(-1, -2)) * lin
    if query_log_scale is not None:
        b = b * torch.exp(query_log_scale.to(dtype)[..., None] - c)
    scores = a + b
    den = scores.sum(-1, keepdim=True)
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, (scores @ v.to(dtype)) / safe, torch.zeros_like(den)).to(v.dtype)


def _chosen_far_keys(q, k, real, sink, window, blocks, size):
    """(batch, heads, n, n) bool: the keys of the far blocks each query's block chooses (hybrid_reference)."""
    n = q.shape[2]
    block_of = torch.arange(n, device=q.device) // size
    nb = int(block_of[-1]) + 1
    member = block_of[None, :] == torch.arange(nb, device=q.device)[:, None]  # (nb, n)
    linear_key = (real & ~sink)[:, :, 0, :]  # (b, 1, n)
    real_query = real[:, :, 0, :]
    key_in = (member & linear_key[:, :, None, :]).to(k.dtype)  # (b, 1, nb, n)
    query_in = (member & real_query[:, :, None, :]).to(q.dtype)
    k_mean = (key_in @ k) / key_in.sum(-1, keepdim=True).clamp_min(1)
    q_mean = (query_in @ q) / query_in.sum(-1, keepdim=True).clamp_min(1)
    i = torch.arange(nb, device=q.device)
    far = (i[:, None] - i[None, :]).abs() * size - (size - 1) >= window
    allowed = far & key_in.sum(-1)[:, :, None, :].bool()  # (b, 1, nb, nb)
    scores = (q_mean @ k_mean.transpose(-1, -2)).masked_fill(~allowed, -math.inf)
    top = scores.topk(min(blocks, nb), -1)
    picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top.indices, torch.isfinite(top.values))
    return picked[:, :, block_of][..., block_of]  # query t's block row, key s's block column
