#!/usr/bin/env python3
"""A/B table of sweep runs: each case's time under every impl name found in the JSON lines given
(`sweep --impl NAME` names a variant, e.g. a KILN_TUNE_* knob), and the geometric mean and extremes
of each pair of impls over the cases both timed (static and dynamic modes apart).

    KILN_TUNE_TRANSPOSE=0 sweep --only pointwise --match add_transposed --impl kiln-old > a.jsonl
    sweep --only pointwise --match add_transposed >> a.jsonl
    python3 benchmarks/sweep_ab.py a.jsonl
"""
import collections
import json
import math
import sys


def main(paths):
    rows = collections.defaultdict(dict)
    for path in paths:
        for line in open(path):
            line = line.strip()
            if not line.startswith("{"):
                continue
            d = json.loads(line)
            if "ms" in d:  # env, copy and error lines carry no time
                rows[d["id"]][d["impl"]] = d
            elif "error" in d:
                print("ERROR", d["id"], d["impl"], d["error"])
    impls = sorted({i for r in rows.values() for i in r})
    print(" | ".join(["case"] + impls))
    ratios = collections.defaultdict(list)
    for case, r in sorted(rows.items()):
        cells = ["%.4f (%s%%)" % (r[i]["ms"], r[i].get("pct_copy")) if i in r else "-" for i in impls]
        print(" | ".join([case] + cells))
        for a in impls:
            for b in impls:
                if a < b and a in r and b in r and a.endswith("dynamic") == b.endswith("dynamic"):
                    ratios[(a, b)].append(math.log(r[a]["ms"] / r[b]["ms"]))
    for (a, b), logs in sorted(ratios.items()):
        print("%s / %s: geomean %.3f over %d cases, worst %.3f, best %.3f"
              % (a, b, math.exp(sum(logs) / len(logs)), len(logs), math.exp(max(logs)), math.exp(min(logs))))


if __name__ == "__main__":
    main(sys.argv[1:])
