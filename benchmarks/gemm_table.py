#!/usr/bin/env python3
"""benchmarks/gemm.cpp's JSON lines as a table: each case's cuBLASLt times (heuristic, tuned), the
autotuned call's, and the template's fastest blocking, with its throughput against cuBLASLt's tuned
best (above 1: the template is faster). Usage: gemm_table.py gemm.jsonl"""
import json
import sys
from collections import OrderedDict


def main(path):
    cases = OrderedDict()
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        cases.setdefault(r["id"], {})[r["impl"]] = r
    print("| case | cuBLASLt ms | tuned ms | autotuned ms | template's best | ms | TFLOP/s | vs tuned |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for case, impls in cases.items():
        kiln = {k: v for k, v in impls.items() if k.startswith("kiln-")}
        tuned = impls.get("cublaslt-tuned")
        if not kiln or not tuned:
            continue
        name, best = min(kiln.items(), key=lambda kv: kv[1]["ms"])
        ratio = tuned["ms"] / best["ms"]
        ratios.append(ratio)
        get = lambda k: "%.4f" % impls[k]["ms"] if k in impls else "-"
        print("| %s | %s | %s | %s | %s | %.4f | %.0f | %.2fx |" % (
            case, get("cublaslt"), get("cublaslt-tuned"), get("autotuned"), name[5:], best["ms"],
            best["tflops"], ratio))
    if ratios:
        geo = 1.0
        for r in ratios:
            geo *= r
        geo **= 1.0 / len(ratios)
        print("\nTemplate's best against cuBLASLt's tuned: geomean %.2fx, %.2f-%.2fx over %d cases"
              % (geo, min(ratios), max(ratios), len(ratios)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gemm.jsonl")
