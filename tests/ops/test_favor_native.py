"""The compiled causal FAVOR+ walk (ops/_native) against the portable chunked backend: same
outputs, gradients, final state and lost count, whatever the kernel, mask, dtype, padding, block size, thread count
or autograd path; and its build: a fresh cache, the off switch, and a compiler that fails."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linearformers.ops import (
    _native,
    draw_random_features,
    favor_attention,
    favor_backend,
    native_available,
)

pytestmark = pytest.mark.skipif(
    not native_available(), reason="the native kernel needs x86-64 Linux with AVX2 / FMA and a C++ compiler"
)


def _inputs(n=300, b=2, h=3, d=16, seed=0, key_scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    return tuple(x.to(dtype).requires_grad_() for x in (q, k * key_scale, v))


def _run(backend, q, k, v, w, **kwargs):
    """favor_attention(causal) on ``backend`` (None: the default, which these tests check is the native walk):
    outputs, final state and dq, dk, dv."""
    out, state = favor_attention(q, k, v, w, causal=True, return_state=True, backend=backend, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out) + out.detach())
    return out, state, grads


def _default_is_native(q, k, v, w, chunk_size=None):
    return favor_backend(q, k, v, w, causal=True, chunk_size=chunk_size, return_state=True) == "native"


@pytest.mark.parametrize("feature_map", ["softmax", "relu"])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_native_walk_matches_the_chunked_backend(feature_map, padding):
    q, k, v = _inputs()
    w = draw_random_features(48, 16, seed=1)
    mask = None
    if padding:
        mask = torch.ones(2, 300, dtype=torch.bool)
        mask[1, :37] = False if padding == "left" else mask[1, :37]
        mask[1, 250:] = False if padding == "right" else mask[1, 250:]
    kwargs = dict(feature_map=feature_map, key_padding_mask=mask, chunk_size=32)
    # a saved state every 3 chunks: 300 positions span 4 blocks
    assert _default_is_native(q, k, v, w, chunk_size=32)
    out, state, grads = _run(None, q, k, v, w, block_size=96, **kwargs)
    ref_out, ref_state, ref_grads = _run("chunked", q, k, v, w, **kwargs)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    for a, b in zip(state, ref_state):  # sums over 300 positions: errors ~1e-6 of the largest entry
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=f"d{name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_walk_takes_half_precision_inputs(dtype):
    q, k, v = _inputs(n=70, dtype=dtype)  # 70: padded to 96, inside one block
    w = draw_random_features(32, 16, seed=2)
    assert _default_is_native(q, k, v, w)
    out, _, grads = _run(None, q, k, v, w)
    ref_out, _, ref_grads = _run("chunked", q, k, v, w)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


def test_native_walk_hands_keys_of_large_norm_to_the_stabilized_fallback():
    """The native walk counts lost positions like the chunked backend, so such calls are redone the same way: the
    fallback's state has offset M < 0 (the backends' own passes hand over M = 0)."""
    q, k, v = _inputs(n=90, key_scale=10.0)
    w = draw_random_features(32, 16, seed=2)
    assert _default_is_native(q, k, v, w)
    out, state, grads = _run(None, q, k, v, w)
    ref_out, ref_state, ref_grads = _run("chunked", q, k, v, w)
    assert (state[2] < 0).all() and (ref_state[2] < 0).all()
    for a, b in zip((out, *state, *grads), (ref_out, *ref_state, *ref_grads)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert out.abs().sum() > 0


def test_native_walk_is_the_same_on_one_thread_and_with_saved_tensor_hooks():
    """Heads are split among threads (each head on one), so results do not depend on the thread count; activation
    checkpointing recomputes the forward and saves through the hooks; a retained graph backs up twice."""
    q, k, v = _inputs(n=260, b=1, h=5)
    w = draw_random_features(32, 16, seed=3)
    threads = torch.get_num_threads()

    def loss(x, y, z):  # a saved state every 2 chunks of 32
        return favor_attention(x, y, z, w, causal=True, backend="native", block_size=64).square().sum()

    try:
        torch.set_num_threads(1)
        one = torch.autograd.grad(loss(q, k, v), (q, k, v))
    finally:
        torch.set_num_threads(threads)
    two = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    checkpointed = torch.utils.checkpoint.checkpoint(loss, q, k, v, use_reentrant=False)
    for a, b in zip(torch.autograd.grad(checkpointed, (q, k, v)), two):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    value = loss(q, k, v)
    first = torch.autograd.grad(value, (q, k, v), retain_graph=True)
    for a, b in zip(torch.autograd.grad(value, (q, k, v)), first):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _probe(tmp_path, **env):
    """available() and a causal call in a fresh process with the given environment."""
    code = (
        "import torch, logging; logging.basicConfig()\n"
        "from linearformers.ops import _native, native_available, favor_attention, draw_random_features\n"
        "q = torch.randn(1, 2, 40, 16)\n"
        "out = favor_attention(q, q, q, draw_random_features(32, 16, seed=0), causal=True)\n"
        "print('available', _native.available(), bool(torch.isfinite(out).all()))\n"
    )
    environment = {**os.environ, "LINEARFORMERS_CACHE": str(tmp_path), **env}
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip(), result.stderr


def test_build_into_a_fresh_cache_the_off_switch_and_a_failing_compiler(tmp_path):
    stdout, _ = _probe(tmp_path / "fresh")
    assert stdout == "available True True"
    assert len(list((tmp_path / "fresh").glob("native-*.so"))) == 1
    stdout, _ = _probe(tmp_path / "off", LINEARFORMERS_NATIVE="0")
    assert stdout == "available False True" and not (tmp_path / "off").exists()
    stdout, stderr = _probe(tmp_path / "broken", CXX="false")
    assert stdout == "available False True"
    assert "native CPU kernels unavailable" in stderr
    assert not list((tmp_path / "broken").glob("*.so")), "a failed build leaves no library behind"


@pytest.fixture(scope="module")
def built_library():
    """This process's library and its record (size and SHA-256), built on first use."""
    library = _native._build()
    return library, library.with_name(library.name + ".sha256")


def _probe_correct(cache):
    """A fresh process: causal favor_attention through the native walk (asserted) matches the chunked backend. The
    ops package imports only torch, so the probe loads it alone and skips transformers' import (seconds)."""
    package = Path(_native.__file__).parents[2]  # linearformers/
    code = (
        "import logging, sys, types\n"
        "sys.modules['linearformers'] = types.ModuleType('linearformers')\n"
        f"sys.modules['linearformers'].__path__ = [{str(package)!r}]\n"
        "import torch\n"
        "from linearformers.ops import _native, favor_attention, draw_random_features, set_native_walk\n"
        "logging.basicConfig()\n"
        "q, k, v = torch.randn(3, 1, 2, 40, 16).unbind(0)\n"
        "w = draw_random_features(32, 16, seed=0)\n"
        "out = favor_attention(q, k, v, w, causal=True)\n"
        "set_native_walk(False)\n"
        "ref = favor_attention(q, k, v, w, causal=True)\n"
        "print('available', _native.available(), bool(torch.allclose(out, ref, rtol=1e-4, atol=1e-5)))\n"
    )
    environment = {**os.environ, "LINEARFORMERS_CACHE": str(cache)}
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"exit status {result.returncode} (-7: SIGBUS): {result.stderr[-2000:]}"
    return result.stdout.strip(), result.stderr


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "no_checksum"])
def test_a_damaged_cached_library_is_rebuilt_not_loaded(tmp_path, built_library, damage):
    """The cached library is checked against the size and SHA-256 written beside it before it is loaded: a truncated
    one used to kill every later process with SIGBUS (its mapped pages lie past the end of the file)."""
    good = built_library[0].read_bytes()
    assert built_library[1].read_text().split() == [str(len(good)), hashlib.sha256(good).hexdigest()]
    library, record = (shutil.copy(path, tmp_path) for path in built_library)
    library, record = Path(library), Path(record)
    if damage == "truncated":
        os.truncate(library, len(good) * 2 // 3)
    elif damage == "corrupted":  # same size, a run of zeros in the middle
        library.write_bytes(good[:4096] + bytes(len(good) - 8192) + good[-4096:])
    else:
        record.unlink()
    stdout, stderr = _probe_correct(tmp_path)
    assert stdout == "available True True"
    assert "rebuilding it" in stderr
    assert library.read_bytes() == good and record.read_text() == built_library[1].read_text()
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([library.name, record.name]), "no leftovers"
