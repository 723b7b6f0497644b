"""Which code computes FAVOR+ and linear attention: the one place where a backend is chosen.

Backends of :func:`favor.favor_attention` and of :func:`linear.linear_attention` (precomputed features):

* ``"reference"``: the quadratic formula of :mod:`reference`, for tests and for reading; no state in or out.
* ``"chunked"`` (:mod:`_favor_chunked`): batched products over every chunk at once (bidirectional: the whole
  sequence as one), so the number of dispatched ops (kernel launches on a GPU) does not grow with the length, and
  nothing in it depends on the data, so torch.compile traces it whole. Runs on every device; the default off the
  CPU and under torch.compile.
* ``"native"`` (:mod:`_favor_native` and :mod:`_linear_native` over :mod:`_native`, causal only): the compiled CPU
  walk, carrying one state chunk by chunk with every product in its own AVX2 GEMM, which keeps its operands in
  cache; the causal default on x86-64 CPUs where it is built and the shapes allow (head_dim, m and the chunk
  multiples of 16).
* ``"triton"`` (:mod:`_triton_causal`): fused Triton kernels, forward and backward, that carry the
  state in registers chunk by chunk and, for FAVOR+ (softmax and ReLU maps), compute the features inside the kernel
  from q, k and the projection, so neither the feature maps nor per-chunk states reach memory; bf16 operands with
  float32 sums for bf16 inputs. The causal default on CUDA where Triton imports and the shapes allow (m, head_dim
  multiples of 16, chunk a power of two >= 16, no float64); custom ops, so torch.compile keeps them whole, without
  a graph break. Named on the CPU it runs under Triton's interpreter only (``TRITON_INTERPRET=1``, for tests), and is
  refused otherwise. Bidirectional (:mod:`_triton_bidirectional`: the two products K'ᵀ[V, 1], then Q' times it,
  with the features computed inside both) it is the default on CUDA for the fused maps, under the same refusals
  (given features take it when named).
* ``"blockwise"`` (:mod:`_favor_blockwise`, bidirectional FAVOR+ only): feature maps built a block of positions at a
  time with the FAVOR+ exponents fused into the GEMMs, so they never exist for the whole sequence; the bidirectional
  default on the CPU.

``backend=None`` picks as above. The native walk and the blockwise kernel compute in float32, so float64 inputs
take "chunked" (float64 math throughout), and naming either for them is refused. :func:`set_native_walk` is the
public switch that turns the native walk off for automatic choices (``LINEARFORMERS_NATIVE=0`` also keeps it from
being built at all), :func:`set_triton_kernels` the one for the Triton kernels; a named backend is always taken as
asked, or refused with a ValueError saying why it cannot run. :func:`favor.favor_backend` and
:func:`linear.linear_backend` name the backend a call takes.
"""

from __future__ import annotations

import torch

from ._native import available as native_available
from ._triton_causal import DEFAULT_CHUNK as _TRITON_DEFAULT_CHUNK
from ._triton_causal import refusal as _triton_kernel_refusal

BACKENDS = ("reference", "chunked", "native", "blockwise", "triton")
CAUSAL_BACKENDS = ("reference", "chunked", "native", "triton")  # what causal calls may name
BIDIRECTIONAL_BACKENDS = ("reference", "chunked", "blockwise", "triton")  # what bidirectional FAVOR+ may name
TRITON_CHUNK = _TRITON_DEFAULT_CHUNK  # the Triton kernels' chunk (see _triton_causal)
NATIVE_CHUNK = 32  # the compiled walk's default chunk: it carries one state, so small chunks cost it nothing
_SETTINGS = {"native": True, "triton": True}
# the compiled walk and the blockwise kernel compute in float32; float64 inputs get float64 math from "chunked"
_FLOAT32_ONLY = "it computes in float32; float64 inputs take backend='chunked' (or None), which computes in float64"


def set_native_walk(enabled: bool) -> bool:
    """Switch the compiled CPU walk on or off for ``backend=None`` calls; returns the previous setting.

    Off, causal attention on the CPU runs the chunked backend (the one GPUs run). A call that names
    ``backend="native"`` is refused while it is off."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_native_walk takes a bool, got {type(enabled).__name__}")
    previous, _SETTINGS["native"] = _SETTINGS["native"], enabled
    return previous


def set_triton_kernels(enabled: bool) -> bool:
    """Switch the Triton kernels on or off for ``backend=None`` calls; returns the previous setting.

    Off, causal attention on CUDA runs the chunked backend and :class:`HedgehogFeatureMap` its PyTorch path. A call
    that names ``backend="triton"`` is refused while it is off."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_triton_kernels takes a bool, got {type(enabled).__name__}")
    previous, _SETTINGS["triton"] = _SETTINGS["triton"], enabled
    return previous


def triton_kernels_enabled() -> bool:
    """Whether :func:`set_triton_kernels` leaves the Triton kernels on (a call may still be refused: see
    :func:`triton_refusal`)."""
    return _SETTINGS["triton"]


def triton_refusal(
    v: torch.Tensor, num_features: int, chunk_size: int | None, *, inputs: tuple[torch.Tensor, ...] = ()
) -> str | None:
    """Why the Triton kernels cannot run this call, or None when they can (``inputs``: q and k, or the features)."""
    if not _SETTINGS["triton"]:
        return "it is switched off (set_triton_kernels(False))"
    return _triton_kernel_refusal(v, num_features, chunk_size, inputs=inputs)


def native_walk_enabled() -> bool:
    """Whether :func:`set_native_walk` leaves the compiled walk on (it may still be unavailable: see
    :func:`native_refusal`)."""
    return _SETTINGS["native"]


def native_refusal(v: torch.Tensor, num_features: int, chunk_size: int, *, state_in: bool = False) -> str | None:
    """Why the compiled causal walk cannot run this call, or None when it can."""
    if v.device.type != "cpu":
        return f"it runs on CPU tensors only, these are on {v.device.type}"
    if v.dtype == torch.float64:
        return _FLOAT32_ONLY
    for name, value in (("head_dim", v.shape[-1]), ("num_features", num_features), ("chunk_size", chunk_size)):
        if value % 16:
            return f"{name} must be a multiple of 16 (its tile width), got {value}"
    if state_in:
        return "it takes no initial_state (continued prefills run the chunked backend)"
    if torch.compiler.is_compiling():
        return "torch.compile cannot trace its ctypes call"
    if not native_walk_enabled():
        return "it is switched off (set_native_walk(False))"
    if not native_available():
        return (
            "it is not built here: LINEARFORMERS_NATIVE=0, a CPU without x86-64 AVX2/FMA, no C++ compiler or a "
            "failed build (see the log), or Hub remote code without its source"
        )
    return None


def choose_backend(
    backend: str | None,
    v: torch.Tensor,
    num_features: int,
    chunk_size: int | None,
    *,
    causal: bool,
    state_in: bool = False,
    state_out: bool = False,
    fused: bool = True,
    inputs: tuple[torch.Tensor, ...] = (),
) -> str:
    """The backend a call runs, from BACKENDS; ``chunk_size`` None means each backend's default; ``fused``: the
    call has the FAVOR+ map to fuse (False for precomputed features, which "blockwise" does not take); ``inputs``:
    q and k (or the features), which the Triton kernels check too.

    None, causal: "triton" on CUDA tensors where :func:`triton_refusal` finds nothing against it; else "native"
    where :func:`native_refusal` finds nothing against it; "chunked" otherwise.
    None, bidirectional: with the FAVOR+ map to fuse, "triton" on CUDA tensors where :func:`triton_refusal` finds
    nothing against it, "blockwise" on the CPU (outside torch.compile: its blocks branch on the data; not float64,
    which it would compute in float32); "chunked" otherwise (given features take "triton" only when named).
    "reference" with a state in or out
    is refused, as are "native" for bidirectional attention and "blockwise" for causal attention or given
    features."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose None or one of {BACKENDS}")
    if backend == "reference":
        if state_in or state_out:
            raise ValueError("backend='reference' takes no initial_state and returns no state")
        return "reference"
    if backend == "native":
        if not causal:
            raise ValueError(
                "backend='native' is the compiled causal walk; bidirectional attention has no native kernel"
            )
        reason = native_refusal(v, num_features, NATIVE_CHUNK if chunk_size is None else chunk_size, state_in=state_in)
        if reason is not None:
            raise ValueError(f"backend='native' cannot run this call: {reason}")
        return "native"
    if backend == "triton":
        reason = triton_refusal(v, num_features, chunk_size, inputs=inputs)
        if reason is not None:
            raise ValueError(f"backend='triton' cannot run this call: {reason}")
        return "triton"
    if backend == "blockwise":
        if causal or not fused:
            raise ValueError("backend='blockwise' is bidirectional FAVOR+ with its own feature map; use 'chunked'")
        if v.dtype == torch.float64:
            raise ValueError(f"backend='blockwise' cannot run this call: {_FLOAT32_ONLY}")
        return "blockwise"
    if backend == "chunked":
        return "chunked"
    if not causal:
        if fused and v.device.type == "cuda" and triton_refusal(v, num_features, chunk_size, inputs=inputs) is None:
            return "triton"
        on_cpu = v.device.type == "cpu" and not torch.compiler.is_compiling()
        return "blockwise" if fused and on_cpu and v.dtype != torch.float64 else "chunked"
    if v.device.type == "cuda" and triton_refusal(v, num_features, chunk_size, inputs=inputs) is None:
        return "triton"
    chunk = NATIVE_CHUNK if chunk_size is None else chunk_size
    return "native" if native_refusal(v, num_features, chunk, state_in=state_in) is None else "chunked"
