"""LinearAttentionCache (modeling/cache.py) on its own: what it holds. The models' use of it (prefill, steps, beams,
a batch kept) is tested with generation (test_generation.py) and the families."""

import pytest
import torch

from linearformers import LinearAttentionCache


def test_the_cache_refuses_more_states_than_it_holds():
    cache = LinearAttentionCache(1)
    with pytest.raises(ValueError, match="holds at most 10 states, got 11"):
        cache.set_state(0, (torch.zeros(1, 2),) * 11)
