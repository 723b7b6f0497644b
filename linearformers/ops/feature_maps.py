"""Feature maps: the one part every linear-attention path is built from.

A feature map phi turns queries and keys (batch, heads, length, head_dim) into nonnegative features
(batch, heads, length, m), and linear attention is then

    out_t = Σ_s (phi(q_t) · phi(k_s)) v_s / Σ_s phi(q_t) · phi(k_s)          (s <= t when causal)

so any map can run on any backend of :mod:`linear` (reference, chunked, native) and in the decoding step, given its
features. This module writes the known maps once:

* :func:`favor_positive`: the positive random features of FAVOR+ (Choromanski et al. 2021, Lemma 1),
  phi(x)_i ∝ exp(w_i·x' - |x'|²/2), x' = x · scale^½, with the causal-safe key offset of :mod:`favor`:
  keys exp(-|w_i - k'|²/2) (each feature depends on its own key alone, and is at most 1), queries with their own
  row maximum taken off (a per-query factor, which cancels in the normalization).
* :func:`relu_features`: the generalized kernel ReLU(W x') + eps (Section 2.2), the same map for queries and keys.
* :class:`FeatureMap`: the interface a learned map implements (a ``torch.nn.Module`` whose parameters belong to the
  module that owns it, e.g. the attention layer): ``phi(x, is_query=...) -> (b, h, n, m)``, nonnegative. The two
  fixed maps are also available in that form, :class:`FavorPositive` and :class:`ReluFeatures`.

A backend may fuse a known map into its own products (the blockwise bidirectional kernel of ``_favor_blockwise`` and
the compiled CPU walk build the FAVOR+ exponents inside their GEMMs, which is much of their speed); it computes the
same formula as here, and the tests hold each against :mod:`reference`, which uses these functions.

Precision: features are computed in float32 (float64 for float64 inputs, so that gradcheck means something),
whatever the inputs' dtype: the exponents of the FAVOR+ map need float32's range (bf16 keeps 8 bits of mantissa,
so exp of an exponent near -20 would carry a relative error of ~8%), and so do the sums built from them. The maps
run with autocast off: a model trained under bf16 autocast makes its features inside the autocast region, where
the projections x W would otherwise run as bf16 products and carry that error into the features and their
gradients (4-16x the max error of dk that bf16's rounding alone gives, in test_bf16_gradients.py's cases).
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch

from ..seeds import mix_seed
from ._checks import renamed_keywords
from ._precision import outside_autocast
from ._triton_hedgehog import hedgehog_features, takes_kernels

RANDOM_FEATURE_MAPS = ("softmax", "relu")  # the feature maps of favor_attention, both over drawn random features
# PerformerConfig.feature_map's choices: the random-feature maps and the learned Hedgehog map (HedgehogFeatureMap)
FEATURE_MAPS = (*RANDOM_FEATURE_MAPS, "hedgehog")


def draw_random_features(
    num_features: int,
    head_dim: int,
    *,
    seed: int,
    step: int = 0,
    orthogonal: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Draw the FAVOR+ random features W, shaped (num_features, head_dim): the ``random_features`` the FAVOR+ ops take.

    Orthogonal random features (Choromanski et al. 2021, Section 2.4): the rows come in blocks of
    ``head_dim`` exactly orthogonal directions. Each block is Q from the QR decomposition of a Gaussian
    matrix, with the columns' signs corrected by sign(diag(R)) so that Q is Haar (uniformly) distributed.
    Row norms are then drawn as the norms of independent Gaussian vectors (chi with head_dim degrees of
    freedom), so every row is marginally N(0, I) and the estimator stays unbiased.

    The draw is a pure function of (seed, step): every process derives the same matrix for the same step
    with no communication, which keeps DDP ranks in sync across redraws.
    """
    if num_features <= 0 or head_dim <= 0:
        raise ValueError(f"num_features and head_dim must be positive, got {num_features} and {head_dim}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(mix_seed(int(seed), int(step)))
    if not orthogonal:
        w = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64)
    else:
        blocks = []
        for _ in range(math.ceil(num_features / head_dim)):
            g = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
            q, r = torch.linalg.qr(g)
            q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)  # Haar-distributed (Mezzadri 2007)
            blocks.append(q.T)  # rows are orthonormal directions
        directions = torch.cat(blocks, dim=0)[:num_features]
        norms = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=1)
        w = directions * norms.unsqueeze(1)
    return w.to(device=device, dtype=dtype)


@runtime_checkable
class FeatureMap(Protocol):
    """What a feature map implements: ``phi(x, is_query=...)`` maps (b, h, n, d) to nonnegative (b, h, n, m).

    ``num_features`` is m. Queries and keys may take different maps (FAVOR+ takes different stabilizers); a map that
    is the same for both ignores ``is_query``. Features must not depend on other positions of the sequence (that
    would read the future in causal attention), and must be finite and nonnegative."""

    num_features: int

    def __call__(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor: ...


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for every input dtype but float64 (kept for gradcheck)."""
    return torch.promote_types(x.dtype, torch.float32)


def _check_random_features(x: torch.Tensor, random_features: torch.Tensor) -> None:
    if not isinstance(random_features, torch.Tensor):
        raise TypeError(f"random_features must be a torch.Tensor, got {type(random_features).__name__}")
    if random_features.dim() != 2 or random_features.shape[1] != x.shape[-1]:
        raise ValueError(
            f"random_features must be shaped (num_features, head_dim={x.shape[-1]}), got {tuple(random_features.shape)}"
        )


@outside_autocast
def favor_exponents(
    x: torch.Tensor, random_features: torch.Tensor, *, is_query: bool, scale: float | None = None
) -> torch.Tensor:
    """The exponents of the FAVOR+ positive features, (b, h, n, m) in float32 (float64 for float64 x):

        keys     w·x' - |x'|²/2 - |w|²/2  = -|w - x'|²/2     (<= 0: features at most 1, the causal-safe offset)
        queries  w·x' - |x'|²/2 + |w|²/2                      (the |w|²/2 terms cancel in phi(q)·phi(k))

    with x' = x · scale^½ (scale defaults to head_dim^-½). Paths that keep their own offsets (the large-key
    fallback, the decoding step) start from these."""
    _check_random_features(x, random_features)
    scale = x.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(x)
    w = random_features.to(device=x.device, dtype=dtype)
    xs = x.to(dtype) * math.sqrt(scale)
    u = torch.matmul(xs, w.T) - 0.5 * xs.pow(2).sum(-1, keepdim=True)
    half_w_sq = 0.5 * w.pow(2).sum(-1)
    return u + half_w_sq if is_query else u - half_w_sq


@renamed_keywords("0.3.0", projection="random_features")
def favor_positive(
    x: torch.Tensor,
    random_features: torch.Tensor,
    *,
    is_query: bool,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FAVOR+ positive random features (Lemma 1) with the stabilizers of the module docstring, float32.

    phi(q)·phi(k) is proportional, per query, to the unbiased estimate of exp(scale q·k). Keys: exp of
    :func:`favor_exponents`, in (0, 1]; ``key_padding_mask`` (b, n), True for real keys, sets padded keys'
    exponents to -inf before the exp (a padded key of large norm would otherwise give inf x 0 = NaN later), so
    their features are 0. Queries: the row maximum is taken off (detached: it cancels in the normalization)."""
    u = favor_exponents(x, random_features, is_query=is_query, scale=scale)
    if is_query:
        return torch.exp(u - u.amax(dim=-1, keepdim=True).detach())
    if key_padding_mask is not None:
        u = u.masked_fill(~key_padding_mask.bool()[:, None, :, None], -math.inf)
    return torch.exp(u)


@renamed_keywords("0.3.0", projection="random_features")
@outside_autocast
def relu_features(
    x: torch.Tensor,
    random_features: torch.Tensor,
    *,
    scale: float | None = None,
    eps: float = 1e-3,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """ReLU(W x') + eps (Section 2.2), float32; the same map for queries and keys. ``key_padding_mask`` (b, n)
    zeroes padded keys' features."""
    _check_random_features(x, random_features)
    scale = x.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(x)
    phi = torch.relu(torch.matmul(x.to(dtype) * math.sqrt(scale), random_features.to(device=x.device, dtype=dtype).T))
    phi = phi + eps
    if key_padding_mask is not None:
        phi = phi * key_padding_mask[:, None, :, None].to(phi.dtype)
    return phi


@renamed_keywords("0.3.0", kernel="feature_map")
def random_feature_map(
    x: torch.Tensor,
    random_features: torch.Tensor,
    *,
    is_query: bool,
    feature_map: str = "softmax",
    scale: float | None = None,
    eps: float = 1e-3,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The FAVOR+ map named by ``feature_map`` ("softmax": :func:`favor_positive`, "relu": :func:`relu_features`)."""
    if feature_map == "softmax":
        return favor_positive(x, random_features, is_query=is_query, scale=scale, key_padding_mask=key_padding_mask)
    if feature_map == "relu":
        mask = None if is_query else key_padding_mask
        return relu_features(x, random_features, scale=scale, eps=eps, key_padding_mask=mask)
    raise ValueError(f"unknown FAVOR+ feature map {feature_map!r}; choose one of {RANDOM_FEATURE_MAPS}")


class FavorPositive:
    """:func:`favor_positive` as a :class:`FeatureMap` over a fixed draw ``random_features`` (m, head_dim)."""

    @renamed_keywords("0.3.0", projection="random_features")
    def __init__(self, random_features: torch.Tensor, scale: float | None = None):
        self.random_features, self.scale = random_features, scale
        self.num_features = random_features.shape[0]

    def __call__(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        return favor_positive(x, self.random_features, is_query=is_query, scale=self.scale)


class ReluFeatures:
    """:func:`relu_features` as a :class:`FeatureMap` over a fixed draw ``random_features`` (m, head_dim)."""

    @renamed_keywords("0.3.0", projection="random_features")
    def __init__(self, random_features: torch.Tensor, scale: float | None = None, eps: float = 1e-3):
        self.random_features, self.scale, self.eps = random_features, scale, eps
        self.num_features = random_features.shape[0]

    def __call__(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        return relu_features(x, self.random_features, scale=self.scale, eps=self.eps)


class _SoftmaxPair(torch.autograd.Function):
    """[softmax(u), softmax(-u)] whose backward reads the features alone (see :func:`softmax_pair`)."""

    @staticmethod
    def forward(ctx, u: torch.Tensor) -> torch.Tensor:
        phi = torch.cat([torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)], dim=-1)
        ctx.save_for_backward(phi)
        return phi

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (phi,) = ctx.saved_tensors
        halves = phi.unflatten(-1, (2, -1))
        product = halves * grad.unflatten(-1, (2, -1))
        # softmax's Jacobian-vector product y (g - Σ y g) in each half, both at once and in place (one temporary of
        # the features' size, as torch's own softmax backward); the second half's sign is -u's
        product.addcmul_(halves, product.sum(-1, keepdim=True), value=-1.0)
        return product[..., 0, :] - product[..., 1, :]


def softmax_pair(u: torch.Tensor) -> torch.Tensor:
    """Hedgehog's features from their projection u (..., m / 2): [softmax(u), softmax(-u)] (..., m).

    Autograd keeps only the result, which the products after it keep anyway: composed of torch's ops it would also
    keep both softmaxes' outputs (a second copy of the m features, per position) until the backward."""
    return _SoftmaxPair.apply(u)


class HedgehogFeatureMap(torch.nn.Module):
    """Hedgehog's learned feature map (Zhang et al., ICLR 2024, arXiv 2402.04347), a :class:`FeatureMap`.

    Per head h, with u = x W_h + b_h (W_h: (head_dim, m / 2), b_h: (m / 2,)),

        phi(x) = [softmax(u), softmax(-u)]          (each softmax over its own m / 2 features)

    so the m features are positive, each half sums to 1, and a position's features depend on it alone. The map is
    applied to q and k as they are: no 1/sqrt(head_dim) is folded in (as in the paper); W learns whatever scale the
    attention it imitates needs, and an owner that wants the softmax scale at the start can multiply q and k by
    ``head_dim ** -0.25`` before the map.

    Initialization (:meth:`reset_parameters`): b = 0 and W = the identity on its first min(head_dim, m / 2) columns
    (W[i, i] = 1, every other entry of those columns 0). With m = 2 head_dim (the default) W is exactly the identity,
    the paper's initialization: phi starts as the "spiky" [softmax(x), softmax(-x)]. With m / 2 < head_dim the map
    starts from the first m / 2 coordinates of x; with m / 2 > head_dim the extra columns are drawn N(0, 0.02²) from
    torch's global generator (zero columns would give identical features whose gradients stay identical forever).

    Queries and keys take separate maps (``separate=True``, the default, as in the paper's attention layers): the
    kernel phi(q)·phi(k) of one shared map is symmetric (K(a, b) = K(b, a)) and ties what queries and keys may
    learn, while with two maps each side learns its own projection, so the pair can imitate attention weights
    that are not symmetric in this way. ``separate=False`` shares one (W, b) for both.

    Parameters: ``weight`` (heads, head_dim, m / 2) and ``bias`` (heads, m / 2) for queries (and for keys when
    shared), ``key_weight`` and ``key_bias`` for keys when separate (``None`` otherwise). They belong to the module
    that owns this map (an attention layer registers it as a submodule, so they train, move and save with it);
    unlike the random FAVOR+ maps, nothing is ever redrawn.

    Precision: features are computed in float32, or float64 when x or the parameters are float64 (as the other maps
    of this module: bf16 / fp16 inputs give float32 features). On CUDA the float32 map runs as two Triton kernels
    (:mod:`_triton_hedgehog`: the same products in float32, in one pass each way) unless ``set_triton_kernels(False)``
    or under torch.compile. ``forward(x, is_query=...)``: x (batch, heads, n, head_dim) -> (batch, heads, n, m).
    """

    INIT_STD = 0.02

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_features: int | None = None,
        *,
        separate: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if num_features is None:
            num_features = 2 * head_dim
        if isinstance(num_features, bool) or not isinstance(num_features, int):
            raise TypeError(f"num_features must be an int or None, got {type(num_features).__name__}")
        if num_features < 2 or num_features % 2:
            raise ValueError(
                f"num_features must be a positive even number (two softmax halves of m / 2), got {num_features}"
            )
        if not isinstance(separate, bool):
            raise TypeError(f"separate must be a bool, got {type(separate).__name__}")
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
        self.num_heads, self.head_dim, self.num_features, self.separate = num_heads, head_dim, num_features, separate
        half = num_features // 2
        kw = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty(num_heads, head_dim, half, **kw))
        self.bias = torch.nn.Parameter(torch.empty(num_heads, half, **kw))
        if separate:
            self.key_weight = torch.nn.Parameter(torch.empty(num_heads, head_dim, half, **kw))
            self.key_bias = torch.nn.Parameter(torch.empty(num_heads, half, **kw))
        else:
            self.register_parameter("key_weight", None)
            self.register_parameter("key_bias", None)
        self.reset_parameters()

    @classmethod
    def initial_weight(cls, weight: torch.Tensor) -> torch.Tensor:
        """The starting value of a weight (heads, head_dim, m / 2), as a new tensor: the identity on the first
        min(head_dim, m / 2) columns, N(0, INIT_STD²) on the rest (biases start at 0)."""
        _, head_dim, half = weight.shape
        r = min(head_dim, half)
        value = torch.zeros_like(weight)
        if half > r:
            value[:, :, r:].normal_(0.0, cls.INIT_STD)
        idx = torch.arange(r, device=weight.device)
        value[:, idx, idx] = 1.0
        return value

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The initialization of the class docstring (:meth:`initial_weight`, biases 0)."""
        for weight, bias in ((self.weight, self.bias), (self.key_weight, self.key_bias)):
            if weight is not None:
                weight.copy_(self.initial_weight(weight))
                bias.zero_()

    @outside_autocast
    def forward(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not isinstance(is_query, bool):
            raise TypeError(f"is_query must be a bool, got {type(is_query).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
        if x.dim() != 4:
            raise ValueError(f"x must be shaped (batch, heads, length, head_dim), got {tuple(x.shape)}")
        if x.shape[1] != self.num_heads:
            raise ValueError(f"x has {x.shape[1]} heads, this map was built for num_heads={self.num_heads}")
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"x has head_dim {x.shape[-1]}, this map was built for head_dim={self.head_dim}")
        shared = is_query or not self.separate
        weight = self.weight if shared else self.key_weight
        bias = self.bias if shared else self.key_bias
        dtype = torch.promote_types(compute_dtype(x), weight.dtype)
        if dtype == torch.float32 and takes_kernels(x, weight):  # CUDA: the fused kernels (_triton_hedgehog)
            return hedgehog_features(x, weight, bias)
        # a matmul over the heads, W broadcast over the batch: einsum is slower here on the CPU
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
            u = torch.matmul(x.to(dtype), weight.to(dtype)) + bias.to(dtype)[None, :, None, :]
            return softmax_pair(u)
        # autograd records nothing (inference): [u, -u] from one product with [W, -W], then one softmax over both
        # halves as rows of their own, in place of a negation, two softmaxes and their concatenation
        weight, bias = torch.cat([weight, -weight], -1).to(dtype), torch.cat([bias, -bias], -1).to(dtype)
        u = torch.matmul(x.to(dtype), weight).add_(bias[None, :, None, :])
        return torch.softmax(u.unflatten(-1, (2, -1)), -1).flatten(-2)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, head_dim={self.head_dim}, num_features={self.num_features}, "
            f"separate={self.separate}"
        )
