#!/usr/bin/env python3
"""PyTorch side of the kiln benchmark suite (workloads W1-W12 of BENCHMARKS.md).

Prints one JSON object per line on stdout (diagnostics go to stderr):

  {"id": "env", "torch": ..., "triton": ..., "device": ..., ...}
  {"id": "copy", "gbps": ..., "ms": ...}          1 GiB device-to-device copy_, GB/s = 2*bytes/time
  {"id": "W1", "impl": "eager"|"torch.compile"|"torch.compile-max", "ms": ..., "gbps": ..., "note": ...}
  {"id": "W5", "impl": "torch.compile-joint", ...}  W5, W7, W12: forward and backward as one graph
  {"id": "W9", "impl": "eager"|"torch.compile"|"torch.compile-ro", "us": ..., "ms": us/1000}
  {"id": "W10", "impl": "eager"|"torch.compile"(static)|"torch.compile-dynamic", "ms": total, "s": total}
  {"id": "W11", "impl": "torch.compile", "ms": ...}   cold compile+first run of W1's function, empty caches
  {"id": "W11w", "impl": "torch.compile", "ms": ...}  process start -> first result, warm disk cache
  {"id": ..., "impl": ..., "error": "..."}            a failed workload (the others still run)

"ms" is always milliseconds of one call (W9: host time per call, W10: total wall time of the sweep),
so kiln's binary can print the same ids with impl "kiln" and report.py can divide.

The gradient workloads (W5, W7, W12) run twice under torch.compile: through autograd, the way a
training loop calls a compiled module (Inductor compiles a forward graph and a backward graph), and
as "torch.compile-joint": torch.compile(fullgraph=True) over a function that takes the gradients
with torch.func, so that forward and backward are one graph, as kiln compiles them.

By default the whole process uses a fresh, empty Inductor/Triton cache (so the compile times in the
notes are cold); pass --warm-cache to use the usual on-disk caches instead. W10 and W11 run in
--procs fresh processes each, every one on empty caches, as benchmarks/run.sh runs kiln's (report.py
keeps the median).

Usage:
  PYTHONUNBUFFERED=1 python3 benchmarks/torch_peer.py > torch.jsonl
  python3 benchmarks/torch_peer.py --only W1,W3 --reps 200
  python3 benchmarks/torch_peer.py --quick
"""

import argparse
import inspect
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ALL_IDS = ["W1", "W1b", "W1c", "W2", "W3", "W3b", "W4", "W5", "W6", "W7", "W8", "W9", "W10",
           "W11", "W12"]

# Filled in by main() after the (lazy) import of torch.
torch = None
F = None
ARGS = None


def emit(obj):
    print(json.dumps(obj), flush=True)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def emit_error(wid, impl, exc):
    msg = f"{type(exc).__name__}: {exc}"
    log(f"[{wid} {impl}] FAILED: {msg}")
    log(traceback.format_exc())
    emit({"id": wid, "impl": impl, "error": msg[:500]})


# --------------------------------------------------------------------------------------------
# arguments


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="",
                   help="comma-separated workload ids to run (e.g. W1,W3); default all")
    p.add_argument("--reps", type=int, default=None,
                   help="minimum timed repetitions per measurement (default 100, 20 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="fewer repetitions and shorter warm-up (smoke test, not for reporting)")
    p.add_argument("--warm-cache", action="store_true",
                   help="use the default on-disk Inductor/Triton caches instead of fresh empty ones")
    p.add_argument("--skip-compile", action="store_true", help="only eager (debugging)")
    p.add_argument("--max-autotune", action="store_true",
                   help="also torch.compile(mode='max-autotune-no-cudagraphs') as torch.compile-max")
    p.add_argument("--max-only", action="store_true",
                   help="only torch.compile-max, for the workloads that have one (implies --max-autotune)")
    p.add_argument("--procs", type=int, default=None,
                   help="fresh processes for W10 and for W11 each (default 3, 1 with --quick)")
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # a W10 child
    p.add_argument("--list", action="store_true", help="print the workload ids and exit")
    a = p.parse_args(argv)
    if a.only:
        want = [s.strip() for s in a.only.split(",") if s.strip()]
        lower = {w.lower(): w for w in ALL_IDS}
        bad = [w for w in want if w.lower() not in lower]
        if bad:
            p.error(f"unknown workload id(s) {bad}; known: {','.join(ALL_IDS)}")
        a.ids = [lower[w.lower()] for w in want]
    else:
        a.ids = list(ALL_IDS)
    if a.reps is None:
        a.reps = 20 if a.quick else 100
    if a.reps < 1:
        p.error("--reps must be >= 1")
    if a.procs is None:
        a.procs = 1 if a.quick else 3
    if a.procs < 1:
        p.error("--procs must be >= 1")
    a.warmup_ms = 5 if a.quick else 25      # do_bench warm-up time (ms)
    a.rep_ms = 20 if a.quick else 100       # do_bench minimum measuring time (ms)
    a.w9_calls = 1000 if a.quick else 5000  # back-to-back calls per W9 sample (as kiln's bench.cpp)
    a.w9_samples = 3 if a.quick else 5      # the median is reported
    return a


# --------------------------------------------------------------------------------------------
# timing


_DO_BENCH = None


def do_bench_median(fn, warmup_ms, rep_ms):
    global _DO_BENCH
    if _DO_BENCH is None:
        from triton.testing import do_bench
        params = inspect.signature(do_bench).parameters
        _DO_BENCH = (do_bench, "return_mode" in params)
    do_bench, has_mode = _DO_BENCH
    if has_mode:
        r = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    else:
        r = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5])
    if isinstance(r, (list, tuple)):
        r = r[0]
    return float(r)


def estimate_ms(fn, n=3):
    """Rough per-call device time (ms) so that do_bench gets >= --reps repetitions."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True)
    e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def bench(fn):
    """Median ms of fn over at least ARGS.reps repetitions (do_bench flushes L2 between them)."""
    est = estimate_ms(fn)
    # do_bench sizes its loop from an estimate that includes its 256 MB L2 flush (~0.1 ms).
    rep_ms = max(ARGS.rep_ms, (est + 0.15) * ARGS.reps * 1.25)
    warm_ms = min(ARGS.warmup_ms, max(1.0, est * 5))  # modest: the estimate already warmed up
    return do_bench_median(fn, warm_ms, rep_ms)


def sync():
    torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------
# workloads: each builder returns a dict
#   f      : the function that gets torch.compile'd
#   make   : make() -> inputs (fresh, seeded, on cuda); call(f, inputs) -> zero-arg callable
#   call   : call(fn, inputs) -> zero-arg callable running one step, returning tensors to check
#   bytes  : bytes that must move (each input read once, each output written once)
#   flops  : optional, for a TFLOP/s note
#   tol    : (atol, rtol) for the eager vs compiled check
#   joint  : optional (W5, W7, W12), [(how, fn)]: functions of the same inputs returning what
#            call's step returns, their gradients taken with torch.func, so that compiled whole,
#            forward and backward are one graph (the torch.compile-joint peer); the first that
#            compiles is timed, the others are fallbacks


def gen(seed=0):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g


def randn(shape, dtype=None, g=None, scale=1.0, grad=False):
    dtype = dtype or torch.float32
    t = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32)
    if scale != 1.0:
        t = t * scale
    t = t.to(dtype)
    if grad:
        t.requires_grad_(True)
    return t


def nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts)


def plain(f, make, bytes_fn, flops=None, tol=(1e-4, 1e-4)):
    """A forward-only workload: call = f(*inputs)."""
    def call(fn, inp):
        return lambda: fn(*inp)
    return dict(f=f, make=make, call=call, bytes_fn=bytes_fn, flops=flops, tol=tol)


def w1():
    def f(x):
        return torch.relu(x * 2 + 1)
    def make():
        g = gen(1)
        return (randn((1 << 26,), g=g),)
    return plain(f, make, lambda inp: 2 * nbytes(inp[0]))


def w1b():
    def f(x):
        return torch.sigmoid(torch.tanh(x * 0.5 + 0.1) * x) * torch.exp(-x * x)
    def make():
        g = gen(2)
        return (randn((1 << 26,), g=g),)
    return plain(f, make, lambda inp: 2 * nbytes(inp[0]), tol=(1e-5, 1e-4))


def w1c():
    def f(x, b):
        return F.gelu(x + b)  # exact (erf) gelu
    def make():
        g = gen(3)
        return (randn((16384, 4096), torch.bfloat16, g), randn((4096,), torch.bfloat16, g))
    return plain(f, make, lambda inp: 2 * nbytes(inp[0]) + nbytes(inp[1]), tol=(2e-2, 2e-2))


def w2():
    def f(x, w, b):
        return F.gelu(x @ w + b)
    def make():
        g = gen(4)
        return (randn((4096, 4096), torch.bfloat16, g),
                randn((4096, 4096), torch.bfloat16, g, scale=1 / 64),
                randn((4096,), torch.bfloat16, g))
    return plain(f, make, lambda inp: nbytes(*inp) + nbytes(inp[0]),
                 flops=2 * 4096 ** 3, tol=(5e-2, 5e-2))


def w3(rows=16384, cols=4096, seed=5):
    def f(x):
        return torch.softmax(x, -1)
    def make():
        return (randn((rows, cols), g=gen(seed)),)
    return plain(f, make, lambda inp: 2 * nbytes(inp[0]), tol=(1e-6, 1e-4))


def w3b():
    return w3(4096, 32768, 6)


def w4():
    def f(x, w, b):
        return F.layer_norm(x, (4096,), w, b, 1e-5)
    def make():
        g = gen(7)
        return (randn((16384, 4096), g=g), randn((4096,), g=g), randn((4096,), g=g))
    return plain(f, make, lambda inp: 2 * nbytes(inp[0]) + nbytes(inp[1], inp[2]),
                 tol=(1e-4, 1e-4))


def grad_workload(f, make, n_fwd_inputs, wrt_idx, bytes_fn, flops=None, tol=(1e-3, 1e-3),
                  value=False):
    """Forward f(*inputs[:n_fwd_inputs]) then autograd.grad w.r.t. inputs[wrt_idx] with
    grad_outputs = inputs[-1] (a random dy). No .grad accumulation. value=True returns the forward's
    output before the gradients (the forward writes it in any case).

    The joint peer computes the same with torch.func.vjp: y, pullback = vjp(f, *forward inputs),
    pullback(dy) gives every input's gradient (wrt_idx must name them all). Its fallback takes them
    with torch.func.grad_and_value of sum(y * dy), y as the auxiliary output (one more reduction)."""
    def call(fn, inp):
        fwd = inp[:n_fwd_inputs]
        wrt = tuple(inp[i] for i in wrt_idx)
        dy = inp[-1]
        def step():
            out = fn(*fwd)
            grads = torch.autograd.grad(out, wrt, dy)
            return (out.detach(),) + tuple(grads) if value else grads
        return step

    assert tuple(wrt_idx) == tuple(range(n_fwd_inputs))

    def by_vjp(*inp):
        y, pullback = torch.func.vjp(f, *inp[:n_fwd_inputs])
        grads = tuple(pullback(inp[-1]))
        return (y,) + grads if value else grads

    def by_grad(*inp):
        def dot(*fwd):
            y = f(*fwd)
            return (y * inp[-1]).sum(), y
        argnums = tuple(range(n_fwd_inputs))
        grads, (_, y) = torch.func.grad_and_value(dot, argnums=argnums, has_aux=True)(*inp[:n_fwd_inputs])
        return (y,) + tuple(grads) if value else tuple(grads)
    joint = [("torch.func.vjp", by_vjp), ("torch.func.grad_and_value of sum(y * dy)", by_grad)]
    return dict(f=f, make=make, call=call, bytes_fn=bytes_fn, flops=flops, tol=tol, joint=joint)


def w5():
    def f(x, w, b):
        return F.layer_norm(x, (4096,), w, b, 1e-5)
    def make():
        g = gen(8)
        return (randn((16384, 4096), g=g, grad=True), randn((4096,), g=g, grad=True),
                randn((4096,), g=g, grad=True), randn((16384, 4096), g=g))
    # y, dx, dw, db returned, as kiln's side returns them: read x, w, b, dy; write y, dx, dw, db
    return grad_workload(f, make, 3, (0, 1, 2),
                         lambda inp: 3 * nbytes(inp[0]) + nbytes(inp[3]) + 2 * nbytes(inp[1], inp[2]),
                         tol=(1e-2, 1e-3), value=True)


def w6():
    # bf16 rows, f32 compute and an f32 weight, as kiln's side (bench.cpp's W6) takes it
    def f(x, w):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y * w).to(torch.bfloat16)
    def make():
        g = gen(9)
        return (randn((16384, 4096), torch.bfloat16, g), randn((4096,), g=g))
    return plain(f, make, lambda inp: 2 * nbytes(inp[0]) + nbytes(inp[1]), tol=(2e-2, 2e-2))


def w7():
    def f(logits, t):
        return F.cross_entropy(logits, t)
    def make():
        g = gen(10)
        logits = randn((4096, 32000), g=g, grad=True)
        t = torch.randint(0, 32000, (4096,), generator=g, device="cuda", dtype=torch.int64)
        return (logits, t, None)
    def call(fn, inp):
        logits, t, _ = inp
        def step():
            loss = fn(logits, t)
            (dl,) = torch.autograd.grad(loss, (logits,))
            return loss.detach(), dl
        return step

    def joint(logits, t, _):
        dl, loss = torch.func.grad_and_value(f)(logits, t)
        return loss, dl
    # read logits + targets; write dlogits + the scalar loss
    return dict(f=f, make=make, call=call,
                bytes_fn=lambda inp: 2 * nbytes(inp[0]) + nbytes(inp[1]) + 4,
                flops=None, tol=(1e-6, 1e-3), joint=[("torch.func.grad_and_value", joint)])


def w8():
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01

    def f(p, g, m, v, step):
        # functional form of torch.optim.AdamW (single tensor, tensor step as in capturable mode):
        # the step count lives on the device and each call computes the bias corrections from it,
        # as kiln's side (bench.cpp's W8) does
        step.add_(1)
        p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1 = 1 - torch.pow(b1, step)
        bc2 = 1 - torch.pow(b2, step)
        denom = (v.sqrt() / bc2.sqrt()).add_(eps)
        p.add_(m / denom * (-lr / bc1))

    def make():
        gg = gen(11)
        n = 1 << 24
        p = randn((n,), g=gg)
        grad = randn((n,), g=gg)
        m = randn((n,), g=gg, scale=0.1)
        v = torch.rand((n,), generator=gg, device="cuda") * 0.01 + 1e-4
        step = torch.zeros((), device="cuda")  # kiln's side starts from 0 too
        return (p, grad, m, v, step)

    def call(fn, inp):
        def step():
            fn(*inp)
            return inp[0], inp[2], inp[3]
        return step
    # read p, g, m, v; write p, m, v
    return dict(f=f, make=make, call=call, bytes_fn=lambda inp: 7 * nbytes(inp[0]), flops=None,
                tol=(1e-5, 1e-4))


def w12():
    M, D, H = 8192, 1024, 4096

    def f(x, w1, b1, w2, b2, lw, lb):
        h = F.gelu(F.linear(x, w1, b1))
        return F.layer_norm(x + F.linear(h, w2, b2), (D,), lw, lb, 1e-5)

    def make():
        g = gen(12)
        bf = torch.bfloat16
        return (randn((M, D), bf, g, grad=True),
                randn((H, D), bf, g, scale=D ** -0.5, grad=True), randn((H,), bf, g, scale=0.1, grad=True),
                randn((D, H), bf, g, scale=H ** -0.5, grad=True), randn((D,), bf, g, scale=0.1, grad=True),
                randn((D,), bf, g, grad=True), randn((D,), bf, g, grad=True),
                randn((M, D), bf, g))
    # read inputs + dy, write a gradient for each of the 7 inputs
    return grad_workload(f, make, 7, tuple(range(7)),
                         lambda inp: 2 * nbytes(*inp[:7]) + nbytes(inp[7]),
                         flops=3 * 2 * (2 * M * D * H), tol=(1e-1, 5e-2))


BUILDERS = {"W1": w1, "W1b": w1b, "W1c": w1c, "W2": w2, "W3": w3, "W3b": w3b, "W4": w4,
            "W5": w5, "W6": w6, "W7": w7, "W8": w8, "W12": w12}


def compare(ref, got, atol, rtol):
    """(max |ref - got|, all within atol + rtol * max|ref| per tensor, all finite)."""
    if isinstance(ref, torch.Tensor):
        ref, got = (ref,), (got,)
    worst, ok, finite = 0.0, True, True
    for r, g in zip(ref, got):
        r = r.detach().float()
        g = g.detach().float()
        d = float((r - g).abs().max())
        worst = max(worst, d)
        if d > atol + rtol * float(r.abs().max()):
            ok = False
        if not bool(torch.isfinite(g).all()):
            finite = False
    return worst, ok, finite


def run_workload(wid):
    spec = BUILDERS[wid]()
    f, make, call = spec["f"], spec["make"], spec["call"]
    inp = make()
    nb = spec["bytes_fn"](inp)

    def record(impl, ms, note):
        rec = {"id": wid, "impl": impl, "ms": round(ms, 5), "gbps": round(nb / (ms * 1e-3) / 1e9, 1),
               "bytes": nb}
        if spec["flops"]:
            rec["tflops"] = round(spec["flops"] / (ms * 1e-3) / 1e12, 1)
        if note:
            rec["note"] = note
        emit(rec)

    # eager
    try:
        if not ARGS.max_only:
            ms = bench(call(f, inp))
            record("eager", ms, "")
    except Exception as e:  # noqa: BLE001
        emit_error(wid, "eager", e)

    if ARGS.skip_compile:
        return
    # torch.compile, default mode (and max-autotune, the mode kiln's .autotune answers). Reset
    # dynamo first so each workload is one fresh static compile (several workloads share code
    # objects; without a reset the second shape would go dynamic).
    modes = [] if ARGS.max_only else [("torch.compile", "default")]
    if ARGS.max_autotune or ARGS.max_only:
        modes.append(("torch.compile-max", "max-autotune-no-cudagraphs"))
    for impl, mode in modes:
        try:
            torch._dynamo.reset()
            cf = torch.compile(f, mode=mode)
            notes = []
            # first call = compile; done on separate fresh inputs so the result can be checked
            # against eager (W8 mutates its inputs in place)
            chk_in = make()
            sync()
            t0 = time.perf_counter()
            got = call(cf, chk_in)()
            sync()
            compile_s = time.perf_counter() - t0
            notes.append(f"first call (compile) {compile_s:.1f} s")
            del chk_in
            ref_in = make()
            ref = call(f, ref_in)()
            d, ok, finite = compare(ref, got, *spec["tol"])
            del ref_in, ref, got
            notes.append(f"max|diff| vs eager {d:.2e}" + ("" if ok else " MISMATCH?"))
            if not finite:
                notes.append("NON-FINITE OUTPUT")
            ms = bench(call(cf, inp))
            record(impl, ms, "; ".join(notes))
        except Exception as e:  # noqa: BLE001
            emit_error(wid, impl, e)
    if spec.get("joint") is not None and not ARGS.max_only:
        run_joint(wid, spec, inp, record)


def graphs_compiled(reset=False):
    """The graphs dynamo compiled since the last reset=True ("?" where its counters are missing)."""
    try:
        counters = torch._dynamo.utils.counters
        if reset:
            counters.clear()
        return counters["stats"]["unique_graphs"]
    except Exception:  # noqa: BLE001
        return "?"


def run_joint(wid, spec, inp, record):
    """torch.compile-joint: the workload's outputs from one of spec["joint"]'s functions, which take
    the gradients with torch.func, compiled with fullgraph=True, so that dynamo hands Inductor
    forward and backward as one graph (a graph break raises instead of splitting it). Their inputs
    do not require grad, so AOTAutograd compiles that graph as it is, with no backward graph of its
    own. The first function that compiles and runs is timed; when none does, an error line."""
    impl = "torch.compile-joint"

    def detached(ts):
        return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in ts)

    failed = []
    for how, fn in spec["joint"]:
        try:
            torch._dynamo.reset()
            graphs_compiled(reset=True)
            cf = torch.compile(fn, fullgraph=True)
            # first call = compile, on fresh inputs, checked against the eager autograd path
            chk_in = detached(spec["make"]())
            sync()
            t0 = time.perf_counter()
            got = cf(*chk_in)
            sync()
            compile_s = time.perf_counter() - t0
            del chk_in
        except Exception as e:  # noqa: BLE001
            log(f"[{wid} {impl}] {how} failed: {type(e).__name__}: {e}")
            failed.append(f"{how}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200])
            continue
        try:
            notes = [f"{how}, {graphs_compiled()} graph(s)"]
            if failed:
                notes.append("after " + "; ".join(failed))
            notes.append(f"first call (compile) {compile_s:.1f} s")
            ref_in = spec["make"]()
            ref = spec["call"](spec["f"], ref_in)()
            d, ok, finite = compare(ref, got, *spec["tol"])
            del ref_in, ref, got
            notes.append(f"max|diff| vs eager {d:.2e}" + ("" if ok else " MISMATCH?"))
            if not finite:
                notes.append("NON-FINITE OUTPUT")
            args = detached(inp)
            ms = bench(lambda: cf(*args))
            record(impl, ms, "; ".join(notes))
        except Exception as e:  # noqa: BLE001
            emit_error(wid, impl, e)
        return
    emit({"id": wid, "impl": impl, "error": " / ".join(failed)[:500]})


# --------------------------------------------------------------------------------------------
# W9: host cost per call


def run_w9():
    def f(x):
        return torch.relu(x * 2 + 1)
    x = randn((1024,), g=gen(13))
    n, samples = ARGS.w9_calls, ARGS.w9_samples

    def host_us(fn):
        for _ in range(100):  # warm-up, as kiln's bench.cpp
            fn(x)
        sync()
        res = []
        for _ in range(samples):
            t0 = time.perf_counter()
            for _ in range(n):
                fn(x)
            sync()
            res.append((time.perf_counter() - t0) / n * 1e6)
        return statistics.median(res)

    modes = [("eager", None)]
    if not ARGS.skip_compile:
        modes += [("torch.compile", "default"), ("torch.compile-ro", "reduce-overhead")]
    for impl, mode in modes:
        try:
            if mode is None:
                fn = f
            else:
                torch._dynamo.reset()
                fn = torch.compile(f, mode=mode)
            us = host_us(fn)
            emit({"id": "W9", "impl": impl, "us": round(us, 2), "ms": round(us / 1000, 6),
                  "note": f"host us/call: {n} back-to-back calls on 1024 f32 then one sync, "
                          f"median of {samples}"})
        except Exception as e:  # noqa: BLE001
            emit_error("W9", impl, e)


# --------------------------------------------------------------------------------------------
# W10: layer_norm over a sweep of batch sizes, total wall time including compiles


def run_w10_processes():
    """W10 in ARGS.procs fresh processes, one after the other, each on empty Inductor/Triton caches
    (the child's own fresh cache directory), as benchmarks/run.sh runs kiln's W10; report.py keeps
    the median of each impl. Forwards the children's W10 lines."""
    cmd = [sys.executable, os.path.abspath(__file__), "--only", "W10", "--in-process"]
    if ARGS.quick:
        cmd.append("--quick")
    if ARGS.skip_compile:
        cmd.append("--skip-compile")
    for _ in range(ARGS.procs):
        try:
            r = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True,
                               text=True, timeout=900)
            lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
            w10 = [d for d in lines if d.get("id") == "W10"]
            for d in w10:
                emit(d)
            if not w10:
                raise RuntimeError(f"child rc={r.returncode}: {r.stderr.strip()[-400:]}")
        except Exception as e:  # noqa: BLE001
            emit_error("W10", "all", e)


def run_w10():
    import logging

    def ln(x, w, b):
        return F.layer_norm(x, (4096,), w, b, 1e-5)

    g = gen(14)
    sizes = [1 << k for k in range(4, 14)]
    xs = [randn((bsz, 4096), g=g) for bsz in sizes]
    w = randn((4096,), g=g)
    b = randn((4096,), g=g)

    class Catch(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.msgs = []

        def emit(self, record):
            try:
                m = record.getMessage()
            except Exception:  # noqa: BLE001
                m = str(record.msg)
            if "limit" in m and ("recompile" in m or "cache_size" in m):
                self.msgs.append(m.splitlines()[0])

    # Like kiln's static W10 (bench.cpp: recompile_limit 64), every size may compile: torch's
    # default limit (8) would run the last two of the ten sizes eagerly.
    cfg = torch._dynamo.config
    limit = 64
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, limit)

    modes = [("eager", None)]
    if not ARGS.skip_compile:
        modes += [("torch.compile", False), ("torch.compile-dynamic", True)]
    for impl, dyn in modes:
        catch = Catch()
        dlog = logging.getLogger("torch._dynamo")
        try:
            if dyn is None:
                fn = ln
            else:
                torch._dynamo.reset()
                try:
                    torch._dynamo.utils.counters.clear()
                except Exception:  # noqa: BLE001
                    pass
                fn = torch.compile(ln, dynamic=dyn)
            dlog.addHandler(catch)
            sync()
            t0 = time.perf_counter()
            for x in xs:
                fn(x, w, b)
            sync()
            total = time.perf_counter() - t0
            note = f"{len(sizes)} batch sizes 16..8192 x 4096 f32, one call each, recompile limit {limit}"
            if dyn is not None:
                note += ", dynamic=True" if dyn else ", static (dynamic=False)"
                try:
                    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
                    note += f", {graphs} graphs compiled"
                except Exception:  # noqa: BLE001
                    pass
                if catch.msgs:
                    note += f"; HIT THE RECOMPILE LIMIT ({limit}): remaining sizes ran eager"
                elif dyn is False and limit is not None and len(sizes) > limit:
                    note += f"; {len(sizes)} shapes > recompile limit {limit} (no warning seen)"
            emit({"id": "W10", "impl": impl, "ms": round(total * 1e3, 3), "s": round(total, 5),
                  "note": note})
        except Exception as e:  # noqa: BLE001
            emit_error("W10", impl, e)
        finally:
            dlog.removeHandler(catch)


# --------------------------------------------------------------------------------------------
# W11: cold compile in a fresh process with empty caches, then process start -> first result warm

W11_CHILD = r"""
import json, time, sys
import torch
import triton  # noqa: F401  (import cost is not part of the compile time)
x = torch.randn(1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
torch.cuda.synchronize()
def f(x):
    return torch.relu(x * 2 + 1)
cf = torch.compile(f)
t0 = time.perf_counter()
y = cf(x)
torch.cuda.synchronize()
t1 = time.perf_counter()
ok = bool(torch.allclose(y, torch.relu(x * 2 + 1)))
print("W11RESULT " + json.dumps({"first_call_ms": (t1 - t0) * 1e3, "t_result": time.time(),
                                 "ok": ok}), flush=True)
sys.stderr.flush()
import os
os._exit(0)  # skip interpreter / compile-worker teardown
"""


def run_w11():
    """ARGS.procs rounds, each on a fresh empty cache: a cold process (W11), then a second process
    on the cache the first one filled (W11w), as benchmarks/run.sh runs kiln's W11 and W11w on 1024
    elements; report.py keeps the median."""
    for _ in range(ARGS.procs):
        run_w11_once()


def run_w11_once():
    tmp = tempfile.mkdtemp(prefix="kiln_w11_")
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
    env["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
    env["PYTHONUNBUFFERED"] = "1"

    def child():
        t_spawn = time.time()
        r = subprocess.run([sys.executable, "-c", W11_CHILD], env=env, capture_output=True,
                           text=True, timeout=180)
        for line in r.stdout.splitlines():
            if line.startswith("W11RESULT "):
                d = json.loads(line[len("W11RESULT "):])
                d["start_to_result_ms"] = (d["t_result"] - t_spawn) * 1e3
                return d
        raise RuntimeError(f"child rc={r.returncode}: {r.stderr.strip()[-400:]}")

    try:
        try:
            cold = child()
            emit({"id": "W11", "impl": "torch.compile", "ms": round(cold["first_call_ms"], 1),
                  "note": "cold: first call of torch.compile(W1 fn) in a fresh process with empty "
                          "Inductor+Triton caches (excl. import torch, CUDA init); process start to "
                          f"result {cold['start_to_result_ms']:.0f} ms"
                          + ("" if cold["ok"] else "; WRONG RESULT")})
        except Exception as e:  # noqa: BLE001
            emit_error("W11", "torch.compile", e)
            return
        try:
            warm = child()
            emit({"id": "W11w", "impl": "torch.compile", "ms": round(warm["start_to_result_ms"], 1),
                  "note": "warm disk cache: process start (python, import torch) to first result; "
                          f"first call itself {warm['first_call_ms']:.0f} ms"})
        except Exception as e:  # noqa: BLE001
            emit_error("W11w", "torch.compile", e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------


def run_copy():
    try:
        n = 1 << 28  # 1 GiB of f32
        src = randn((n,), g=gen(0))
        dst = torch.empty_like(src)
        ms = bench(lambda: dst.copy_(src))
        emit({"id": "copy", "ms": round(ms, 5), "gbps": round(2 * nbytes(src) / (ms * 1e-3) / 1e9, 1),
              "bytes": 2 * nbytes(src), "note": "1 GiB device-to-device copy_, 2*bytes/time"})
        del src, dst
    except Exception as e:  # noqa: BLE001
        emit_error("copy", "torch", e)


def main(argv=None):
    global torch, F, ARGS
    ARGS = parse_args(argv)
    if ARGS.list:
        print("\n".join(ALL_IDS))
        return 0

    tmp_cache = None
    if not ARGS.warm_cache:
        # must happen before torch / triton are imported
        tmp_cache = tempfile.mkdtemp(prefix="kiln_torch_peer_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp_cache, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp_cache, "triton")

    t_start = time.perf_counter()
    import torch as _torch
    import torch.func as _func  # noqa: F401  (the joint peers' gradients)
    import torch.nn.functional as _F
    torch, F = _torch, _F
    try:
        import triton
        triton_version = triton.__version__
    except Exception as e:  # noqa: BLE001
        triton_version = f"unavailable ({e})"

    if not torch.cuda.is_available():
        emit({"id": "env", "torch": torch.__version__, "triton": triton_version,
              "device": None, "error": "CUDA not available"})
        return 1
    dev = torch.cuda.get_device_properties(0)
    emit({"id": "env", "torch": torch.__version__, "triton": triton_version,
          "device": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
          "sms": dev.multi_processor_count, "mem_gib": round(dev.total_memory / 2**30, 1),
          "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M:%S"),
          "reps": ARGS.reps, "quick": ARGS.quick, "procs": ARGS.procs,
          "cache": "default" if ARGS.warm_cache else "fresh"})

    if not ARGS.in_process:
        run_copy()
    for wid in ARGS.ids:
        t0 = time.perf_counter()
        try:
            if wid in BUILDERS:
                run_workload(wid)
            elif ARGS.max_only:
                pass
            elif wid == "W9":
                run_w9()
            elif wid == "W10":
                run_w10() if ARGS.in_process else run_w10_processes()
            elif wid == "W11":
                run_w11()
        except Exception as e:  # noqa: BLE001
            emit_error(wid, "all", e)
        finally:
            try:
                torch._dynamo.reset()
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass
        log(f"[{wid}] {time.perf_counter() - t0:.1f} s")
    log(f"total {time.perf_counter() - t_start:.1f} s")
    if tmp_cache:
        shutil.rmtree(tmp_cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
