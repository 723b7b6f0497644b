"""One way to derive a seed from several integers, for every stream of random numbers the package draws.

Random features (per layer and draw), MLM masks (per epoch, batch and process) and evaluation masks are each a pure
function of a few integers, so every process derives the same numbers with no communication (DDP ranks stay in
sync across feature redraws) and a resumed run draws what the uninterrupted run would have.
"""

from __future__ import annotations

_MULTIPLIER = 1_000_003  # a prime: distinct tuples of small parts give distinct seeds
_MODULUS = 2**63 - 1  # within the range torch.Generator.manual_seed takes


def mix_seed(*parts: int) -> int:
    """A seed in [0, 2^63 - 1) from integers: parts[0], then acc * 1_000_003 + part for each later part, mod 2^63 - 1.

    mix_seed(seed, step) is the seed of FAVOR+'s draw number ``step``; more parts name finer streams."""
    if not parts:
        raise ValueError("mix_seed needs at least one integer")
    acc = 0
    for index, part in enumerate(parts):
        if isinstance(part, bool) or not isinstance(part, int):
            raise TypeError(f"mix_seed takes ints, got {type(part).__name__} at position {index}")
        acc = (acc * _MULTIPLIER + part) % _MODULUS if index else part % _MODULUS
    return acc
