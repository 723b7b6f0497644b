"""Argument checks shared by the attention kernels, and the old names of renamed keywords. Errors name the value and
the fix."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, same_length: bool = False) -> None:
    """Check that q, k, v are (batch, heads, length, head_dim) tensors that fit together."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be shaped (batch, heads, length, head_dim); got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"q, k, v do not fit together: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
            "batch and heads must match, and k and v must have the same length"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head_dim differ: {q.shape[-1]} vs {k.shape[-1]}")
    if same_length and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention needs q and k of the same length; got {q.shape[2]} and {k.shape[2]}")
    if same_length and q.shape[2] == 0:
        raise ValueError("q, k, v have length 0: causal attention needs at least one token")


def check_mask(mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """Return a (batch, length) bool key-padding mask (True = real token), or None."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != (batch, length):
        raise ValueError(
            f"key_padding_mask must be shaped (batch, length) = ({batch}, {length}), got {tuple(mask.shape)}; "
            "pass the 2-D attention_mask with 1 for real tokens and 0 for padding"
        )
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or mask.is_complex() or bool(((mask != 0) & (mask != 1)).any()):
            raise TypeError(
                f"key_padding_mask must be bool or hold only 0 and 1 (1 = real token), got dtype {mask.dtype}"
                f"{'' if not mask.is_floating_point() else ' (an additive float mask, 0 / -inf, is not accepted)'}"
            )
    return mask.bool()


def check_window_sinks_gamma(window_name: str, window: object, sinks: object, gamma: object, heads: int) -> None:
    """The hybrids' window (a positive int, named ``window_name`` in the message), sinks (an int >= 0) and gamma (a
    floating-point (heads,) tensor)."""
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"{window_name} must be a positive int, got {window!r}")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks must be an int >= 0, got {sinks!r}")
    if not isinstance(gamma, torch.Tensor):
        raise TypeError(f"gamma must be a torch.Tensor of shape (heads,), got {type(gamma).__name__}")
    if not gamma.is_floating_point():
        raise TypeError(f"gamma must be a floating-point tensor, got {gamma.dtype}")
    if tuple(gamma.shape) != (heads,):
        raise ValueError(f"gamma must be shaped (heads,) = ({heads},), got {tuple(gamma.shape)}")


def renamed_keywords(version: str, **renames: str) -> Callable[[F], F]:
    """Let ``fn`` take each keyword's old name (``old="new"``) until ``version``: an old name raises a FutureWarning
    that names the new one and the version that drops it, and is passed on under the new name; an old name given
    with its new name raises TypeError. The signature ``fn`` shows is its own, with the new names only."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}() got both {old}= and {new}=; pass only {new}= (its new name)")
                    warnings.warn(
                        f"{fn.__name__}(): {old}= is renamed {new}=; the name {old}= goes away in {version}",
                        FutureWarning,
                        stacklevel=2,
                    )
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper

    return decorate
