#!/usr/bin/env python3
"""W14's PyTorch side: the GPT-2 training step of examples/gpt2.cpp, nanoGPT-style, timed the same way.

The same model (GPT-2 small by default: 12 layers, d 768, 12 heads, context 1024, vocab 50257, tied
embeddings, pre-norm, tanh-gelu, causal attention through scaled_dot_product_attention), the same
synthetic tokens (a repeated pseudo-random sequence, targets the next tokens), bf16 activations under
autocast over f32 master weights, AdamW (betas 0.9, 0.95; weight decay 0.1 on matrices). One step is
forward, backward and the optimizer update; tokens/s is B * T over the median step time of steps
3..N, timed with a synchronisation after each step as the kiln example does.

Prints one JSON object per mode on stdout:
  {"id": "W14", "impl": "eager"|"torch.compile"|"torch.compile-ro"|"torch.compile-max", "tokens_per_s": ..., "ms": ...,
   "peak_mib": ..., "first_loss": ..., "last_loss": ..., "compile_s": ...}

Usage: python3 benchmarks/gpt2_peer.py [--modes eager,torch.compile] [--steps 12] [--tiny] [--profile N]
torch.compile is the default mode (no CUDA graphs), torch.compile-ro mode="reduce-overhead" (the step
replayed from CUDA graphs, as kiln's .cuda_graphs does), torch.compile-max mode="max-autotune" (GEMM
and reduction autotuning, CUDA graphs too).
       python3 benchmarks/gpt2_peer.py --write-check DIR [--tiny]
--write-check writes DIR/init.safetensors (the initial weights under kiln's names and layouts:
linear weights [in, out]) and DIR/losses.txt (the first 10 losses of eager steps from them), which
`examples/gpt2 --check DIR` loads and compares against.
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        shape = (B, T, self.heads, d // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, d, heads, context, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("fc2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens, targets):
        T = tokens.shape[1]
        x = self.wte(tokens) + self.wpe.weight[:T]
        for b in self.blocks:
            x = b(x)
        logits = self.lnf(x) @ self.wte.weight.t()  # tied
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def batch(B, T, vocab, device):
    period = max(3 * T // 4, 2)
    n = B * (T + 1)
    pos = torch.arange(n, dtype=torch.int64) % period
    seq = (pos * 2654435761 + 12345) % vocab
    seq = seq.view(B, T + 1)
    return seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)


def run(mode, args, cfg):
    torch.manual_seed(0)
    layers, d, heads, context, vocab, B = cfg
    model = GPT(layers, d, heads, context, vocab).cuda()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), fused=True)
    tokens, targets = batch(B, context, vocab, "cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    fn = step
    if mode == "torch.compile":
        fn = torch.compile(step)
    elif mode == "torch.compile-ro":
        fn = torch.compile(step, mode="reduce-overhead")
    elif mode == "torch.compile-max":
        fn = torch.compile(step, mode="max-autotune")
    elif mode != "eager":
        raise ValueError(f"unknown mode {mode!r}: eager, torch.compile, torch.compile-ro or torch.compile-max")
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    t_first = time.perf_counter()
    for s in range(args.steps):
        t0 = time.perf_counter()
        loss = fn()
        losses.append(loss.item())  # synchronises
        times.append(time.perf_counter() - t0)
        if s == 0:
            compile_s = time.perf_counter() - t_first
    ms = statistics.median(times[2:]) * 1e3
    if args.profile:
        profile(fn, mode, args.profile, layers)
    return {"id": "W14", "impl": mode, "tokens_per_s": B * context / (ms / 1e3), "ms": ms,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20, "first_loss": losses[0], "last_loss": losses[-1],
            "compile_s": compile_s}


def profile(fn, mode, n, layers):
    """Prints the n kernels that take the most GPU time over two more steps (stderr), as
    KILN_PROFILE's table does for kiln: total ms a step, calls a step, mean us, the kernel's name."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            fn().item()
    def device_us(e):  # (device_time_total since torch 2.4; cuda_time_total before)
        return getattr(e, "device_time_total", None) if hasattr(e, "device_time_total") else e.cuda_time_total
    def kernel(e):  # the kernels themselves, not the CPU ops that launched them
        return "CUDA" in str(getattr(e, "device_type", "CUDA")) and device_us(e) > 0
    rows = [(device_us(e), e.count, e.key) for e in prof.key_averages() if kernel(e)]
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows) / 2e3
    launches = sum(r[1] for r in rows) / 2
    print(f"torch profile ({mode}): {len(rows)} kernels, {launches:.0f} launches a step "
          f"({launches / layers:.1f} a layer), {total:.2f} ms a step", file=sys.stderr)
    print(f"{'ms':>8} {'calls':>6} {'mean us':>9}  kernel", file=sys.stderr)
    for us, count, name in rows[:n]:
        print(f"{us / 2e3:8.3f} {count / 2:6.0f} {us / max(count, 1):9.1f}  {name[:110]}", file=sys.stderr)


def kiln_state(model):
    """The model's weights under examples/gpt2.cpp's names, in its layouts (linear weights [in, out])."""
    out = {"wte": model.wte.weight, "wpe": model.wpe.weight}
    for l, b in enumerate(model.blocks):
        pre = f"h.{l}."
        out.update({pre + "ln1.w": b.ln1.weight, pre + "ln1.b": b.ln1.bias, pre + "qkv.w": b.qkv.weight.t(),
                    pre + "qkv.b": b.qkv.bias, pre + "proj.w": b.proj.weight.t(), pre + "proj.b": b.proj.bias,
                    pre + "ln2.w": b.ln2.weight, pre + "ln2.b": b.ln2.bias, pre + "fc.w": b.fc.weight.t(),
                    pre + "fc.b": b.fc.bias, pre + "fc2.w": b.fc2.weight.t(), pre + "fc2.b": b.fc2.bias})
    out.update({"lnf.w": model.lnf.weight, "lnf.b": model.lnf.bias})
    return {k: v.detach().float().contiguous().cpu() for k, v in out.items()}


def write_check(folder, cfg):
    import os
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    layers, d, heads, context, vocab, B = cfg
    model = GPT(layers, d, heads, context, vocab).cuda()
    save_file(kiln_state(model), os.path.join(folder, "init.safetensors"))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=6e-4 if layers > 2 else 1e-2, betas=(0.9, 0.95))
    tokens, targets = batch(B, context, vocab, "cuda")
    losses = []
    for _ in range(10):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with open(os.path.join(folder, "losses.txt"), "w") as f:
        f.write("\n".join(f"{x:.6f}" for x in losses) + "\n")
    print(json.dumps({"id": "W14-check", "losses": losses}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="eager,torch.compile")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--write-check", metavar="DIR")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, print each mode's N costliest kernels over two steps (stderr)")
    args = ap.parse_args()
    cfg = (2, 32, 2, 32, 97, 4) if args.tiny else (12, 768, 12, 1024, 50257, 8)
    if args.write_check:
        return write_check(args.write_check, cfg)
    for mode in args.modes.split(","):
        try:
            print(json.dumps(run(mode, args, cfg)), flush=True)
        except Exception as e:  # one failed mode does not stop the others
            print(json.dumps({"id": "W14", "impl": mode, "error": repr(e)}), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
