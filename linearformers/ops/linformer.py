"""Linformer attention (Wang et al., 2020, "Linformer: Self-Attention with Linear Complexity").

    out = softmax(Q (E K)ᵀ · scale) (F V)                                     (Eq. 7)

E and F project the sequence axis from n to k. Tensors are (batch, heads, length, head_dim).

Padding. A key-padding mask first *compacts* every sequence: its real tokens move to the front, in order, and
the rest is zeroed. Position s of the projection therefore always meets the s-th real token, so the same
tokens give the same answer with any amount of left or right padding. A sequence shorter than the maximum
uses the first n columns of E and F; nothing is padded up to the maximum.

Projections, the ops' ``projection`` argument (Section 4, "additional efficiency techniques"):
  * ``"learned"``: E, F are (k, n_max) or per head (heads, k, n_max) matrices.
  * ``"pool"``: mean pooling with kernel = stride = ``pool_stride`` = n_max / k, no parameters.
  * ``"conv"``: a strided convolution along the sequence, kernel = stride = ``pool_stride`` = n_max / k, weight
    (d, d, pool_stride).
Sharing (per head, shared key-value, shared across layers) decides which tensors are passed as E and F; the
math is the same.

Backends, named at the call (``backend=``; None picks, in one place each):
  * bidirectional (:data:`BACKENDS`): "blockwise", the hand-written flash-style :class:`SlotAttention` over the
    k slots (the default on the CPU); "sdpa", E K and F V as one product each in the inputs' dtype, then
    ``scaled_dot_product_attention`` over the k slots (the default on every other device, see
    :func:`_choose_backend`); or "reference", the plain formula of :func:`reference.linformer_reference`;
  * causal (:data:`CAUSAL_BACKENDS`): "chunked", the chunked prefix sums (:func:`_choose_causal_backend`), or
    "reference", :func:`reference.causal_linformer_reference`.
The references are for tests and checks: O(n k d) memory and plain autograd, no state in or out, no dropout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ._checks import check_mask, check_qkv, renamed_keywords
from ._favor_chunked import half_operands
from ._linformer_autograd import _ROWS, SequenceProjection, SlotAttention
from ._precision import outside_autocast
from .reference import causal_linformer_reference, linformer_reference

METHODS = ("learned", "pool", "conv")
BACKENDS = ("reference", "blockwise", "sdpa")  # bidirectional linformer_attention
CAUSAL_BACKENDS = ("reference", "chunked")  # causal_linformer_attention


def _check_backend(backend: str | None, choices: tuple[str, ...], op: str) -> None:
    if backend is not None and backend not in choices:
        raise ValueError(f"unknown {op} backend {backend!r}; choose None or one of {choices}")


def _check_size(name: str, value: int) -> int:
    """A block or chunk size: a positive int (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _choose_backend(backend: str | None, q: torch.Tensor) -> str:
    """The one place where linformer_attention picks how to compute: a name from BACKENDS.

    ``backend=None`` picks "blockwise" on the CPU: its query blocks keep each block's (rows x k) probabilities in
    cache and a per-(batch, head) product costs nothing there. Elsewhere (a GPU) it picks "sdpa": a loop of small
    float32 products leaves a GPU waiting on the host (at 16K, 448 launches), where two sequence projections in
    the inputs' dtype and one fused attention kernel over the k slots take a handful of launches whatever n is,
    with bf16 operands on tensor cores. A named backend is taken as asked."""
    _check_backend(backend, BACKENDS, "Linformer")
    if backend is not None:
        return backend
    return "blockwise" if q.device.type == "cpu" else "sdpa"


def _reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reference backend computes in: float32 at least, as the kernels (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Move each sequence's real tokens to the front, keep their order, zero the rest.

    x: (batch, heads, n, d); mask: (batch, n) bool. Returns a tensor of x's shape.
    """
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real tokens first
    kept = torch.gather(mask, 1, order)
    idx = order[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    return torch.gather(x, 2, idx) * kept[:, None, :, None].to(x.dtype)


def uncompact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`compact`: put the first count(mask) rows back at the real positions, zeros elsewhere."""
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    out = torch.zeros_like(x)
    idx = order[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    out.scatter_(2, idx, x)
    return out * mask[:, None, :, None].to(x.dtype)


def _check_learned(proj: torch.Tensor, name: str, heads: int, n: int) -> None:
    if proj.dim() not in (2, 3) or (proj.dim() == 3 and proj.shape[0] != heads):
        raise ValueError(
            f"{name} must be shaped (k, n_max) or per head ({heads}, k, n_max) for the learned projection, "
            f"got {tuple(proj.shape)}"
        )
    k_len, n_max = proj.shape[-2:]
    if k_len > n_max:
        raise ValueError(
            f"{name} projects to k={k_len} slots from n_max={n_max} positions; k must not exceed n_max "
            "(a learned projection with k > n cannot compress anything). Lower k or raise max_seq_length."
        )
    check_sequence_length(n, n_max, k_len)


def check_sequence_length(n: int, n_max: int, k_len: int) -> None:
    """Refuse n > n_max: the projections (learned, pool or conv) map n_max positions to k_len slots."""
    if n > n_max:
        raise ValueError(
            f"sequence length {n} exceeds the Linformer's max_seq_length={n_max}; its projections are "
            f"{k_len} x {n_max}. Truncate the input or convert to a longer model."
        )


def project_sequence(
    x: torch.Tensor,
    proj: torch.Tensor | None,
    *,
    projection: str,
    lengths: torch.Tensor | None,
    pool_stride: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Project x (batch, heads, n, d), already compacted, along the sequence to (batch, heads, k', d).

    ``lengths`` (batch,) holds each sequence's real-token count (None: all n). Returns the projection and a
    (batch, 1, k') bool mask of the slots that hold at least one real token (None when every slot does, outside
    torch.compile).
    """
    b, h, n, d = x.shape
    if projection == "learned":
        proj = proj[..., :n].to(x.dtype)
        k_len = proj.shape[-2]
        if proj.dim() == 2:  # one (k, n) @ (n, b h d) product: no broadcast copy of E per batch and head
            flat = torch.matmul(proj, x.permute(2, 0, 1, 3).reshape(n, b * h * d))
            return flat.view(k_len, b, h, d).permute(1, 2, 0, 3), None
        flat = torch.matmul(proj, x.permute(1, 2, 0, 3).reshape(h, n, b * d))  # (h, k, n) @ (h, n, b d)
        return flat.view(h, k_len, b, d).permute(2, 0, 1, 3), None
    if pool_stride is None or pool_stride <= 0:
        raise ValueError(
            f"the {projection!r} projection needs a positive pool_stride (kernel = stride), got {pool_stride}"
        )
    pad = (-n) % pool_stride
    slots = (n + pad) // pool_stride
    positions = torch.arange(n + pad, device=x.device)
    lengths = torch.full((b,), n, device=x.device) if lengths is None else lengths
    counts = ((positions[None, :] < lengths[:, None]).view(b, slots, pool_stride)).sum(-1)  # (b, slots)
    slot_mask = counts > 0
    xp = F.pad(x, (0, 0, 0, pad))
    if projection == "pool":
        sums = xp.view(b, h, slots, pool_stride, d).sum(3)
        out = sums / counts.clamp_min(1)[:, None, :, None].to(x.dtype)
    elif projection == "conv":
        if proj is None or proj.dim() != 3 or proj.shape != (d, d, pool_stride):
            raise ValueError(
                f"the conv projection weight must be shaped (head_dim, head_dim, pool_stride) = "
                f"({d}, {d}, {pool_stride}), got {None if proj is None else tuple(proj.shape)}"
            )
        flat = xp.reshape(b * h, n + pad, d).transpose(1, 2)  # (b*h, d, n)
        out = F.conv1d(flat, proj.to(x.dtype), stride=pool_stride).transpose(1, 2).reshape(b, h, slots, d)
    else:
        raise ValueError(f"unknown Linformer projection {projection!r}; choose one of {METHODS}")
    # eagerly, no mask when every slot holds a real token (one host sync); compiled, always the mask (no branch)
    if torch.compiler.is_compiling() or not bool(slot_mask.all()):
        return out, slot_mask[:, None, :]
    return out, None


@renamed_keywords("0.3.0", method="projection", window="pool_stride")
@outside_autocast
def linformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e_proj: torch.Tensor | None,
    f_proj: torch.Tensor | None = None,
    *,
    projection: str = "learned",
    pool_stride: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Bidirectional Linformer attention, O(n k d) time and O(n k) memory.

    Args:
        q, k, v: (batch, heads, n, head_dim).
        e_proj, f_proj: key and value projections (see the module docstring); ``f_proj=None`` shares E.
        projection: "learned", "pool" or "conv" (see the module docstring). pool_stride: n_max / k, the kernel =
            stride of "pool" and "conv".
        key_padding_mask: (batch, n), True / 1 for real tokens.
        scale: logit scale, head_dim ** -0.5 when None.
        dropout_p: dropout on the attention probabilities, in [0, 1).
        backend: None (see :func:`_choose_backend`: "blockwise" on the CPU, "sdpa" elsewhere), "blockwise"
            (:class:`SlotAttention`, flash-style over the k slots in blocks of ``block_size`` queries, float32,
            O(block_size k) extra memory per head, hand-written backward), "sdpa" (:func:`_slot_sdpa`: E K and F V
            as one product each in the inputs' dtype, then ``scaled_dot_product_attention`` over the k slots, in
            q's dtype with its kernels' float32 softmax; dropout from its own generator), or "reference"
            (:func:`reference.linformer_reference`, the plain formula with autograd, computed in float32 or wider;
            for tests, no dropout). See :data:`BACKENDS`.
        block_size: queries per block of the blockwise backend (the other backends take no blocks), a positive
            int; None: ``_linformer_autograd._ROWS``
            (256). A memory / speed trade-off: the result is the same up to rounding, except that dropout masks are
            drawn per block.
    Returns: (batch, heads, n, head_dim) in q's dtype.
    """
    check_qkv(q, k, v)
    backend = _choose_backend(backend, q)
    rows = _ROWS if block_size is None else _check_size("block_size", block_size)
    if projection not in METHODS:
        raise ValueError(f"unknown Linformer projection {projection!r}; choose one of {METHODS}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    b, h, n, d = k.shape
    mask = check_mask(key_padding_mask, b, n)
    f_proj = e_proj if f_proj is None else f_proj
    if projection == "learned":
        if e_proj is None:
            raise ValueError("the learned projection needs e_proj")
        _check_learned(e_proj, "e_proj", h, n)
        _check_learned(f_proj, "f_proj", h, n)
    if backend == "reference":
        if dropout_p > 0:
            raise ValueError(f"backend='reference' has no dropout; got dropout_p={dropout_p} (use the default backend)")
        if projection != "learned":  # the checks project_sequence makes on the kernel's path
            if pool_stride is None or pool_stride <= 0:
                raise ValueError(
                    f"the {projection!r} projection needs a positive pool_stride (kernel = stride), got {pool_stride}"
                )
            for proj in (e_proj, f_proj) if projection == "conv" else ():
                if proj is None or proj.dim() != 3 or proj.shape != (d, d, pool_stride):
                    raise ValueError(
                        f"the conv projection weight must be shaped (head_dim, head_dim, pool_stride) = "
                        f"({d}, {d}, {pool_stride}), got {None if proj is None else tuple(proj.shape)}"
                    )
        dtype = _reference_dtype(q.dtype)
        q_, k_, v_ = (t.to(dtype) for t in (q, k, v))
        e_, f_ = (None if p is None else p.to(dtype) for p in (e_proj, f_proj))
        out = linformer_reference(
            q_, k_, v_, e_, f_, projection=projection, pool_stride=pool_stride, key_padding_mask=mask, scale=scale
        )
        return out.to(q.dtype)
    kp, vp, slot_mask = project_slots(
        k,
        v,
        e_proj,
        f_proj,
        projection=projection,
        pool_stride=pool_stride,
        key_padding_mask=mask,
        batched=backend == "sdpa",
    )
    scale = d**-0.5 if scale is None else scale
    if backend == "sdpa":
        return _slot_sdpa(q, kp, vp, slot_mask, scale, dropout_p)
    bias = None
    if slot_mask is not None:
        bias = torch.zeros(slot_mask.shape, dtype=torch.float32, device=q.device)
        bias = bias.masked_fill_(~slot_mask, float("-inf"))[:, :, None, :]  # (b, 1 or h, 1, k)
    if dropout_p > 0 and torch.compiler.is_compiling():
        return _slot_attention_with_dropout(q, kp.float(), vp.float(), bias, scale, dropout_p).to(q.dtype)
    # flash-style over the k slots (see _linformer_autograd): O(rows k) extra memory per head, dropout included
    return SlotAttention.apply(q, kp.float(), vp.float(), bias, scale, dropout_p, rows).to(q.dtype)


# SDPA's kernels for the slots, cuDNN's left out: on an H100 (torch 2.11) its backward spent 2.4 ms of host time per
# call at n = 4096, k = 256 against 0.1 ms on the GPU; flash and memory-efficient kernels launch in microseconds
_SLOT_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _slot_sdpa(
    q: torch.Tensor,
    kp: torch.Tensor,
    vp: torch.Tensor,
    slot_mask: torch.Tensor | None,
    scale: float,
    dropout_p: float,
) -> torch.Tensor:
    """softmax(q kpᵀ · scale) vp over the k slots by ``scaled_dot_product_attention`` (flash or memory-efficient
    kernels on a GPU: the (n x k) probabilities never reach memory, float32 softmax and accumulation, dropout masks
    regenerated in backward). q (b, h, n, d); kp, vp (b, h, k, d); slot_mask (b, 1 or h, k) or None, as
    :func:`project_slots` returns it. A row whose slots are all unwritten (a sequence of padding only) gets zeros:
    its slots are opened for the kernel, whose softmax over nothing would be 0 / 0, and its output is multiplied
    by 0, so no NaN reaches the gradients either."""
    attn_mask = usable = None
    if slot_mask is not None:
        usable = slot_mask.any(-1, keepdim=True)  # (b, 1 or h, 1)
        attn_mask = (slot_mask | ~usable)[:, :, None, :]  # (b, 1 or h, 1, k), True: the slot takes part
    with sdpa_kernel(_SLOT_KERNELS):
        out = F.scaled_dot_product_attention(
            q, kp.to(q.dtype), vp.to(q.dtype), attn_mask=attn_mask, dropout_p=dropout_p, scale=scale
        )
    return out if usable is None else out * usable[..., None].to(out.dtype)


def _slot_attention_with_dropout(q, kp, vp, bias, scale, dropout_p):
    """SlotAttention's formula with dropout, in plain ops for torch.compile: SlotAttention seeds each block's
    generator from a host integer (``.item()``), which would break the graph; here the masks come from torch's
    global generator, which the compiled graph draws from on the device, and autograd keeps the (b, h, n, k)
    probabilities for backward. A row with no usable slot gets zeros, as in SlotAttention."""
    logits = torch.matmul(q.float(), kp.transpose(-1, -2)) * scale  # (b, h, n, k)
    if bias is not None:
        logits = logits + bias
    probs = torch.exp(logits - logits.amax(-1, keepdim=True).clamp_min(-1e30))
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)
    return torch.matmul(F.dropout(probs, dropout_p), vp)


def project_slots(
    k: torch.Tensor,
    v: torch.Tensor,
    e_proj: torch.Tensor | None,
    f_proj: torch.Tensor,
    *,
    projection: str,
    pool_stride: int | None,
    key_padding_mask: torch.Tensor | None,
    batched: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The k slots of bidirectional Linformer attention: E K and F V (batch, heads, k, head_dim) in k's dtype, over
    the real tokens compacted to the front, and a (batch, 1 or heads, k) bool mask of the slots some real token
    wrote to (None when every slot was). Inputs as :func:`linformer_attention` takes them, checked there;
    ``key_padding_mask`` is a checked bool mask or None. ``batched``: a learned E as one product over every
    (batch, head) (:func:`project_sequence`, autograd; a GPU's choice) instead of one product per (batch, head)
    reading x in place (:class:`SequenceProjection`; the CPU's)."""
    b, _, n, _ = k.shape
    lengths = None
    if key_padding_mask is not None:
        k, v = compact(k, key_padding_mask), compact(v, key_padding_mask)
        lengths = key_padding_mask.sum(1)
    if projection == "learned":
        if batched:  # two launches whatever b and h are, against one product per (batch, head)
            kp, _ = project_sequence(k, e_proj, projection=projection, lengths=None)
            vp, _ = project_sequence(v, f_proj, projection=projection, lengths=None)
        else:  # by hand (see _linformer_autograd): E x per head in place, no permuted copies
            kp, vp = SequenceProjection.apply(k, e_proj), SequenceProjection.apply(v, f_proj)
        # a slot no real token wrote to (possible with a sparse E, e.g. the identity of a converted model, on a
        # sequence shorter than n) holds a zero key; it must not take a share of the softmax
        first = slot_first_writes(e_proj).to(k.device)  # (k,) or (h, k)
        real = torch.full((b,), n, device=k.device) if lengths is None else lengths
        written = first.view(1, -1, first.shape[-1]) < real.view(b, 1, 1)  # (b, 1 or h, k)
        # eagerly, skip the bias when every slot was written (one host sync); compiled, always keep it (no branch)
        return kp, vp, written if torch.compiler.is_compiling() or not bool(written.all()) else None
    kp, slot_mask = project_sequence(k, e_proj, projection=projection, lengths=lengths, pool_stride=pool_stride)
    vp, _ = project_sequence(v, f_proj, projection=projection, lengths=lengths, pool_stride=pool_stride)
    return kp, vp, slot_mask


def slot_first_writes(proj: torch.Tensor) -> torch.Tensor:
    """For each slot, the first position whose projection weight is non-zero: (..., k), n_max if never."""
    n_max = proj.shape[-1]
    nonzero = proj != 0
    first = torch.where(nonzero.any(-1), nonzero.float().argmax(-1), torch.full_like(proj[..., 0], n_max).long())
    return first


@outside_autocast
def causal_linformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e_proj: torch.Tensor,
    f_proj: torch.Tensor | None = None,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 128,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    start: int | torch.Tensor = 0,
    return_state: bool = False,
    backend: str | None = None,
    prefill_block: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Causal Linformer with cumulative memory slots (after ABC, Peng et al. 2022), which never leaks.

    Plain Linformer writes every token into every slot, so each slot holds the future. Here the k slots are
    written *by position*: at time t, query t reads

        K̃_t = Σ_{s≤t} E[:, s] k_sᵀ,   Ṽ_t = Σ_{s≤t} F[:, s] v_sᵀ     (k x d each)
        out_t = softmax(q_t K̃_tᵀ · scale) Ṽ_t,

    the Linformer projection restricted to the prefix. A slot j takes part only once some s ≤ t wrote to it
    (E[j, s] ≠ 0), so with k = n and E = F = I this is exactly causal softmax attention.

    Computed by chunks of C positions: the slot states before each chunk are exclusive prefix sums of
    per-chunk writes; inside a chunk, logits_t = q_t K̃_{<c}ᵀ + ((Q Kᵀ) ⊙ tril) Eᵀ and the output mixes Ṽ_{<c}
    with ((P F) ⊙ tril) V. Time O(n (C (d + k) + k d)), memory O(n (k + C) + k d n / C): linear in n.
    The decoding state is (K̃, Ṽ), fixed size k x d per head, plus the position.

    Args:
        q, k, v: (batch, heads, n, head_dim), v's head_dim equal to q's.
        e_proj, f_proj: learned projections (k, n_max) or (heads, k, n_max); ``f_proj=None`` shares E.
        key_padding_mask: (batch, n). Sequences are compacted (real tokens first) and outputs put back;
            outputs at padded positions are zero. Padding belongs to a prefill from position 0: with an
            ``initial_state`` or a ``start``, the mask must be None or all True.
        scale: logit scale, head_dim ** -0.5 when None.
        chunk_size: positions per chunk C of the chunked backend, a positive int: a speed / memory trade-off
            that does not change the result beyond rounding.
        initial_state, start: continue from a state returned for positions [0, start). ``start`` is an int, or a
            (batch,) tensor when the rows continue from different positions (after a left-padded prefill, each
            row counts its own real tokens): rows at one position take the chunked form from there, rows at
            different positions one exact :func:`causal_linformer_step` per token.
        return_state: also return the state (K̃, Ṽ) after the last position.
        backend: None (choose, see :func:`_choose_causal_backend`: today always "chunked"), "chunked" (the
            chunked prefix sums above; without gradients a prompt longer than ``prefill_block`` is walked in
            blocks of that many positions, carrying the state), or "reference"
            (:func:`reference.causal_linformer_reference`, the plain formula with autograd, computed in float32 or
            wider; for tests: it takes no ``initial_state`` or ``start`` and cannot ``return_state``).
            See :data:`CAUSAL_BACKENDS`.
        prefill_block: positions per block of the chunked backend's no-grad walk, a positive int; None:
            ``_PREFILL_ROWS`` (1024). Bounds a long prefill's memory to one block's per-chunk states and logits;
            the result is the same up to rounding.
    """
    check_qkv(q, k, v, same_length=True)
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"causal_linformer_attention needs v's head_dim equal to q's, got {v.shape[-1]} and {q.shape[-1]}"
        )
    b, h, n, _d = q.shape
    if e_proj is None:
        raise ValueError("causal Linformer needs a learned projection e_proj")
    f_proj = e_proj if f_proj is None else f_proj
    starts = None  # per-row starts, kept only when the rows differ
    if isinstance(start, torch.Tensor):
        if start.shape != (b,) or start.is_floating_point() or start.dtype == torch.bool:
            raise ValueError(
                f"start must be an int or a (batch,) = ({b},) integer tensor, got {start.dtype} {tuple(start.shape)}"
            )
        low, high = torch.stack(torch.aminmax(start)).tolist()  # one host sync
        starts, start = (None, low) if low == high else (start.to(q.device).long(), high)
    _check_learned(e_proj, "e_proj", h, start + n)
    _check_learned(f_proj, "f_proj", h, start + n)
    _check_size("chunk_size", chunk_size)
    prefill_block = _PREFILL_ROWS if prefill_block is None else _check_size("prefill_block", prefill_block)
    mask = check_mask(key_padding_mask, b, n)
    if mask is not None and (initial_state is not None or start):
        if not bool(mask.all()):
            raise ValueError(
                "key_padding_mask marks padding among tokens that continue a state (initial_state or start): "
                "padding belongs in the first (prefill) call, from position 0; continue with real tokens only "
                "(for a model: call without a cache to recompute the prefix with its padding)"
            )
        mask = None  # all real: nothing to compact
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, e_proj, f_proj))
    chosen, block = _choose_causal_backend(
        backend,
        n,
        needs_grad=needs_grad,
        prefill_block=prefill_block,
        initial_state=initial_state,
        start=start,
        return_state=return_state,
    )
    if chosen == "reference":
        dtype = _reference_dtype(q.dtype)
        q_, k_, v_, e_, f_ = (t.to(dtype) for t in (q, k, v, e_proj, f_proj))
        return causal_linformer_reference(q_, k_, v_, e_, f_, key_padding_mask=mask, scale=scale).to(q.dtype)
    if starts is not None:
        out, state = _causal_linformer_ragged(q, k, v, e_proj, f_proj, scale, initial_state, starts)
        out = out.to(q.dtype)
        return (out, state) if return_state else out
    if mask is not None:
        q, k, v = compact(q, mask), compact(k, mask), compact(v, mask)
    if block >= n:
        out, state = _causal_linformer_chunked(q, k, v, e_proj, f_proj, scale, chunk_size, initial_state, start)
    else:
        # inference on a long prompt (a generate() prefill): walk blocks of `block` positions, carrying the slot
        # state, so the per-chunk states and logits exist for one block at a time instead of the whole prompt
        outs, state = [], initial_state
        for i in range(0, n, block):
            rows = slice(i, i + block)
            part, state = _causal_linformer_chunked(
                q[:, :, rows], k[:, :, rows], v[:, :, rows], e_proj, f_proj, scale, chunk_size, state, start + i
            )
            outs.append(part)
        out = torch.cat(outs, dim=2)
    if mask is not None:
        out = uncompact(out, mask)
    out = out.to(q.dtype)
    return (out, state) if return_state else out


_PREFILL_ROWS = 1024  # positions per block of a causal Linformer prefill without gradients (prefill_block=None)


def _choose_causal_backend(
    backend: str | None,
    n: int,
    *,
    needs_grad: bool,
    prefill_block: int,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None,
    start: int,
    return_state: bool,
) -> tuple[str, int]:
    """The one place where causal_linformer_attention picks how to compute: (a name from CAUSAL_BACKENDS, the
    positions per pass of the chunked form).

    ``backend=None`` picks "chunked": every chunk at once by batched products, so with gradients the op count
    (kernel launches) does not grow with n, and its memory is linear in n; the reference holds an (n, k, d)
    tensor per head and is for tests. The chunked form runs the n positions in one pass when gradients are needed
    (autograd keeps every block's intermediates anyway, and one pass keeps the op count flat) or when n fits in
    ``prefill_block``; a no-grad prompt longer than that (a generate() prefill) is walked in blocks of
    ``prefill_block`` positions, carrying the state, so its memory is bounded by one block. A named backend is
    taken as asked; "reference" with an ``initial_state``, a ``start`` or ``return_state`` raises ValueError.
    """
    _check_backend(backend, CAUSAL_BACKENDS, "causal Linformer")
    if backend == "reference":
        given = {"initial_state": initial_state is not None, "start": bool(start), "return_state": return_state}
        for name, is_given in given.items():
            if is_given:
                raise ValueError(
                    f"backend='reference' computes a whole sequence from position 0 and returns no state: it takes "
                    f"no {name} (use backend='chunked' or None)"
                )
        return "reference", n
    return "chunked", (n if needs_grad or n <= prefill_block else prefill_block)


def _causal_linformer_ragged(q, k, v, e_proj, f_proj, scale, initial_state, starts):
    """Rows that continue from different positions ``starts`` (batch,): one exact step per token, since the
    chunked form writes every row's token t into the same column of E and F."""
    first = slot_first_writes(e_proj)
    outs, state = [], initial_state
    for t in range(q.shape[2]):
        rows = slice(t, t + 1)
        out, state = causal_linformer_step(
            q[:, :, rows],
            k[:, :, rows],
            v[:, :, rows],
            e_proj,
            f_proj,
            state,
            starts + t,
            scale=scale,
            first_writes=first,
        )
        outs.append(out)
    return torch.cat(outs, dim=2), state


def _as_heads(proj: torch.Tensor) -> torch.Tensor:
    """(k, n) -> (1, 1, k, n); (h, k, n) -> (1, h, k, n)."""
    return proj[None, None] if proj.dim() == 2 else proj[None]


def _causal_linformer_chunked(q, k, v, e_proj, f_proj, scale, chunk_size, initial_state, start):
    """The chunked form of causal_linformer_attention over positions [start, start + n): every chunk at once by
    batched products, in float32 (sums, prefix sums and the softmax), with the products' operands in bf16 for bf16
    inputs on CUDA (``half_operands``: tensor cores, half the traffic; results back in float32 before any sum).
    Returns (out (b, h, n, d) float32, the state (K̃, Ṽ) after the last position)."""
    b, h, n, d = q.shape
    scale = d**-0.5 if scale is None else scale
    half = half_operands(v)

    def mm(x, y):
        return torch.matmul(x, y) if half is None else torch.matmul(x.to(half), y.to(half)).float()

    c = min(chunk_size, n)
    pad = (-n) % c
    nc = (n + pad) // c
    e = _as_heads(e_proj[..., start : start + n].float())
    f = _as_heads(f_proj[..., start : start + n].float())
    slots = e.shape[-2]
    first = slot_first_writes(e_proj)  # (k,) or (h, k)
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        e, f = F.pad(e, (0, pad)), F.pad(f, (0, pad))
    qc = (q.float() * scale).view(b, h, nc, c, d)  # the scale on q (n x d), not on the (n x k) logits
    kc = k.float().view(b, h, nc, c, d)
    vc = v.float().view(b, h, nc, c, d)
    ec = e.view(*e.shape[:3], nc, c).transpose(2, 3)  # (1, h', nc, k, c)
    fc = f.view(*f.shape[:3], nc, c).transpose(2, 3)
    k_writes = mm(ec, kc)  # (b, h, nc, k, d)
    v_writes = mm(fc, vc)
    k_prefix = torch.cat([torch.zeros_like(k_writes[:, :, :1]), torch.cumsum(k_writes, 2)[:, :, :-1]], dim=2)
    v_prefix = torch.cat([torch.zeros_like(v_writes[:, :, :1]), torch.cumsum(v_writes, 2)[:, :, :-1]], dim=2)
    if initial_state is not None:
        k0, v0 = initial_state
        if k0.shape != (b, h, slots, d) or v0.shape[:3] != (b, h, slots):
            raise ValueError(f"initial_state must be two (batch, heads, k, d) = {(b, h, slots, d)} tensors")
        k_prefix = k_prefix + k0.float().unsqueeze(2)
        v_prefix = v_prefix + v0.float().unsqueeze(2)
    tril = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    qk = mm(qc, kc.transpose(-1, -2)).masked_fill(~tril, 0.0)  # (b, h, nc, c, c)
    logits = mm(qc, k_prefix.transpose(-1, -2)) + mm(qk, ec.transpose(-1, -2))
    positions = torch.arange(start, start + n + pad, device=q.device).view(nc, c)
    active = first.to(q.device)[..., None, None, :] <= positions[..., None]  # (h'?, nc, c, k)
    # inactive slots get a finite floor, not -inf: a row with no active slot has a finite softmax, zeroed below,
    # so no NaN reaches the gradients (and no pass over the (n x k) probabilities replaces it)
    probs = torch.softmax(logits.masked_fill(~active, -1e30), dim=-1)
    pf = mm(probs, fc).masked_fill(~tril, 0.0)  # (b, h, nc, c, c)
    out = mm(probs, v_prefix) + mm(pf, vc)
    out = torch.where(active.any(-1, keepdim=True), out, torch.zeros_like(out))  # a row with no active slot: 0
    state = (k_prefix[:, :, -1] + k_writes[:, :, -1], v_prefix[:, :, -1] + v_writes[:, :, -1])
    return out.reshape(b, h, nc * c, -1)[:, :, :n], state


@outside_autocast
def causal_linformer_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e_proj: torch.Tensor,
    f_proj: torch.Tensor | None,
    state: tuple[torch.Tensor, torch.Tensor] | None,
    position: int | torch.Tensor,
    *,
    scale: float | None = None,
    first_writes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One decoding step of :func:`causal_linformer_attention` for a single new token per sequence.

    ``position`` is the new token's index among its sequence's real tokens: an int, or a (batch,) tensor when
    left-padded sequences have different lengths. The state (K̃, Ṽ) is (batch, heads, k, d): fixed size.
    ``first_writes``: :func:`slot_first_writes` of ``e_proj``, precomputed by a caller that decodes many steps
    (it scans all of E, which would otherwise cost O(k n_max) per token).
    """
    check_qkv(q, k, v, same_length=True)
    if q.shape[2] != 1:
        raise ValueError(f"causal_linformer_step takes one new token, got length {q.shape[2]}")
    b, _h, _, d = q.shape
    f_proj = e_proj if f_proj is None else f_proj
    n_max = e_proj.shape[-1]
    pos = torch.as_tensor(position, device=q.device).long().expand(b)
    if int(pos.max()) >= n_max:
        raise ValueError(
            f"position {int(pos.max())} is past the Linformer's max_seq_length={n_max}; its projections are "
            f"{e_proj.shape[-2]} x {n_max}. Generate fewer tokens or convert to a longer model."
        )
    scale = d**-0.5 if scale is None else scale
    e_col = _as_heads(e_proj)[0][..., pos].float().permute(2, 0, 1)  # (b, h', k): only the new columns
    f_col = _as_heads(f_proj)[0][..., pos].float().permute(2, 0, 1)
    k_state = e_col[..., None] * k.float()  # (b, h, k, d)
    v_state = f_col[..., None] * v.float()
    if state is not None:
        k_state = k_state + state[0].float()
        v_state = v_state + state[1].float()
    logits = torch.matmul(q.float(), k_state.transpose(-1, -2)) * scale  # (b, h, 1, k)
    first = slot_first_writes(e_proj) if first_writes is None else first_writes
    active = _as_heads(first.to(q.device)[..., None])[0].squeeze(-1)  # (h', k)
    active = active[None] <= pos[:, None, None]  # (b, h', k)
    logits = logits.masked_fill(~active[:, :, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    return torch.matmul(probs, v_state).to(q.dtype), (k_state, v_state)
