#!/usr/bin/env python3
"""The shape sweep's table (issue 19) from the JSON lines of sweep.cpp and sweep_peer.py.

  python3 benchmarks/sweep_report.py SWEEP.jsonl [MORE.jsonl ...] [--md OUT.md] [--png-dir DIR]

For each case (op, shape, dtype): kiln / torch.compile in the default mode (kiln's static shapes
against torch.compile's default) and in the dynamic mode (kiln-dynamic against
torch.compile(dynamic=True)), kiln-dynamic / kiln, and kiln's share of the copy ceiling; then the
geometric means, the line `Worst shape: <op> <shape> <dtype> <ratio>×` (default mode), the worst
dynamic shape, and the memory-bound cases of 64 MiB or more below 85% of the copy ceiling. A case
measured several times (rounds, reruns) keeps the median of its times. With matplotlib, a PNG per
op family (ratio against row length, log x axis) goes to --png-dir (default: next to the first
input); without it the PNGs are skipped with a message. Lines that are not JSON objects are ignored.
"""

import argparse
import collections
import json
import math
import os
import statistics
import sys

FAMILIES = ["softmax", "log_softmax", "layer_norm", "layer_norm_bwd", "rms_norm", "rms_norm_bwd",
            "cross_entropy", "pointwise", "colsum", "3d", "small"]
MODES = [("default", "kiln", "torch.compile"), ("dynamic", "kiln-dynamic", "torch.compile-dynamic")]


def load(paths):
    times, info, errors, copy = collections.defaultdict(list), {}, [], {}
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                rid, impl = r.get("id"), r.get("impl", "")
                if rid == "copy" and "gbps" in r:
                    copy.setdefault(impl, []).append(r["gbps"])
                if not isinstance(rid, str) or not rid.startswith("sweep-"):
                    continue
                if "error" in r:
                    errors.append((rid, impl, r["error"]))
                    continue
                if "ms" in r:
                    times[(rid, impl)].append(float(r["ms"]))
                    if "op" in r:
                        info[rid] = r
    return times, info, errors, copy


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def row_len(shape):
    return int(shape.split("x")[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+")
    p.add_argument("--md", help="also write the table to this file")
    p.add_argument("--png-dir", help="where the PNGs go (default: the first input's folder)")
    a = p.parse_args(argv)
    times, info, errors, copy = load(a.inputs)
    med = {k: statistics.median(v) for k, v in times.items()}
    copy_gbps = statistics.median(copy["kiln"]) if copy.get("kiln") else None

    out = []
    out.append("| op | shape | dtype | torch.compile | kiln | kiln/torch.compile | torch.compile dynamic | "
               "kiln-dynamic | kiln-dynamic/torch dynamic | kiln-dynamic/kiln | kiln % of copy |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = {"default": [], "dynamic": []}  # (ratio, id)
    low_copy = []
    fam_of = {}

    def order(rid):
        r = info[rid]
        fam = r.get("family", "")
        return (FAMILIES.index(fam) if fam in FAMILIES else 99, r.get("op", ""), r.get("dtype", ""),
                row_len(r["shape"]), r["shape"])

    for rid in sorted(info, key=order):
        r = info[rid]
        fam_of[rid] = r.get("family", "")
        cells = []
        for mode, ki, ti in MODES:
            kt, tt = med.get((rid, ki)), med.get((rid, ti))
            ratio = kt / tt if kt and tt else None
            if ratio:
                ratios[mode].append((ratio, rid))
            cells += [f"{tt:.4f}" if tt else "—", f"{kt:.4f}" if kt else "—",
                      f"{ratio:.2f}" if ratio else "—"]
        ks, kd = med.get((rid, "kiln")), med.get((rid, "kiln-dynamic"))
        dyn_static = f"{kd / ks:.2f}" if ks and kd else "—"
        pct = "—"
        if ks and copy_gbps and r.get("bytes"):
            share = 100 * r["bytes"] / ks / 1e6 / copy_gbps
            pct = f"{share:.0f}%"
            if r["bytes"] >= 64 * 2**20 and share < 85:
                low_copy.append(f"{r['op']} {r['shape']} {r['dtype']} {share:.0f}%")
        out.append(f"| {r['op']} | {r['shape']} | {r['dtype']} | " + " | ".join(cells[:3]) + " | "
                   + " | ".join(cells[3:]) + f" | {dyn_static} | {pct} |")

    out.append("")
    for mode, _, ti in MODES:
        rs = ratios[mode]
        if not rs:
            out.append(f"No {mode}-mode pairs (kiln and {ti} both measured) yet.")
            continue
        g = geomean([x for x, _ in rs])
        out.append(f"Geometric mean of kiln/{ti} ({mode} mode, {len(rs)} cases): **{g:.3f}** (target ≤ 0.85)")
    for mode, label in (("default", "Worst shape"), ("dynamic", "Worst dynamic shape")):
        if ratios[mode]:
            worst, rid = max(ratios[mode])
            r = info[rid]
            out.append(f"{label}: {r['op']} {r['shape']} {r['dtype']} {worst:.2f}×")
    if copy_gbps:
        out.append(f"Copy ceiling (kiln's 1 GiB device-to-device copy): {copy_gbps:.0f} GB/s; "
                   f"memory-bound cases of 64 MiB or more below 85% of it: "
                   + (", ".join(low_copy) if low_copy else "none"))
    if errors:
        out.append("")
        out.append(f"Errors ({len(errors)}): " + "; ".join(f"{rid} {impl}: {e[:120]}" for rid, impl, e in errors[:20]))
    text = "\n".join(out)
    print(text)
    if a.md:
        with open(a.md, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        print("(matplotlib is not installed here: no PNGs)", file=sys.stderr)
        return 0
    png_dir = a.png_dir or os.path.dirname(os.path.abspath(a.inputs[0]))
    os.makedirs(png_dir, exist_ok=True)
    for fam in FAMILIES:
        series = collections.defaultdict(list)  # (op, dtype, mode) -> [(row length, ratio)]
        for mode in ("default", "dynamic"):
            for ratio, rid in ratios[mode]:
                if fam_of.get(rid) == fam:
                    r = info[rid]
                    series[(r["op"], r["dtype"], mode)].append((row_len(r["shape"]), ratio))
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for (op, dt, mode), pts in sorted(series.items()):
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o",
                    linestyle="-" if mode == "default" else "--",
                    label=f"{op} {dt}" + (" dynamic" if mode == "dynamic" else ""))
        ax.set_xscale("log")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.axhline(1.10, color="red", linewidth=0.8, linestyle=":")
        ax.set_xlabel("row length (last dim)")
        ax.set_ylabel("kiln / torch.compile time (lower is better)")
        ax.set_title(f"shape sweep: {fam}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(png_dir, f"sweep_{fam}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
