#!/usr/bin/env python3
"""PyTorch side of kiln's CPU benchmark (benchmarks/cpu_bench.cpp; BENCHMARKS.md row "cpu").

The same workloads at the same CPU sizes, f32, on torch's CPU backend: eager and torch.compile
(Inductor's C++/OpenMP code). Prints one JSON object a line in cpu_bench's format, so that
benchmarks/cpu.sh can divide:

  {"id": "cpu-W1", "impl": "eager"|"torch.compile", "ms": ..., "note": ...}
  {"id": "cpu-W2", "impl": "blas", ...}          the GEMM alone (torch.mm: torch's BLAS)
  {"id": "cpu-W11", "impl": "torch.compile", "ms": ...}   first call of W1's function, empty caches
  {"id": ..., "impl": ..., "error": "..."}       a failed workload (the others still run)

Timing as cpu_bench's: wall clock, two warm-up calls (the first compiles), the median of --reps
calls. Each compiled result is checked against eager first. Threads: torch.set_num_threads(--threads)
(default: OMP_NUM_THREADS, else every core), so a run matches cpu_bench's under the same setting.

Usage: python3 benchmarks/cpu_peer.py [--reps 10] [--only cpu-W1,cpu-W3] [--threads N]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

# A fresh Inductor cache, so that cpu-W11 compiles (set before torch is imported).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="kiln-cpu-peer-"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

IDS = ["cpu-W11", "cpu-W1", "cpu-W1b", "cpu-W1d", "cpu-W3", "cpu-W4", "cpu-W2", "cpu-W1c", "cpu-W5", "cpu-W6",
       "cpu-W7", "cpu-W8", "cpu-W12"]


def emit(obj):
    print(json.dumps(obj), flush=True)


def time_ms(fn, reps):
    fn()
    fn()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(t)


def randn(*shape, seed, scale=1.0, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) * scale
    return t.requires_grad_(grad)


def check(wid, got, want, tol):
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    for a, b in zip(got, want):
        if not torch.allclose(a.detach(), b.detach(), rtol=tol, atol=tol):
            raise AssertionError(f"{wid}: torch.compile differs from eager by "
                                 f"{(a.detach() - b.detach()).abs().max().item():.3g}")


def workloads():
    """id -> (description, make() -> step function of a compiled-or-eager fn, the fn, bytes or flops)."""
    n, m = 1 << 24, (4096, 1024)

    def unary(f, *make_inputs):
        return f, lambda fn: (lambda: fn(*make_inputs))

    x = randn(n, seed=1)
    mat = randn(*m, seed=2)
    w, b = randn(1024, seed=3), randn(1024, seed=4)
    out = {}
    out["cpu-W1"] = ("relu(x*2+1) 2^24 f32", *unary(lambda a: torch.relu(a * 2 + 1), x), 8.0 * n)
    out["cpu-W1b"] = ("sigmoid(tanh(x*.5+.1)*x)*exp(-x*x) 2^24 f32",
                      *unary(lambda a: torch.sigmoid(torch.tanh(a * 0.5 + 0.1) * a) * torch.exp(-a * a), x),
                      8.0 * n)
    out["cpu-W1d"] = ("sin(x)*cos(x*.5) 2^24 f32", *unary(lambda a: torch.sin(a) * torch.cos(a * 0.5), x), 8.0 * n)
    out["cpu-W3"] = ("softmax 4096x1024 f32", *unary(lambda a: torch.softmax(a, -1), mat), 8.0 * mat.numel())
    out["cpu-W4"] = ("layer_norm 4096x1024 f32",
                     *unary(lambda a, w_, b_: F.layer_norm(a, (1024,), w_, b_, 1e-5), mat, w, b), 8.0 * mat.numel())
    a2, b2, bias2 = randn(1024, 1024, seed=5), randn(1024, 1024, seed=6), randn(1024, seed=7)
    out["cpu-W2"] = ("gelu(a@b+bias) 1024^3 f32",
                     *unary(lambda a, b_, c: F.gelu(a @ b_ + c), a2, b2, bias2), 2.0 * 1024 ** 3)
    out["cpu-W1c"] = ("gelu(x+b) 4096x1024 f32", *unary(lambda a, c: F.gelu(a + c), mat, randn(1024, seed=8)),
                      8.0 * mat.numel() + 4 * 1024)

    # Gradient workloads through autograd (y or the loss, and the gradients), as torch_peer.py's.
    xg, wg, bg = mat.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    dy = randn(*m, seed=10)

    def ln(a, w_, b_):
        return F.layer_norm(a, (1024,), w_, b_, 1e-5)

    def w5_step(fn):
        def step():
            y = fn(xg, wg, bg)
            return (y.detach(),) + torch.autograd.grad(y, (xg, wg, bg), dy)
        return step
    out["cpu-W5"] = ("layer_norm fwd+bwd 4096x1024 f32", ln, w5_step, 4.0 * (4.0 * mat.numel() + 4 * 1024))

    def rms(a, w_):
        return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * w_
    out["cpu-W6"] = ("rms_norm 4096x1024 f32", *unary(rms, mat, randn(1024, seed=5)), 8.0 * mat.numel() + 4 * 1024)

    logits = randn(1024, 32000, seed=11, grad=True)
    targets = torch.randint(0, 32000, (1024,), generator=torch.Generator().manual_seed(12))

    def w7_step(fn):
        def step():
            loss = fn(logits, targets)
            return (loss.detach(),) + torch.autograd.grad(loss, (logits,))
        return step
    out["cpu-W7"] = ("cross_entropy fwd+bwd 1024x32000 f32", lambda lg, t: F.cross_entropy(lg, t), w7_step,
                     8.0 * logits.numel())

    lr, b1_, b2_, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    an = 1 << 22
    state = [randn(an, seed=13), randn(an, seed=14), randn(an, seed=15),
             torch.rand(an, generator=torch.Generator().manual_seed(16)), torch.zeros(())]

    def adamw(p, g, m_, v, step):  # torch.optim.AdamW's single-tensor update with a tensor step
        step.add_(1)
        p.mul_(1 - lr * wd)
        m_.lerp_(g, 1 - b1_)
        v.mul_(b2_).addcmul_(g, g, value=1 - b2_)
        bc1 = 1 - torch.pow(b1_, step)
        bc2 = 1 - torch.pow(b2_, step)
        p.add_(m_ / ((v.sqrt() / bc2.sqrt()).add_(eps)) * (-lr / bc1))

    def w8_step(fn):
        s = [t.clone() for t in state]  # each of eager and compiled from the same state

        def step():
            fn(*s)
            return (s[0], s[2], s[3])
        return step
    out["cpu-W8"] = ("AdamW step 2^22 f32, in place", adamw, w8_step, 4.0 * 7 * an)

    M, D, H = 512, 1024, 4096
    blk = [randn(M, D, seed=17, grad=True), randn(H, D, seed=18, scale=D ** -0.5, grad=True),
           randn(H, seed=19, scale=0.1, grad=True), randn(D, H, seed=20, scale=H ** -0.5, grad=True),
           randn(D, seed=21, scale=0.1, grad=True), randn(D, seed=22, grad=True), randn(D, seed=23, grad=True)]
    dblk = randn(M, D, seed=24)

    def block(x_, w1, bb1, w2, bb2, g, be):
        return F.layer_norm(x_ + F.linear(F.gelu(F.linear(x_, w1, bb1)), w2, bb2), (D,), g, be, 1e-5)

    def w12_step(fn):
        def step():
            return torch.autograd.grad(fn(*blk), blk, dblk)
        return step
    out["cpu-W12"] = ("MLP block fwd+bwd 512x1024->4096->1024 f32", block, w12_step, 3 * 2 * 2.0 * M * D * H)
    return out


FLOPS = {"cpu-W2", "cpu-W12"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--only", default="")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0))
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    only = [s for s in a.only.split(",") if s] or IDS
    emit({"id": "env", "torch": torch.__version__, "threads": torch.get_num_threads(),
          "mkl": torch.backends.mkl.is_available()})
    if "cpu-W11" in only:  # first call: trace, Inductor's C++ codegen, the host compile, the run
        try:
            f = torch.compile(lambda t: torch.relu(t * 2 + 1))
            small = torch.randn(1024)
            t0 = time.perf_counter()
            f(small)
            emit({"id": "cpu-W11", "impl": "torch.compile", "ms": (time.perf_counter() - t0) * 1e3,
                  "note": "first call of relu(x*2+1), empty Inductor cache"})
        except Exception as e:  # noqa: BLE001
            emit({"id": "cpu-W11", "impl": "torch.compile", "error": f"{type(e).__name__}: {e}"[:500]})
    for wid, (what, fn, make_step, amount) in workloads().items():
        if wid not in only:
            continue
        rate = "gflops" if wid in FLOPS else "gbps"
        for impl in ("eager", "torch.compile"):
            try:
                run = fn if impl == "eager" else torch.compile(fn)
                step = make_step(run)
                if impl == "torch.compile":
                    check(wid, step(), make_step(fn)(), 2e-3)
                ms = time_ms(step, a.reps)
                emit({"id": wid, "impl": impl, "ms": ms, rate: amount / ms / 1e6, "note": what})
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(file=sys.stderr)
                emit({"id": wid, "impl": impl, "error": f"{type(e).__name__}: {e}"[:500]})
        if wid == "cpu-W2":
            a2, b2 = torch.randn(1024, 1024), torch.randn(1024, 1024)
            ms = time_ms(lambda: torch.mm(a2, b2), a.reps)
            emit({"id": wid, "impl": "blas", "ms": ms, "gflops": amount / ms / 1e6, "note": "the GEMM alone (torch.mm)"})


if __name__ == "__main__":
    main()
