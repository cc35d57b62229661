#!/usr/bin/env python3
"""PyTorch side of the shape sweep (issue 19; kiln's side is benchmarks/sweep.cpp).

The same cases, ids, sizes and sampling as sweep.cpp: every case in torch.compile's default mode
(impl "torch.compile") and with dynamic=True ("torch.compile-dynamic"), each on a fresh dynamo state
(torch._dynamo.reset() before each compile, so no case inherits another's shapes or the automatic
dynamic mode), checked against eager once, then timed like kiln's benchmarks/timing.hpp: 10 warm-up
calls, then --reps repetitions, each after a 256 MiB memset that clears L2, with CUDA events around
the call alone; the median (sorted[n // 2]). One JSON object a line, stdout:

  {"id": "sweep-softmax-4096x8192-f32", "impl": "torch.compile", "ms": ..., "gbps": ..., "bytes": ...,
   "pct_copy": ..., "family": ..., "op": ..., "shape": ..., "dtype": ..., "note": ...}

Usage:
  python3 benchmarks/sweep_peer.py --only softmax,layer_norm [--dtypes f32,bf16] [--cols 64,1000]
      [--mib 256] [--reps 100] [--cache-dir DIR] [--modes default,dynamic] [--shard I/N] [--list]

--cache-dir DIR points TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR at DIR/inductor and DIR/triton
(before torch is imported), so several processes or device calls share torch's compile cache; without
it the variables already set are used, else a fresh temporary cache. --list needs no torch.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback

FAMILIES = ["softmax", "log_softmax", "layer_norm", "layer_norm_bwd", "rms_norm", "rms_norm_bwd",
            "cross_entropy", "pointwise", "colsum", "3d", "small"]
ROW_FAMILIES = FAMILIES[:7]
ROW_LENGTHS = [64, 128, 256, 512, 768, 1000, 1024, 2048, 3072, 4096, 5120, 8192, 12288, 16384, 32000,
               50257, 65536, 128256, 262144]
ESIZE = {"f32": 4, "bf16": 2}

torch = None
F = None
ARGS = None


def emit(obj):
    print(json.dumps(obj), flush=True)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def listed(lst, x):
    return x in [s.strip() for s in lst.split(",") if s.strip()]


# --------------------------------------------------------------------------------------------
# the cases: the same list, in the same order, as sweep.cpp's main()


def budget_bytes():
    return int(ARGS.mib * 1048576.0)


def rows_for(cols, es):
    return max(1, budget_bytes() // (cols * es))


def side_for(es):
    s = math.isqrt(budget_bytes() // es)
    return max(64, s // 64 * 64)


def dims(shape):
    return "x".join(str(v) for v in shape)


class Case:
    def __init__(self, family, op, dtype, shape, **kw):
        self.family, self.op, self.dtype, self.shape = family, op, dtype, list(shape)
        self.id = f"sweep-{op}-{dims(shape)}-{dtype}"
        self.kw = kw  # what build() needs beyond op and shape


def cases():
    out = []
    for dt in ("f32", "bf16"):
        if not listed(ARGS.dtypes, dt):
            continue
        es = ESIZE[dt]
        for fam in ROW_FAMILIES:
            # --cols: any lengths (odd ones off the list too), as sweep.cpp's
            for c in ([int(x) for x in ARGS.cols.split(",") if x] if ARGS.cols else ROW_LENGTHS):
                out.append(Case(fam, fam, dt, (rows_for(c, es), c), kind=fam))
        n = side_for(es)
        for op in ("add_contig", "add_transposed", "add_strided", "add_offset", "add_bcast_row",
                   "add_bcast_col"):
            out.append(Case("pointwise", op, dt, (n, n), kind=op))
        for c in (32, 768, 4096, 32000):
            out.append(Case("colsum", "colsum", dt, (rows_for(c, es), c), kind="colsum"))
        for h, t in ((12, 197), (16, 1024), (32, 4096)):
            b = max(1, budget_bytes() // (h * t * es))
            for dim in (-1, 1):
                out.append(Case("3d", "softmax3d" if dim == -1 else "softmax3d_dim1", dt, (b, h, t),
                                kind="softmax3d", dim=dim))
        for fam, r, c in (("softmax", 4, 64), ("softmax", 32, 1000), ("layer_norm", 16, 768),
                          ("rms_norm", 8, 4096), ("cross_entropy", 8, 32000)):
            out.append(Case("small", "small_" + fam, dt, (r, c), kind=fam))
    return [c for c in out if not ARGS.only or listed(ARGS.only, c.family)]


# --------------------------------------------------------------------------------------------
# building a case: -> (f, inputs, run(fn) -> zero-arg callable returning the outputs, bytes)

SEED = [1]


def randn(shape, dt):
    g = torch.Generator(device="cuda")
    g.manual_seed(SEED[0])
    SEED[0] += 1
    dtype = torch.bfloat16 if dt == "bf16" else torch.float32
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts)


def fwd(f, inp):
    return lambda fn: (lambda: fn(*inp))


def with_grad(inp, wrt_idx, dy_last=True):
    """Forward on inp[:-1] (the last input is the random dy), then autograd.grad w.r.t. wrt_idx;
    returns the gradients, as kiln's k::vjp does (the compiled forward still writes y)."""
    fwd_in = inp[:-1] if dy_last else inp
    wrt = tuple(fwd_in[i] for i in wrt_idx)
    dy = inp[-1]

    def run(fn):
        def step():
            y = fn(*fwd_in)
            return tuple(torch.autograd.grad(y, wrt, dy))
        return step
    return run


def build(case):
    dt, (kind, shape) = case.dtype, (case.kw["kind"], case.shape)
    if kind in ("softmax", "log_softmax"):
        r, c = shape
        x = randn((r, c), dt)
        f = (lambda x: torch.softmax(x, -1)) if kind == "softmax" else (lambda x: torch.log_softmax(x, -1))
        return f, (x,), fwd(f, (x,)), 2 * nbytes(x)
    if kind == "layer_norm":
        r, c = shape
        x, w, b = randn((r, c), dt), randn((c,), dt), randn((c,), dt)
        def f(x, w, b):
            return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
        return f, (x, w, b), fwd(f, (x, w, b)), 2 * nbytes(x) + nbytes(w, b)
    if kind == "layer_norm_bwd":
        r, c = shape
        x, w, b, dy = randn((r, c), dt), randn((c,), dt), randn((c,), dt), randn((r, c), dt)
        for t in (x, w, b):
            t.requires_grad_(True)
        def f(x, w, b):
            return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
        inp = (x, w, b, dy)
        return f, inp, with_grad(inp, (0, 1, 2)), 3 * nbytes(x) + 4 * nbytes(w)
    if kind == "rms_norm":
        r, c = shape
        x, w = randn((r, c), dt), randn((c,), dt)
        def f(x, w):
            return F.rms_norm(x, (x.shape[-1],), w, 1e-6)
        return f, (x, w), fwd(f, (x, w)), 2 * nbytes(x) + nbytes(w)
    if kind == "rms_norm_bwd":
        r, c = shape
        x, w, dy = randn((r, c), dt), randn((c,), dt), randn((r, c), dt)
        for t in (x, w):
            t.requires_grad_(True)
        def f(x, w):
            return F.rms_norm(x, (x.shape[-1],), w, 1e-6)
        inp = (x, w, dy)
        return f, inp, with_grad(inp, (0, 1)), 3 * nbytes(x) + 2 * nbytes(w)
    if kind == "cross_entropy":
        r, c = shape
        logits = randn((r, c), dt).requires_grad_(True)
        g = torch.Generator(device="cuda")
        g.manual_seed(SEED[0])
        SEED[0] += 1
        t = torch.randint(0, c, (r,), generator=g, device="cuda", dtype=torch.int64)
        def f(logits, t):
            return F.cross_entropy(logits, t)
        def run(fn):
            def step():
                loss = fn(logits, t)
                (dl,) = torch.autograd.grad(loss, (logits,))
                return loss.detach(), dl
            return step
        return f, (logits, t), run, 2 * nbytes(logits) + nbytes(t) + logits.element_size()
    if kind == "colsum":
        r, c = shape
        x = randn((r, c), dt)
        def f(x):
            return x.sum(0)
        return f, (x,), fwd(f, (x,)), nbytes(x) + c * x.element_size()
    if kind == "softmax3d":
        x = randn(tuple(shape), dt)
        dim = case.kw["dim"]
        def f(x):
            return torch.softmax(x, dim)
        return f, (x,), fwd(f, (x,)), 2 * nbytes(x)
    # pointwise over views, as sweep.cpp's pointwise_cases
    n = shape[0]
    es = ESIZE[dt]
    if kind in ("add_bcast_row", "add_bcast_col"):
        x, y = randn((n, n), dt), randn((n,) if kind == "add_bcast_row" else (n, 1), dt)
        f = lambda x, y: x + y  # noqa: E731
        return f, (x, y), fwd(f, (x, y)), 2 * n * n * es + n * es
    if kind == "add_contig":
        x = randn((n, n), dt)
        f = lambda x, y: x + y  # noqa: E731
    elif kind == "add_transposed":
        x = randn((n, n), dt)
        f = lambda x, y: x.t() + y  # noqa: E731
    elif kind == "add_strided":
        x = randn((n, 2 * n), dt)
        f = lambda x, y: x[:, ::2] + y  # noqa: E731
    elif kind == "add_offset":  # a view starting one element in: no aligned vector loads
        x = randn((n * n + 1,), dt)
        f = lambda x, y: x[1:].view(n, n) + y  # noqa: E731
    else:
        raise ValueError(kind)
    y = randn((n, n), dt)
    return f, (x, y), fwd(f, (x, y)), 3 * n * n * es


# --------------------------------------------------------------------------------------------
# timing: the sampling of kiln's benchmarks/timing.hpp


_FLUSH = None


def time_ms(fn, reps):
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(64 << 20, dtype=torch.float32, device="cuda")  # 256 MiB
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    t = []
    for _ in range(reps):
        _FLUSH.zero_()
        a.record()
        fn()
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b))
    t.sort()
    return t[len(t) // 2]


def as_tuple(r):
    return tuple(r) if isinstance(r, (tuple, list)) else (r,)


def check(got, want, dt):
    tol = 3e-2 if dt == "bf16" else 1e-3
    for i, (g, w) in enumerate(zip(as_tuple(got), as_tuple(want))):
        g, w = g.detach().double(), w.detach().double()
        atol = tol * max(w.abs().max().item(), 1e-30)
        if not torch.allclose(g, w, rtol=tol, atol=atol):
            err = (g - w).abs().max().item()
            raise RuntimeError(f"output {i}: compiled differs from eager by {err:.3g} (atol {atol:.3g})")


def run_case(case, copy_gbps):
    torch._dynamo.reset()
    f, inp, run, nbytes_ = build(case)
    want = run(f)()
    for mode in ARGS.modes.split(","):
        impl = "torch.compile" if mode == "default" else "torch.compile-dynamic"
        try:
            torch._dynamo.reset()
            t0 = time.perf_counter()
            fn = torch.compile(f) if mode == "default" else torch.compile(f, dynamic=True)
            step = run(fn)
            got = step()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            check(got, want, case.dtype)
            ms = time_ms(step, ARGS.reps)
            gbps = nbytes_ / ms / 1e6
            emit({"id": case.id, "impl": impl, "ms": round(ms, 5), "gbps": round(gbps, 1),
                  "bytes": nbytes_, "pct_copy": round(100 * gbps / copy_gbps, 1) if copy_gbps else None,
                  "family": case.family, "op": case.op, "shape": dims(case.shape), "dtype": case.dtype,
                  "note": f"first call {first:.1f} s"})
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"
            log(f"[{case.id} {impl}] FAILED: {msg}")
            log(traceback.format_exc())
            emit({"id": case.id, "impl": impl, "error": msg[:500]})
    del f, inp, run, want


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated families: " + ",".join(FAMILIES))
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--cols", default="", help="the row families' lengths, any (default: the list)")
    p.add_argument("--mib", type=float, default=256, help="input size of a case (default 256 MiB)")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--modes", default="default,dynamic", help="default,dynamic (torch.compile modes)")
    p.add_argument("--cache-dir", default="", help="shared TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR root")
    p.add_argument("--list", action="store_true", help="print the cases (as sweep --list) and exit")
    p.add_argument("--shard", default="", help="I/N: only every N-th case from the I-th (0-based), so that N "
                   "processes can fill the compile cache at once (benchmarks/sweep.sh's warm-up)")
    a = p.parse_args(argv)
    bad = [f for f in a.only.split(",") if f.strip() and f.strip() not in FAMILIES]
    if bad:
        p.error(f"unknown famil{'y' if len(bad) == 1 else 'ies'} {bad}; known: {','.join(FAMILIES)}")
    if a.shard:
        try:
            i, n = (int(v) for v in a.shard.split("/"))
            assert 0 <= i < n
        except (ValueError, AssertionError):
            p.error("--shard takes I/N with 0 <= I < N")
        a.shard = (i, n)
    if a.reps < 1:
        p.error("--reps must be >= 1")
    if any(m not in ("default", "dynamic") for m in a.modes.split(",")):
        p.error("--modes takes default and/or dynamic")
    return a


def main(argv=None):
    global ARGS, torch, F
    ARGS = parse_args(argv)
    todo = cases()
    if ARGS.shard:
        todo = todo[ARGS.shard[0]::ARGS.shard[1]]
    if ARGS.list:
        for c in todo:
            print(c.family, c.id)
        return 0

    tmp = None
    if ARGS.cache_dir:
        os.makedirs(ARGS.cache_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(ARGS.cache_dir, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(ARGS.cache_dir, "triton")
    elif "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        tmp = tempfile.mkdtemp(prefix="kiln_sweep_peer_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")

    import torch as _torch
    import torch.nn.functional as _F
    torch, F = _torch, _F
    import torch._dynamo  # noqa: F401
    # One fresh compile per case and mode; a generous limit so that nothing falls back to eager.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    if not torch.cuda.is_available():
        emit({"id": "env", "impl": "torch.compile", "error": "no CUDA device"})
        log("sweep_peer: no GPU here; nothing to time")
        return 0
    try:
        import triton
        triton_version = triton.__version__
    except Exception as e:  # noqa: BLE001
        triton_version = f"unavailable ({e})"
    emit({"id": "env", "impl": "torch.compile", "device": torch.cuda.get_device_name(0),
          "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
          "mib": ARGS.mib, "reps": ARGS.reps, "cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
          "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), ARGS.reps)
    copy_gbps = 2 * nbytes(src) / ms / 1e6
    emit({"id": "copy", "impl": "torch.compile", "gbps": round(copy_gbps, 1)})
    del src, dst

    t_start = time.perf_counter()
    for c in todo:
        t0 = time.perf_counter()
        try:
            run_case(c, copy_gbps)
        except Exception as e:  # noqa: BLE001
            log(f"[{c.id}] FAILED: {type(e).__name__}: {e}")
            log(traceback.format_exc())
            emit({"id": c.id, "impl": "torch.compile", "error": f"{type(e).__name__}: {e}"[:500]})
        finally:
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        log(f"[{c.id}] {time.perf_counter() - t0:.1f} s")
    log(f"total {time.perf_counter() - t_start:.1f} s")
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
