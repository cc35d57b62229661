"""The table of an A/B run (benchmarks/ab.sh, attention_ab.sh): one row per case and kiln
sub-variant ("W4-dynamic"), each variant's times (ms) in run order, and the last variant's best
against the first's. Usage: ab_table.py RAW.jsonl VARIANT... (the lines' "impl" is the variant's
name, or the name and a sub-variant: "<variant>-dynamic")."""
import collections
import json
import sys

rows, variants = collections.defaultdict(list), sys.argv[2:]
for line in open(sys.argv[1]):
    try:
        d = json.loads(line)
    except ValueError:
        continue
    if 'error' in d:
        print('error', d)
    if 'ms' not in d:
        continue
    v = max((v for v in variants if d['impl'] == v or d['impl'].startswith(v + '-')), key=len, default=None)
    if v is not None:
        rows[(d['id'] + d['impl'][len(v):], v)].append(d['ms'])
cases = sorted({k[0] for k in rows})
width = max([12] + [len(c) + 2 for c in cases])
print('case'.ljust(width) + ''.join(v[:22].rjust(24) for v in variants) + '  last/first')
for c in cases:
    t = [rows.get((c, v), []) for v in variants]
    ratio = '%.3f' % (min(t[-1]) / min(t[0])) if t[0] and t[-1] else '-'
    print(c.ljust(width) + ''.join('/'.join('%.4f' % x for x in m).rjust(24) for m in t) + '  ' + ratio)
