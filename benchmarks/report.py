#!/usr/bin/env python3
"""Markdown report of kiln vs PyTorch from two JSONL files.

  python3 benchmarks/report.py TORCH.jsonl KILN.jsonl OUT.md [--env ENV.json] [--png OUT.png] [--no-png]

TORCH.jsonl comes from benchmarks/torch_peer.py, KILN.jsonl from kiln's C++ benchmark binary in the
same format with impl "kiln" (variants such as "kiln-dynamic" or "kiln-cuda_graphs" are allowed).
Lines that are not JSON objects are ignored. ENV.json (benchmarks/run.sh writes it on the measuring
machine) names the commit, GPU, driver, nvcc, torch and triton for the header. The table goes to
stdout and to OUT.md; when matplotlib imports, a bar chart of kiln / torch.compile over the
workloads of the geometric mean goes next to it (OUT.png unless --png is given).

The ratio and the geometric mean are against torch.compile in its default mode, through autograd
for the gradient workloads. torch.compile-joint (W5, W7, W12: forward and backward compiled as one
graph) has a column of its own beside it, and a second geometric mean takes the faster of the two.
"""

import argparse
import datetime
import json
import math
import os
import sys

ORDER = ["W1", "W1b", "W1c", "W2", "W3", "W3b", "W4", "W5", "W6", "W7", "W8", "W9", "W9m", "W10", "W11",
         "W11w", "W12"]
GEOMEAN_IDS = ["W1", "W1b", "W1c", "W2", "W3", "W3b", "W4", "W5", "W6", "W7", "W8", "W12"]
DESC = {
    "W1": "`relu(x*2+1)` 2^26 f32",
    "W1b": "`sigmoid(tanh(x*0.5+0.1)*x)*exp(-x*x)` 2^26 f32",
    "W1c": "`gelu(x+b)` 16384×4096 bf16",
    "W2": "`gelu(x@W+b)` 4096³ bf16",
    "W3": "softmax 16384×4096 f32",
    "W3b": "softmax 4096×32768 f32",
    "W4": "layer_norm fwd 16384×4096 f32",
    "W5": "layer_norm fwd+bwd 16384×4096 f32",
    "W6": "rms_norm fwd 16384×4096 bf16",
    "W7": "cross_entropy fwd+bwd 4096×32000 f32",
    "W8": "AdamW step 2^24 f32",
    "W9": "host cost per cached call, 1024 f32",
    "W9m": "host cost per call, 3-kernel program 32×32 f32",
    "W10": "layer_norm over 10 batch sizes, total incl. compiles",
    "W11": "cold compile of W1, empty cache",
    "W11w": "process start → first result, warm cache",
    "W12": "MLP block fwd+bwd 8192×1024 bf16",
}
MEMORY_BOUND = {"W1", "W1b", "W1c", "W3", "W3b", "W4", "W6", "W8"}


def unit_of(wid):
    if wid in ("W9", "W9m"):
        return "µs"
    if wid == "W10":
        return "s"
    return "ms"


def fmt_time(wid, ms):
    if ms is None:
        return "—"
    u = unit_of(wid)
    if u == "µs":
        return f"{ms * 1e3:.1f} µs"
    if u == "s":
        return f"{ms / 1e3:.2f} s" if ms >= 1e3 else f"{ms / 1e3:.4f} s"
    if wid in ("W11", "W11w"):
        return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"
    return f"{ms:.3f}"


def load(path):
    """-> (env dicts, copy gbps or None, {(id, impl): record}). Missing file -> empty.
    A workload measured in several processes (run.sh repeats the compile-time rows) keeps the
    median record, with every value in its note."""
    envs, copy, runs = [], None, {}
    if path is None or path == "-" or not os.path.exists(path):
        if path not in (None, "-"):
            print(f"warning: {path} not found, treating it as empty", file=sys.stderr)
        return envs, copy, {}
    with open(path, encoding="utf-8", errors="replace") as fh:
        for n, line in enumerate(fh, 1):
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                print(f"warning: {path}:{n}: not JSON, skipped", file=sys.stderr)
                continue
            if not isinstance(r, dict) or "id" not in r:
                continue
            wid = str(r["id"])
            if wid == "env":
                envs.append(r)
            elif wid == "copy":
                if isinstance(r.get("gbps"), (int, float)):
                    copy = float(r["gbps"])
            else:
                runs.setdefault((wid, str(r.get("impl", "?"))), []).append(r)
    recs = {}
    for key, rs in runs.items():
        timed = sorted((r for r in rs if ms_of(r) is not None), key=ms_of)
        if len(timed) < 2:
            recs[key] = rs[-1]
            continue
        r = dict(timed[(len(timed) - 1) // 2])
        values = ", ".join(fmt_time(key[0], ms_of(t)) for t in timed)
        r["note"] = f"median of {len(timed)} processes ({values})" + (f"; {r['note']}" if r.get("note") else "")
        recs[key] = r
    return envs, copy, recs


def ms_of(r):
    if r is None or r.get("error"):
        return None
    v = r.get("ms")
    if isinstance(v, (int, float)) and v > 0 and math.isfinite(v):
        return float(v)
    if isinstance(r.get("us"), (int, float)) and r["us"] > 0:
        return float(r["us"]) / 1e3
    if isinstance(r.get("s"), (int, float)) and r["s"] > 0:
        return float(r["s"]) * 1e3
    return None


def escape(note):
    """A note as a table cell's text: its '|' escaped, as markdown tables need."""
    return str(note).replace("|", "\\|")


def cell(wid, r):
    if r is None:
        return "—"
    if r.get("error"):
        return "error"
    return fmt_time(wid, ms_of(r))


# The max-autotune modes are compared with each other in a table of their own, not in the main
# ratio (kiln's .autotune against torch.compile's default would not be a fair pair).
MAX_MODES = ("kiln-autotune", "torch.compile-max")
# torch.compile over forward and backward as one graph (torch_peer.py's joint peer): a column of its
# own beside torch.compile's default; the main ratio stays against the default.
JOINT = "torch.compile-joint"


def best(recs, wid, prefix):
    """(impl, ms) of the fastest impl named prefix or prefix-*, for workload wid (max modes and the
    joint peer apart)."""
    out = None
    for (i, impl), r in recs.items():
        if i != wid or not (impl == prefix or impl.startswith(prefix + "-")) or impl in MAX_MODES \
                or impl == JOINT:
            continue
        ms = ms_of(r)
        if ms is not None and (out is None or ms < out[1]):
            out = (impl, ms)
    return out


def sort_key(wid):
    return (ORDER.index(wid), "") if wid in ORDER else (len(ORDER), wid)


def load_env(path):
    """The measuring machine and code (run.sh's ENV.json): {} when not given or unreadable."""
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            env = json.load(fh)
        return env if isinstance(env, dict) else {}
    except (OSError, ValueError) as e:
        print(f"warning: {path}: {e}; no environment line", file=sys.stderr)
        return {}


def gpu_name(host, t_env, k_env):
    for e in [host] + t_env[::-1] + k_env[::-1]:
        name = e.get("gpu") or e.get("device")
        if name:
            return str(name)
    return "an unnamed GPU"


def measured_line(host, t_env, gpu):
    """One line naming what was measured: the GPU, driver, nvcc, torch, triton and kiln's commit
    (run.sh's ENV.json; torch and triton also from the PyTorch run's own env line)."""
    torch_env = t_env[-1] if t_env else {}

    def field(key, also=None):
        v = host.get(key) or (also or {}).get(key)
        return str(v) if v not in (None, "") else "not recorded"
    commit = field("commit") + (" with uncommitted changes" if host.get("uncommitted") else "")
    return (f"- measured on {gpu}: driver {field('driver')}, nvcc {field('nvcc')}, "
            f"torch {field('torch', torch_env)}, triton {field('triton', torch_env)}, kiln at {commit}"
            + (f", {host['date']}" if host.get("date") else ""))


def build(torch_path, kiln_path, env_path=None):
    t_env, t_copy, t_recs = load(torch_path)
    k_env, k_copy, k_recs = load(kiln_path)
    host = load_env(env_path)
    recs = dict(t_recs)
    recs.update(k_recs)
    ids = sorted({w for (w, _) in recs}, key=sort_key)
    copy_for_kiln = k_copy if k_copy is not None else t_copy
    gpu = gpu_name(host, t_env, k_env)

    lines = []
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines.append(f"# kiln vs PyTorch — {now}, {gpu}")
    lines.append("")
    lines.append(measured_line(host, t_env, gpu))

    def env_line(name, envs):
        if not envs:
            return f"- {name}: no env line"
        e = envs[-1]
        keys = ["device", "torch", "triton", "cuda", "kiln", "nvcc", "driver", "date", "reps", "cache"]
        parts = [f"{k} {e[k]}" for k in keys if e.get(k) not in (None, "")]
        parts += [f"{k} {v}" for k, v in e.items()
                  if k not in keys and k != "id" and isinstance(v, (str, int, float))]
        return f"- {name}: " + ", ".join(parts)

    lines.append(env_line("PyTorch run", t_env))
    lines.append(env_line("kiln run", k_env))
    devs = {e.get("device") for e in t_env + k_env if e.get("device")}
    if len(devs) > 1:
        lines.append(f"- **warning: the two files were measured on different devices: "
                     f"{', '.join(sorted(devs))}**")
    cp = []
    if t_copy is not None:
        cp.append(f"{t_copy:.0f} GB/s (PyTorch run)")
    if k_copy is not None:
        cp.append(f"{k_copy:.0f} GB/s (kiln run)")
    lines.append("- copy ceiling (1 GiB D2D `copy_`, 2·bytes/time): " + (", ".join(cp) or "not measured"))
    lines.append("")
    lines.append("Times in ms unless marked (W9 µs per call, W10 total seconds). "
                 "kiln/torch.compile compares the fastest kiln variant with the fastest torch.compile "
                 "variant of the row (< 1 means kiln is faster): for W1–W8 and W12 that is "
                 "torch.compile's default mode, through autograd for the gradient workloads. "
                 "torch.compile joint compiles forward and backward as one graph (torch.func under "
                 "torch.compile(fullgraph=True)); kiln/joint compares with it. Every kiln time's "
                 "result was checked on the GPU: against the oracle before timing (W12 against kiln's f32 "
                 "program and a gradcheck; W10/W11 after their timed calls, the time kept only if the "
                 "check passes); "
                 "the torch notes give torch.compile's difference from eager. The max-autotune modes "
                 "have their own table below.")
    lines.append("")
    lines.append("| workload | eager | torch.compile | torch.compile joint | kiln | kiln/torch.compile | kiln/joint "
                 "| kiln % of copy | notes |")
    lines.append("|---|---|---|---|---|---|---|---|---|")

    ratios, joint_ratios = {}, {}
    for wid in ids:
        eager = recs.get((wid, "eager"))
        tc = recs.get((wid, "torch.compile"))
        tj = recs.get((wid, JOINT))
        kl = recs.get((wid, "kiln"))
        tb = best(recs, wid, "torch.compile")
        kb = best(recs, wid, "kiln")
        ratio = None
        if tb and kb:
            ratio = kb[1] / tb[1]
            ratios[wid] = ratio
        jratio = None
        if kb and ms_of(tj) is not None:
            jratio = kb[1] / ms_of(tj)
            joint_ratios[wid] = jratio
        pct = ""
        if kl is not None and not kl.get("error") and isinstance(kl.get("gbps"), (int, float)) \
                and kl["gbps"] > 0 and copy_for_kiln:  # (W12 counts no bytes: no share of copy)
            pct = f"{100.0 * kl['gbps'] / copy_for_kiln:.0f}%"
        notes = []
        for (i, impl), r in sorted(recs.items()):
            if i != wid or impl in ("eager", "torch.compile", "kiln", JOINT) or impl in MAX_MODES:
                continue
            note = r.get("error") or r.get("note")  # the variant's own note, or why it failed
            notes.append(f"{impl} {cell(wid, r)}" + (f" ({str(note)[:100]})" if note else ""))
        if tb and tc is not None and tb[0] != "torch.compile":
            notes.append(f"ratio vs {tb[0]}")
        if kb and kl is not None and kb[0] != "kiln":
            notes.append(f"ratio uses {kb[0]}")
        if kl is None and kb:
            notes.append(f"ratio uses {kb[0]}")
        for impl, r in (("eager", eager), ("torch.compile", tc), (JOINT, tj), ("kiln", kl)):
            if r is not None and r.get("error"):
                notes.append(f"{impl} error: {str(r['error'])[:80]}")
        for impl, r in (("torch.compile", tc), (JOINT, tj), ("kiln", kl)):
            if r is not None and isinstance(r.get("tflops"), (int, float)):
                notes.append(f"{impl} {r['tflops']} TFLOP/s")
        # each side's own notes: torch's compile time and difference from eager, kiln's kernels
        for impl, r in (("eager", eager), ("torch.compile", tc), (JOINT, tj), ("kiln", kl)):
            if r is not None and r.get("note") and not r.get("error"):
                notes.append(f"{impl}: {r['note']}")
        if ratio is not None and ratio > 1.0:
            notes.append("**slower than torch.compile**")
        if jratio is not None and jratio > 1.0:
            notes.append("**slower than torch.compile joint**")
        name = f"{wid} {DESC[wid]}" if wid in DESC else wid
        rtxt = f"{ratio:.2f}" if ratio is not None else "—"
        jtxt = f"{jratio:.2f}" if jratio is not None else "—"
        lines.append(f"| {name} | {cell(wid, eager)} | {cell(wid, tc)} | {cell(wid, tj)} | {cell(wid, kl)} | "
                     f"{rtxt} | {jtxt} | {pct or '—'} | {'; '.join(escape(n) for n in notes)} |")

    lines.append("")
    used = [w for w in GEOMEAN_IDS if w in ratios]
    missing = [w for w in GEOMEAN_IDS if w not in ratios]
    if used:
        gm = math.exp(sum(math.log(ratios[w]) for w in used) / len(used))
        worst = max(used, key=lambda w: ratios[w])
        lines.append(f"**Geometric mean of kiln / torch.compile (default mode) over W1–W8 and W12 on {gpu}: "
                     f"{gm:.3f}** ({len(used)} workloads; target ≤ 0.85; worst {worst} at "
                     f"{ratios[worst]:.2f}, target ≤ 1.0)" + (f"; missing: {', '.join(missing)}" if missing else ""))
        # The same with the joint-graph peer wherever it is faster than the autograd path.
        if any(w in joint_ratios for w in used):
            both = {w: max(ratios[w], joint_ratios.get(w, 0.0)) for w in used}
            gm2 = math.exp(sum(math.log(both[w]) for w in used) / len(used))
            ran = [w for w in used if w in joint_ratios]
            took = [w for w in ran if joint_ratios[w] > ratios[w]]
            lines.append("")
            lines.append(f"Beside it, against the faster of torch.compile and torch.compile joint on each "
                         f"row: {gm2:.3f} (the joint graph ran on {', '.join(ran)} and is the faster on "
                         f"{', '.join(took) if took else 'none of them'}).")
    else:
        gm = None
        lines.append("Geometric mean of kiln / torch.compile over W1–W8 and W12: no workload has both "
                     "a kiln and a torch.compile time.")
    if copy_for_kiln:
        below = []
        for w in sorted(MEMORY_BOUND, key=sort_key):
            r = recs.get((w, "kiln"))
            if r is not None and isinstance(r.get("gbps"), (int, float)) and not r.get("error"):
                share = r["gbps"] / copy_for_kiln
                if share < 0.95:
                    below.append(f"{w} {100 * share:.0f}%")
        if below:
            lines.append("")
            lines.append("Memory-bound workloads below 95% of the copy ceiling: " + ", ".join(below))
    lines.append("")
    return "\n".join(lines), {w: ratios[w] for w in used}, gm, recs


def max_modes_table(recs, ids):
    """kiln's .autotune against its default and against torch.compile(mode='max-autotune-no-cudagraphs')."""
    rows = [w for w in ids if (w, "kiln-autotune") in recs]
    if not rows:
        return []
    out = ["## Max-autotune modes", "",
           "kiln `.autotune = true` (each kernel's candidate tunings and cuBLASLt's algorithms timed at the "
           "first call) against kiln's default and against torch.compile(mode=\"max-autotune-no-cudagraphs\"), "
           "same run.", "",
           "| workload | kiln | kiln-autotune | autotune/kiln | torch.compile-max | kiln-autotune/torch.compile-max | notes |",
           "|---|---|---|---|---|---|---|"]
    ratios = {}
    for wid in rows:
        kl, ka, tm = recs.get((wid, "kiln")), recs.get((wid, "kiln-autotune")), recs.get((wid, "torch.compile-max"))
        gain = f"{ms_of(ka) / ms_of(kl):.3f}" if ms_of(ka) and ms_of(kl) else "—"
        ratio = "—"
        if ms_of(ka) and ms_of(tm):
            ratios[wid] = ms_of(ka) / ms_of(tm)
            ratio = f"{ratios[wid]:.2f}"
        notes = [f"kiln-autotune: {ka['note']}"] if ka and ka.get("note") else []
        if tm is not None and tm.get("note"):
            notes.append(f"torch.compile-max: {tm['note']}")
        if tm is not None and tm.get("error"):
            notes.append(f"torch.compile-max error: {str(tm['error'])[:80]}")
        out.append(f"| {wid} | {cell(wid, kl)} | {cell(wid, ka)} | {gain} | {cell(wid, tm)} | {ratio} | "
                   f"{'; '.join(escape(n) for n in notes)} |")
    used = [w for w in GEOMEAN_IDS if w in ratios]
    out.append("")
    if used:
        gm = math.exp(sum(math.log(ratios[w]) for w in used) / len(used))
        out.append(f"Geometric mean of kiln-autotune / torch.compile-max over {len(used)} of W1–W8 and W12: {gm:.3f}")
    else:
        out.append("torch.compile's max-autotune mode was not run (benchmarks/torch_peer.py --max-autotune).")
    out.append("")
    return out


def plot(ratios, gm, png_path):
    """Bars of kiln / torch.compile for the workloads of the geometric mean (build() passes only
    those), with the geometric mean and its target."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"note: matplotlib unavailable ({e}); no chart", file=sys.stderr)
        return False
    if not ratios:
        return False
    ids = sorted(ratios, key=sort_key)
    vals = [ratios[w] for w in ids]
    colors = ["tab:green" if v <= 1.0 else "tab:red" for v in vals]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(ids) + 2), 4))
    ax.bar(ids, vals, color=colors)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.axhline(0.85, color="gray", linestyle="--", linewidth=1, label="target geomean 0.85")
    if gm is not None:
        ax.axhline(gm, color="tab:blue", linestyle=":", linewidth=1, label=f"geomean {gm:.2f}")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, max(vals + [1.0]) * 1.15)
    ax.set_ylabel("kiln / torch.compile time (lower is better)")
    ax.set_title("kiln vs torch.compile (default mode), the workloads of the geometric mean")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("torch_jsonl")
    p.add_argument("kiln_jsonl", help="kiln's JSONL ('-' or a missing file: PyTorch columns only)")
    p.add_argument("out_md")
    p.add_argument("--env", help="the measuring machine and code (benchmarks/run.sh's env.json)")
    p.add_argument("--png", help="chart path (default: OUT.md with .png)")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--max-from", nargs=2, metavar=("TORCH_JSONL", "KILN_JSONL"),
                   help="take the max-autotune table from another run's files (default: these)")
    a = p.parse_args(argv)
    if not os.path.exists(a.torch_jsonl):
        p.error(f"{a.torch_jsonl} not found")
    md, ratios, gm, recs = build(a.torch_jsonl, a.kiln_jsonl, a.env)
    if a.max_from:
        recs = dict(load(a.max_from[0])[2])
        recs.update(load(a.max_from[1])[2])
    max_md = "\n".join(max_modes_table(recs, sorted({w for (w, _) in recs}, key=sort_key)))
    d = os.path.dirname(a.out_md)
    if d:
        os.makedirs(d, exist_ok=True)
    png = None
    if not a.no_png:
        png = a.png or (os.path.splitext(a.out_md)[0] + ".png")
        try:
            made = plot(ratios, gm, png)
        except Exception as e:  # noqa: BLE001
            print(f"warning: chart failed ({e})", file=sys.stderr)
            made = False
        if made:
            rel = os.path.relpath(png, os.path.dirname(os.path.abspath(a.out_md)) or ".")
            md += f"\n![kiln / torch.compile]({rel})\n"
        else:
            png = None
    if max_md:
        md += "\n" + max_md
    sys.stdout.write(md)
    with open(a.out_md, "w", encoding="utf-8") as fh:
        fh.write(md)
    print(f"wrote {a.out_md}" + (f" and {png}" if png else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
