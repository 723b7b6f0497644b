"""Helpers the attention-op tests share."""

from torch.utils._python_dispatch import TorchDispatchMode


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
