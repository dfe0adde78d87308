#!/usr/bin/env python3
"""Medians and paired ratios of interleaved benchmark rounds (bench/ab_cpu.sh, pinned_cpu.sh).

    bench/paired_rows.py ROWS KEY [BASE]

ROWS has one line per row and round, `NAME key=value key=value …`, the rounds interleaved
(every row once per round, in the same order). Printed: each row's median of every key, then,
per round, each row's KEY against BASE's (default: the first row) and the median of those
paired ratios, the figure to quote on shared machines where whole rounds run fast or slow.
"""
import collections
import statistics
import sys


def main() -> None:
    path, key = sys.argv[1], sys.argv[2]
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    order = []
    for line in open(path):
        name, *cells = line.split()
        if name not in rows:
            order.append(name)
        for cell in cells:
            k, v = cell.split("=", 1)
            rows[name][k].append(float(v))
    base = sys.argv[3] if len(sys.argv) > 3 else order[0]
    print(f"\n## medians per request ({key}: the proxy's CPU in µs)")
    for name in order:
        r = rows[name]
        cells = ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in r.items() if k != "rps")
        print(f"{name}: req/s {statistics.median(r['rps']):.0f}, {cells} (rounds {len(r[key])})")
    for name in order:
        if name == base:
            continue
        ratios = [b / a for a, b in zip(rows[base][key], rows[name][key])]
        print(
            f"paired {name} / {base}, {key} per round: median {statistics.median(ratios):.3f} "
            f"({' '.join(f'{x:.3f}' for x in ratios)})"
        )


if __name__ == "__main__":
    main()
