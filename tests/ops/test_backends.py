"""Which backend a call takes (ops/backends.py): the rule ``choose_backend`` and the public questions
``favor_backend`` / ``linear_backend``, which name the backend ``favor_attention`` / ``linear_attention`` dispatch on
for the same arguments, and the refusals of named backends that cannot run a call."""

import pytest
import torch

from linearformers.ops import (
    draw_random_features,
    favor_attention,
    favor_backend,
    linear_attention,
    linear_backend,
    native_available,
    native_walk_enabled,
    set_native_walk,
)
from linearformers.ops.backends import choose_backend, native_refusal

CPU_CAUSAL = "native" if native_available() else "chunked"  # where the compiled walk is built, None takes it


def _qkv(n=40, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, n, d, generator=g, dtype=dtype) for _ in range(3))


def test_backend_choice():
    v = torch.zeros(1, 1, 4, 16)
    choose = choose_backend
    assert choose(None, v.to("meta"), 32, None, causal=True) == "chunked"  # any device but the CPU
    expected = "native" if native_refusal(v, 32, 32) is None else "chunked"
    assert choose(None, v, 32, None, causal=True) == expected
    assert choose(None, v[..., :12], 32, None, causal=True) == "chunked"  # not a multiple of 16: no native
    assert choose(None, v, 32, None, causal=True, state_in=True) == "chunked"  # the native walk takes no state
    assert choose("chunked", v, 32, None, causal=True) == "chunked"
    assert choose(None, v, 32, None, causal=False) == "blockwise"  # bidirectional on the CPU
    assert choose(None, v.to("meta"), 32, None, causal=False) == "chunked"  # and elsewhere
    assert choose(None, v, 32, None, causal=False, fused=False) == "chunked"  # given features
    with pytest.raises(ValueError, match="blockwise"):
        choose("blockwise", v, 32, None, causal=True)
    previous = set_native_walk(False)
    try:
        assert not native_walk_enabled()
        assert choose(None, v, 32, None, causal=True) == "chunked"
        with pytest.raises(ValueError, match="switched off"):
            choose("native", v, 32, None, causal=True)
    finally:
        set_native_walk(previous)
    with pytest.raises(TypeError, match="bool"):
        set_native_walk("no")
    with pytest.raises(ValueError, match="multiple of 16"):
        choose("native", v[..., :12], 32, None, causal=True)
    with pytest.raises(ValueError, match="CPU"):
        choose("native", v.to("meta"), 32, None, causal=True)
    with pytest.raises(ValueError, match="unknown backend"):
        choose("flash", v, 32, None, causal=True)
    with pytest.raises(ValueError, match="no state"):
        choose("reference", v, 32, None, causal=True, state_out=True)
    with pytest.raises(ValueError, match="bidirectional"):
        choose("native", v, 32, None, causal=False)


def test_favor_backend_names_what_each_favor_call_takes_on_the_cpu():
    q, k, v = _qkv()
    w = draw_random_features(32, 16, seed=1)
    assert favor_backend(q, k, v, w, causal=True) == CPU_CAUSAL
    assert favor_backend(q, k, v, w, causal=True, chunk_size=8) == "chunked"  # the walk's tile is 16
    assert favor_backend(*(t.double() for t in (q, k, v)), w, causal=True) == "chunked"  # float64 math
    assert favor_backend(q, k, v, w) == "blockwise"
    assert favor_backend(q, k, v, w, backend="reference") == "reference"
    # a continued prefill runs the chunked form with per-position offsets, whatever the backend would be
    _, state = favor_attention(q, k, v, w, causal=True, return_state=True)
    assert favor_backend(q, k, v, w, causal=True, initial_state=state) == "chunked"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(causal=True, backend="blockwise"), "blockwise"),
        (dict(causal=False, backend="native"), "bidirectional"),
        (dict(causal=True, backend="reference", return_state=True), "no state"),
        (dict(causal=True, backend="flash"), "unknown backend"),
    ],
)
def test_favor_backend_refuses_what_the_call_refuses(kwargs, match):
    q, k, v = _qkv()
    w = draw_random_features(32, 16, seed=1)
    for ask in (favor_backend, favor_attention):
        with pytest.raises(ValueError, match=match):
            ask(q, k, v, w, **kwargs)


def test_linear_backend_names_what_each_linear_call_takes_on_the_cpu():
    phi_q, phi_k, v = (t.abs() for t in _qkv())
    assert linear_backend(phi_q, phi_k, v, causal=True) == CPU_CAUSAL
    assert linear_backend(phi_q, phi_k, v[..., :8], causal=True) == "chunked"  # v's width is no multiple of 16
    assert linear_backend(phi_q, phi_k, v) == "chunked"  # given features: no blockwise kernel
    with pytest.raises(ValueError, match="blockwise"):
        linear_backend(phi_q, phi_k, v, backend="blockwise")


@pytest.mark.skipif(not native_available(), reason="the native walk is not built here")
def test_linear_backend_refuses_native_for_a_v_width_the_walk_cannot_tile():
    phi_q, phi_k, v = (t.abs() for t in _qkv())
    for ask in (linear_backend, linear_attention):
        with pytest.raises(ValueError, match="head_dim must be a multiple of 16 .*, got 8"):
            ask(phi_q, phi_k, v[..., :8], causal=True, backend="native")


def test_the_backend_questions_check_their_arguments():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="random_features must be shaped"):
        favor_backend(q, k, v, torch.zeros(32, 8))
    with pytest.raises(ValueError, match="the same number of features"):
        linear_backend(q, k[..., :8], v)
