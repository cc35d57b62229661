#!/usr/bin/env python3
"""The instruction mix of a kernel's loops, from its disassembly (NOTES items 181 and 183-184).

Reads `nvdisasm -c K.cubin` or `cuobjdump -sass K.cubin` output and prints, for each loop (a backward
branch) that holds a tensor-core product and an exponential (an attention kernel's tile step), its
size and the opcodes that mattered so far: HGMMA and MUFU (the work), ISETP and FSEL (masks), IMAD,
R2UR and uniform-datapath ops (addresses and descriptors: item 184's ptxas-uniformity question),
STL/LDL (spills). --all prints every loop; --ops lists a loop's whole opcode count.

Usage: python3 benchmarks/sass_loops.py [--all] [--ops] K.sass...
cubins for the host: the generated source (explain's report, or KILN_DEBUG_DIR) through
`nvcc -arch=sm_90a -cubin`; the disassembler: the device machine's cuobjdump, or the PyPI wheel
nvidia-cuda-nvdisasm where the toolkit here has none.
"""

import argparse
import collections
import re

INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^(\.L_x_\d+):")
TARGET = re.compile(r"BRA\s+(?:`\((\.L_x_\d+)\)|(0x[0-9a-f]+))")
SHOWN = ("HGMMA", "MUFU", "ISETP", "FSEL", "IMAD", "IMAD.MOV", "R2UR", "UIADD3", "ULEA", "UMOV", "STL", "LDL",
         "BAR", "SYNCS")


def read(path):
    """[(address, text)] and {label: address} of one disassembly."""
    instructions, labels, pending = [], {}, []
    for line in open(path):
        label = LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = INSTRUCTION.match(line)
        if m:
            address = int(m.group(1), 16)
            for name in pending:
                labels[name] = address
            pending = []
            instructions.append((address, m.group(2).strip()))
    return instructions, labels


def opcode(text):
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def loops(instructions, labels):
    """(first, last, opcodes) of each backward branch's body."""
    for address, text in instructions:
        m = TARGET.search(text)
        if not m:
            continue
        target = labels.get(m.group(1)) if m.group(1) else int(m.group(2), 16)
        if target is None or target >= address:
            continue
        yield target, address, [opcode(t) for a, t in instructions if target <= a <= address]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--all", action="store_true", help="every loop, not only those with HGMMA and MUFU")
    ap.add_argument("--ops", action="store_true", help="each loop's whole opcode count")
    a = ap.parse_args()
    for path in a.files:
        instructions, labels = read(path)
        print(f"{path}: {len(instructions)} instructions")
        for first, last, ops in loops(instructions, labels):
            count = collections.Counter(ops)
            has = lambda prefix: sum(n for op, n in count.items() if op.startswith(prefix))
            if not a.all and not (has("HGMMA") and has("MUFU")):
                continue
            print(f"  loop {first:#x}-{last:#x}: {len(ops)} instructions, " +
                  ", ".join(f"{p} {has(p)}" for p in SHOWN))
            if a.ops:
                print("    " + ", ".join(f"{op} {n}" for op, n in count.most_common()))


if __name__ == "__main__":
    main()
