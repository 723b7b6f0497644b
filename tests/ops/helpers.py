"""Helpers the attention-op tests share."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# the Linformer projections the GPU-path tests cover: (method, E / F shape, window)
LINFORMER_PROJECTIONS = [
    ("learned", (8, 64), None),  # shared E, F
    ("learned", (3, 8, 64), None),  # per head
    ("pool", None, 4),
    ("conv", (16, 16, 4), 4),
]


class CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched inside its ``with`` block: on a GPU each one is a kernel launch."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def assert_near(name, got, want, tolerance):
    """Max error as a share of the largest value: the measure for bf16, whose error scales with the magnitudes."""
    err = ((got.double().cpu() - want.double().cpu()).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert err < tolerance, f"{name}: max error {err:.2e} of the largest value"


def padding_left_right(b, n):
    """A (b, n) key mask: the first row padded on the left (7), the second on the right (5)."""
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :7] = False
    mask[1, n - 5 :] = False
    return mask


def grads_in_dtype(out, inputs, seed=3):
    """Gradients of a weighted sum of out, the weights in out's dtype and on its device."""
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    return torch.autograd.grad((out * weights).sum(), inputs)
