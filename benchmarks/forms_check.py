"""CUDA diagnosis: the causal Triton kernels' two forms against the chunked backend (float32 math), per head_dim and
warps; prints the max relative error of out, dq, dk, dv for each configuration."""

import sys

import torch

from linearformers.ops import _triton_causal, draw_random_features, favor_attention, linear_attention

torch.manual_seed(0)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def case(form, warps, d, m, n, feature_map, dtype):
    _triton_causal.TUNING.update(form=form, chunk_warps=warps, anywhere=True)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, d, generator=g).mul(s).cuda() for s in (1.5, 1.5, 1.0))
    w = draw_random_features(m, d, seed=2, device="cuda")
    cot = torch.randn(1, 2, n, d, generator=g).cuda()
    res = []
    for be, dt in (("triton", dtype), ("chunked", torch.float32)):
        x = [t.detach().to(dt).clone().requires_grad_() for t in (q, k, v)]
        if feature_map == "features":
            from linearformers.ops.feature_maps import random_feature_map

            pq = random_feature_map(x[0], w.to(dt), is_query=True)
            pk = random_feature_map(x[1], w.to(dt), is_query=False)
            out = linear_attention(pq, pk, x[2], causal=True, backend=be)
        else:
            out = favor_attention(*x, w, causal=True, feature_map=feature_map, backend=be)
        out.backward(cot.to(out.dtype))
        torch.cuda.synchronize()
        res.append([out.detach(), *(t.grad for t in x)])
    return [rel(a, b) for a, b in zip(*res)]


def hybrid_case(form, d, m, n, window, dtype, ell):
    from linearformers.ops import hybrid_attention

    _triton_causal.TUNING.update(form=form, chunk_warps=None, anywhere=True)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, n, d, generator=g).mul(s).cuda() for s in (1.5, 1.5, 1.0))
    pq, pk = (torch.rand(2, 2, n, m, generator=g).cuda() for _ in range(2))
    gamma = torch.rand(2, generator=g).cuda() + 0.5
    log_scale = torch.randn(2, 2, n, generator=g).cuda() if ell else None
    mask = torch.ones(2, n, dtype=torch.bool, device="cuda")
    mask[0, : n // 3] = False
    cot = torch.randn(2, 2, n, d, generator=g).cuda()
    res = []
    for be, dt in (("triton", dtype), ("chunked", torch.float32)):
        x = [t.detach().to(dt).clone().requires_grad_() for t in (q, k, v, pq, pk)]
        gm = gamma.clone().requires_grad_()
        out = hybrid_attention(
            *x, gm, window, causal=True, key_padding_mask=mask, sinks=1, backend=be, query_log_scale=log_scale
        )
        out.backward(cot.to(out.dtype))
        torch.cuda.synchronize()
        res.append([out.detach(), *(t.grad for t in x), gm.grad])
    return [rel(a, b) for a, b in zip(*res)]


if "--hybrid" in sys.argv:
    for form in ("walk", "chunks"):
        for d, m, window in ((16, 32, 32), (64, 128, 64)):
            for dtype in (torch.bfloat16,):
                for ell in (False, True):
                    try:
                        errs = hybrid_case(form, d, m, 259 if d == 16 else 1000, window, dtype, ell)
                        print(
                            f"hybrid {form:6s} d {d} m {m} w {window} {str(dtype)[6:]:8s} ell {ell:d} "
                            + " ".join(f"{e:.2e}" for e in errs),
                            flush=True,
                        )
                    except Exception as err:
                        print(
                            f"hybrid {form} {d} {m} {dtype} FAILED {type(err).__name__}: {str(err)[:200]}", flush=True
                        )
                        sys.exit(1)
    _triton_causal.TUNING.update(form=None, chunk_warps=None, anywhere=False)

if "--linear" in sys.argv:
    for form, warps in (("walk", None), ("chunks", 4), ("chunks", 8)):
        for d, m in ((16, 32), (64, 256)):
            for feature_map in ("softmax",):
                for dtype in (torch.bfloat16,):
                    try:
                        errs = case(form, warps, d, m, 259 if d == 16 else 1000, feature_map, dtype)
                        print(
                            f"{form:6s} warps {warps} d {d} m {m} {feature_map:8s} {str(dtype)[6:]:8s} "
                            + " ".join(f"{e:.2e}" for e in errs),
                            flush=True,
                        )
                    except Exception as err:
                        print(
                            f"{form} {warps} {d} {m} {feature_map} {dtype} FAILED {type(err).__name__}: "
                            f"{str(err)[:200]}",
                            flush=True,
                        )
                        sys.exit(1)
    _triton_causal.TUNING.update(form=None, chunk_warps=None, anywhere=False)


def states_case(d, m, n, dtype, device, label=""):
    """The chunk form's pieces apart, on given features: the states ``_states`` stores before each chunk, and the
    undivided N, D of ``_chunk_out``, each against its PyTorch sum (float32); prints the max relative errors. The
    chunk form is taken at every width ("anywhere"), the checked ones and the others."""
    _triton_causal.TUNING.update(form="chunks", anywhere=True)
    g = torch.Generator().manual_seed(4)
    pq, pk = (torch.rand(1, 2, n, m, generator=g).to(device, dtype) for _ in range(2))
    v = torch.randn(1, 2, n, d, generator=g).to(device, dtype)
    kern = _triton_causal.kernels()
    _, k_, v_, _, _, launch, segments = _triton_causal._prepare(pq, pk, v, None, None, "features", 1.0, 0.0, 64)
    qoff = torch.zeros(2, n, device=device)
    sums = None
    if segments[0] > 1:
        sums = _triton_causal._segment_sums(kern, launch, k_, v_, None, None, None, qoff, segments, queries=False)
    hs, hz, _, _ = _triton_causal._states(kern, launch, segments, k_, v_, None, None, qoff, None, None, sums)
    pkf, pqf, vf = pk.float()[0], pq.float()[0], v.float()[0]
    starts = range(0, n, 64)
    ref_h = torch.stack([torch.einsum("hsm,hsd->hmd", pkf[:, :c], vf[:, :c]) for c in starts], 1)
    ref_z = torch.stack([pkf[:, :c].sum(1) for c in starts], 1)
    num, den, *_ = _triton_causal.linear_sums(pq, pk, v, None, None, None, None, "features", 1.0, 0.0, 64)
    scores = torch.einsum("htm,hsm->hts", pqf, pkf).tril()
    errors = (
        rel(hs.float(), ref_h), rel(hz, ref_z), rel(num.view(2, n, d), scores @ vf), rel(den[:-1].view(2, n), scores.sum(-1))
    )  # fmt: skip
    print(f"states d {d} m {m} n {n} {str(dtype)[6:]:8s} {label:12s} H {errors[0]:.2e} z {errors[1]:.2e} "
          f"N {errors[2]:.2e} D {errors[3]:.2e}", flush=True)  # fmt: skip
    _triton_causal.TUNING.update(form=None, anywhere=False)


def _states_run(d, m, n, dtype, where, label="", **tuning):
    _triton_causal.TUNING.update(**tuning)
    try:
        states_case(d, m, n, dtype, where, label)
    except Exception as err:
        print(f"states d {d} m {m} {str(dtype)[6:]} {label} FAILED {type(err).__name__}: {str(err)[:200]}", flush=True)
        if "illegal" in str(err):  # the context is lost: nothing after it can run
            sys.exit(1)
    finally:
        _triton_causal.TUNING.update(chunk_warps=None, state_dtype=None)


# head_dim and features apart (d = 16 with m = 64, d = 64 with m = 32), then the failing width with the states stored
# in float32, at 8 warps and in float32 throughout, and the checked width: (d, m, dtype, label, tuning)
STATES_CASES = [
    *((d, m, torch.bfloat16, "", {}) for d, m in ((64, 64), (32, 64), (64, 32), (16, 64), (32, 32), (16, 32))),
    (16, 32, torch.bfloat16, "H float32", {"state_dtype": "float32"}),
    (16, 32, torch.bfloat16, "8 warps", {"chunk_warps": 8}),
    (16, 32, torch.float32, "", {}),
    (64, 256, torch.bfloat16, "", {}),
]

if "--states" in sys.argv:  # where the chunk form goes wrong on CUDA at head_dim 16: its stored states or its outputs
    # --states [--case K] [--cpu]: every case in turn, or case K alone (a process each: an illegal address ends one)
    where = "cpu" if "--cpu" in sys.argv else "cuda"
    picked = STATES_CASES
    if "--case" in sys.argv:
        picked = [STATES_CASES[int(sys.argv[sys.argv.index("--case") + 1])]]
    for d, m, dtype, label, tuning in picked:
        length = (1000 if m == 256 else 259) if where == "cuda" else 70
        _states_run(d, m, length, dtype, where, label, **tuning)
