#!/usr/bin/env python3
"""Run `loadgen compare` several times and report each policy's median, with the spread.

One shared-prefix run on a 2-core machine can land in either of two regimes: the fleet sits
at its cache's edge at the top of the ramp, so a burst that evicts a few group prefixes can
tip a good policy into a queue that a quiet run never sees. A single run therefore says little
about a policy; the median of a few identical runs (same seed, same workload, every policy in
each repetition, cold fleets throughout) says more, and the min–max column shows the spread.

usage: bench/compare_repeat.py [--no-build] [--traces] REPEATS OUT_MD [loadgen compare arguments…]
  e.g. bench/compare_repeat.py 5 bench/results/compare-shared-prefix-median.md \\
           --workload shared-prefix --policies random,round-robin,load-only,prefix-only,default

Each repetition's own table and JSON go to OUT_MD without its extension, under repeat-N/;
with --traces each policy's per-request trace as well (`loadgen compare --trace-dir`, read by
bench/zipf_tail.py).

The binaries measured are built first (`cargo build --release -p loadgen -p inferlb`); with
--no-build they are not, and a binary older than the sources is refused. OUT_MD names the
source commit, its uncommitted changes and each binary's freshness (bench/provenance.py).
"""
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone

LOADGEN = os.environ.get("LOADGEN", "target/release/loadgen")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402  (bench/provenance.py)

def busiest(summary):
    """The busiest backend's share of requests, as the simulators counted them."""
    shares = ((summary.get("fleet") or {}).get("request_share") or {}).values()
    return max(shares, default=None)


# (column, getter, format): getters take one policy's summary dict and its compare output.
COLUMNS = [
    ("out tok/s", lambda s: s["output_tokens_per_s"], "{:.0f}"),
    ("TTFT p50", lambda s: s["ttft"]["p50"], "{:.3f}s"),
    ("TTFT p90", lambda s: s["ttft"]["p90"], "{:.3f}s"),
    ("TTFT p99", lambda s: s["ttft"]["p99"], "{:.3f}s"),
    ("E2E p90", lambda s: s["e2e"]["p90"], "{:.3f}s"),
    # Time per output token after the first (per request, p90), and requests/s meeting both
    # objectives when the run sets `--slo-*`.
    ("TPOT p90", lambda s: 1000 * s["tpot"]["p90"] if s.get("tpot") else None, "{:.2f}ms"),
    ("goodput", lambda s: s.get("goodput_per_s"), "{:.2f}/s"),
    ("hit rate", lambda s: (s.get("fleet") or {}).get("hit_rate"), "{:.3f}"),
    ("hit/req", lambda s: (s.get("fleet") or {}).get("hit_rate_per_request"), "{:.3f}"),
    ("hit/max", lambda s: s.get("hit_rate_vs_max"), "{:.2f}"),
    # The busiest backend's share of requests (from the simulators' own counts).
    ("busiest", lambda s: busiest(s), "{:.0%}"),
    ("preempt", lambda s: (s.get("fleet") or {}).get("preemptions"), "{:.0f}"),
    ("errors", lambda s: sum(s.get("errors", {}).values()), "{:.0f}"),
    # Mixed-adapter runs only (`--adapters`): the row's fleet-wide LoRA adapter loads.
    ("LoRA loads", lambda s: s.get("_lora_loads"), "{:.0f}"),
]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main():
    argv = sys.argv[1:]
    build = True
    traces = False
    while argv and argv[0] in ("--no-build", "--traces"):
        build = build and argv[0] != "--no-build"
        traces = traces or argv[0] == "--traces"
        argv = argv[1:]
    if len(argv) < 2:
        sys.exit(__doc__)
    repeats = int(argv[0])
    out_md = argv[1]
    args = argv[2:]
    inferlb_bin = "target/release/inferlb"
    own_bins = []  # policies run from binaries of their own (`--policy-bin NAME=BIN`, an older build)
    for i, a in enumerate(args):
        value = args[i + 1] if i + 1 < len(args) else ""
        if a == "--inferlb-bin" and value:
            inferlb_bin = value
        elif a.startswith("--inferlb-bin="):
            inferlb_bin = a.split("=", 1)[1]
        elif a == "--policy-bin" and "=" in value:
            own_bins.append(value.split("=", 1)[1])
        elif a.startswith("--policy-bin=") and a.count("=") >= 2:
            own_bins.append(a.split("=", 2)[2])
    if build:
        subprocess.run(["cargo", "build", "--release", "-p", "loadgen", "-p", "inferlb"], check=True)
    # A policy's own binary is another commit's build: named, not checked against these sources.
    notes = [f"policy binary `{b}` (--policy-bin) built "
             f"{provenance.utc(os.path.getmtime(b)) if os.path.exists(b) else 'missing'}, "
             "not checked against these sources" for b in dict.fromkeys(own_bins)]
    header, stale = provenance.facts([LOADGEN, inferlb_bin], notes)
    if stale:
        sys.exit(f"compare_repeat.py: refusing to measure stale or missing binaries: {', '.join(stale)} "
                 "(run without --no-build, or build them)")
    base = os.path.splitext(os.path.abspath(out_md))[0]
    runs = []  # one compare output per repetition
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for r in range(1, repeats + 1):
        rdir = os.path.join(base, f"repeat-{r}")
        os.makedirs(rdir, exist_ok=True)
        cmd = [LOADGEN, "compare", *args, "--results-dir", rdir]
        if traces:
            cmd += ["--trace-dir", rdir]
        print(f"[repeat {r}/{repeats}] {' '.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        jsons = sorted(
            (os.path.join(rdir, f) for f in os.listdir(rdir) if f.endswith(".json")),
            key=os.path.getmtime,
        )
        with open(jsons[-1]) as f:
            runs.append(json.load(f))

    policies = [row["policy"] for row in runs[0]["rows"]]
    values = {p: {c: [] for c, _, _ in COLUMNS} for p in policies}
    for run in runs:
        for row in run["rows"]:
            s = row.get("summary")
            if not s:
                continue
            s["_lora_loads"] = row.get("lora_loads")
            for c, get, _ in COLUMNS:
                v = get(s)
                if v is not None:
                    values[row["policy"]][c].append(v)

    def med(p, c):
        v = values[p][c]
        return statistics.median(v) if v else None

    lines = [
        f"# loadgen compare, median of {repeats} runs: {runs[0]['name']}",
        "",
        f"- command: `bench/compare_repeat.py {' '.join(sys.argv[1:])}`",
        f"- machine: nproc {os.cpu_count()}, CPU {cpu_model()}",
        f"- date: {started}",
        *header,
        "",
        "Each cell: median over the runs, then [min–max]. Every repetition runs every policy on "
        "a cold fleet with the same seed and workload.",
        "",
        "| policy | " + " | ".join(c for c, _, _ in COLUMNS) + " |",
        "| --- |" + " --- |" * len(COLUMNS),
    ]
    for p in policies:
        cells = []
        for c, _, fmt in COLUMNS:
            v = values[p][c]
            if not v:
                cells.append("-")
            elif len(v) == 1 or min(v) == max(v):
                cells.append(fmt.format(statistics.median(v)))
            else:
                cells.append(
                    f"{fmt.format(statistics.median(v))} [{fmt.format(min(v))}–{fmt.format(max(v))}]"
                )
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    first = runs[0]
    lines += [
        "",
        f"{first['backends']} backends × {first['num_gpu_blocks']} KV blocks of "
        f"{first['block_size']} tokens; times in simulated seconds (time scale "
        f"{first['time_scale']}); max achievable hit rate "
        + (f"{first['max_hit_rate']:.3f}" if first.get("max_hit_rate") is not None else "-")
        + " (one unlimited cache keeping every prompt and answer); hit rate = vLLM's prefix-cache "
        "counter, hit/req = cached ÷ prompt tokens with each request counted once, hit/max = "
        "hit/req ÷ the maximum.",
    ]
    # Ratios of the default profile against the baselines the issue names, on the medians.
    if "default" in policies:
        lines += ["", "Default profile against the baselines (ratios of medians):", ""]
        for base_p in ("random", "round-robin", "load-only"):
            if base_p not in policies:
                continue
            t_d, t_b = med("default", "TTFT p90"), med(base_p, "TTFT p90")
            o_d, o_b = med("default", "out tok/s"), med(base_p, "out tok/s")
            if t_d is not None and t_b:
                lines.append(
                    f"- vs {base_p}: TTFT p90 {t_d / t_b:.3f}×, output tokens/s {o_d / o_b:.2f}×"
                )
        hm = med("default", "hit/max")
        if hm is not None:
            lines.append(f"- default hit rate / maximum: {hm:.2f}")
    lines += ["", "## Every run", ""]
    lines.append("| run | policy | TTFT p90 | TPOT p90 | out tok/s | hit/max |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for i, run in enumerate(runs, 1):
        for row in run["rows"]:
            s = row.get("summary")
            if not s:
                lines.append(f"| {i} | {row['policy']} | failed: {row.get('failure')} | | | |")
                continue
            hm = s.get("hit_rate_vs_max")
            tpot = f"{1000 * s['tpot']['p90']:.2f}ms" if s.get("tpot") else "-"
            lines.append(
                f"| {i} | {row['policy']} | {s['ttft']['p90']:.3f}s | {tpot} | "
                f"{s['output_tokens_per_s']:.0f} | {'-' if hm is None else f'{hm:.2f}'} |"
            )
    text = "\n".join(lines) + "\n"
    with open(out_md, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
