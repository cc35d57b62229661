#!/usr/bin/env python3
"""W13, torch's side (kiln's is benchmarks/attention.cpp): the same cases, ids and sampling.

impl "sdpa-flash": torch.nn.functional.scaled_dot_product_attention under the flash backend;
impl "sdpa-cudnn": the same under cuDNN's backend; impl "sdpa": the backend torch picks itself (on an
H100/H200 cuDNN's: what torch.compile'd GPT-2 runs, benchmarks/NOTES.md item 141);
impl "flex": torch.compile'd flex_attention without a score_mod (a causal block mask where causal).
With --softcap C every case also runs with the score_mod tanh(score / C) * C (ids ending in
-softcap), by flex_attention only (SDPA has no score_mod).
Forward: the output. Forward + backward: out = attention(q, k, v); (out.float() * g).sum().backward(),
the work kiln's value_and_grad of sum(cast(attention, f32) * g) does. Timing: sweep_peer.time_ms
(timing.hpp's sampling: 10 warm-up calls, then --reps repetitions each after a 256 MiB memset that
clears L2, CUDA events around the call alone, the median). One JSON object a line on stdout.

Usage: python3 benchmarks/attention_peer.py [--T 1024,4096] [--D 64,128] [--bwd-T 1024] [--reps N]
       [--impls sdpa-flash,sdpa-cudnn,sdpa,flex] [--softcap C]
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep_peer  # noqa: E402  (its time_ms: timing.hpp's sampling)

sweep_peer.torch = torch
time_ms = sweep_peer.time_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", default="1024,4096,8192")
    ap.add_argument("--D", default="64,128")
    ap.add_argument("--bwd-T", default="1024")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--impls", default="sdpa-flash,sdpa-cudnn,flex")
    ap.add_argument("--softcap", type=float, default=0)
    a = ap.parse_args()
    impls = a.impls.split(",")
    B, H = 16, 16
    flex = None
    if "flex" in impls or a.softcap > 0:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        # One compiled flex_attention serves every case: each (shape, mask, score_mod, grad mode) is
        # a recompile, and past dynamo's default limit of 8 it ran unfused (the fiftieth session's
        # causal and soft-capped figures: benchmarks/NOTES.md item 149).
        for name, limit in (("recompile_limit", 256), ("accumulated_recompile_limit", 4096)):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, limit)
        flex = torch.compile(flex_attention)

    backends = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}

    def softcapped(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / a.softcap) * a.softcap

    def attend(impl, q, k, v, causal, mod=None, mask=None):
        if impl in backends:
            with sdpa_kernel(backends[impl]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if impl == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return flex(q, k, v, score_mod=mod, block_mask=mask)

    for cap, D in [(c, int(x)) for c in ([0, a.softcap] if a.softcap > 0 else [0]) for x in a.D.split(",")]:
        for backward, Ts in ((False, a.T), (True, a.bwd_T)):
            for T in [int(x) for x in Ts.split(",") if x]:
                for causal in (False, True):
                    gen = torch.Generator(device="cuda").manual_seed(1)
                    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=gen,
                                           requires_grad=backward) for _ in range(3))
                    g = torch.randn(B, H, T, D, device="cuda", dtype=torch.float32, generator=gen)
                    flops = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
                    ident = f"W13-{'fwdbwd' if backward else 'fwd'}{'-causal' if causal else ''}-T{T}-D{D}"
                    ident += "-softcap" if cap else ""
                    mod = softcapped if cap else None
                    # flex's causal block mask, built once a case (not in the timed call)
                    mask = (create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T, device="cuda")
                            if causal and flex is not None else None)
                    for impl in (["flex"] if cap else impls):
                        try:
                            if backward:
                                def fn():
                                    q.grad = k.grad = v.grad = None
                                    out = attend(impl, q, k, v, causal, mod, mask)
                                    (out.float() * g).sum().backward()
                            else:
                                def fn():
                                    with torch.no_grad():
                                        attend(impl, q, k, v, causal, mod, mask)
                            ms = time_ms(fn, a.reps)
                            print(json.dumps({"id": ident, "impl": impl, "ms": round(ms, 4),
                                              "tflops": round(flops / ms * 1e-9, 1)}), flush=True)
                        except Exception as e:  # a backend that refuses a case is reported, not fatal
                            print(json.dumps({"id": ident, "impl": impl, "error": str(e)[:200]}), flush=True)


if __name__ == "__main__":
    main()
