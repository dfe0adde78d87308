#!/usr/bin/env python3
"""The results table of bench/overhead.sh: parses every wrk run and writes medians.

usage: overhead_table.py WORK OUT DUR CONN REPS WRK_THREADS LOAD_BEFORE LOAD_AFTER RSS ROW...
"""
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys

work, out, dur, conn, reps, threads, load_before, load_after, rss, *rows = sys.argv[1:]
reps = int(reps)
UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def ms(text):
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    return float(m.group(1)) * UNIT[m.group(2)] if m else float("nan")


CLK_TCK = float(open(f"{work}/clk_tck").read()) if os.path.exists(f"{work}/clk_tck") else 100.0


def cpu_per_1000(path, requests):
    """CPU ms the proxy's processes used per 1,000 requests in one wrk run (nan: not measured)."""
    if not os.path.exists(path) or not requests:
        return float("nan")
    ticks = int(open(path).read().strip() or 0)
    return ticks / CLK_TCK * 1e3 / requests * 1e3


def parse(path):
    text = open(path).read()
    total = re.search(r"(\d+) requests in", text)
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)", text, re.M))
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    return {
        "rps": float(rps.group(1)) if rps else 0.0,
        "p50": ms(lat.get("50", "")),
        "p99": ms(lat.get("99", "")),
        "non2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": sum(map(int, sock.groups())) if sock else 0,
        "requests": int(total.group(1)) if total else 0,
        "cpu": cpu_per_1000(path[:-4] + ".cpu", int(total.group(1)) if total else 0),
        "raw": text,
    }


# A row may run in one mode only (hyper-floor: non-streaming); it has no files in the other.
runs = {(r, m, i): parse(f"{work}/{r}-{m}-{i}.txt") for r in rows for m in ("whole", "stream") for i in range(1, reps + 1) if os.path.exists(f"{work}/{r}-{m}-{i}.txt")}
med = statistics.median
provenance = open(f"{work}/provenance.md").read().rstrip("\n")
cpu = next((l.split(":", 1)[1].strip() for l in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines() if l.startswith("Model name")), "unknown")
nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
label = out.rsplit("/", 1)[-1]
lines = [
    "# Proxy overhead: direct vs nginx vs inferlb (and SGLang's and vLLM's routers)\n",
    f"- command: `bench/overhead.sh {dur} {conn} {reps}` (wrk -t{threads} -c{conn} -d{dur}s --latency -s bench/wrk/post.lua)",
    f"- machine: nproc {nproc}, CPU {cpu}, shared with other engineers' builds: ratios within one run matter, absolute numbers are indicative",
    f"- load: before `{load_before.strip()}`; after `{load_after.strip()}`",
    f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}",
    provenance,
    "- setup: 2 backends per mode. Non-streaming: one nginx serving two ports with `return 200` and a chat-completion JSON. "
    "Streaming: two `examples/sse_responder` processes, 100 SSE events + `[DONE]` per request, each its own chunk. "
    f"nginx proxy: worker_processes {nproc}, round robin, upstream keepalive 256, proxy_buffering off. inferlb: default profile, default log level. "
    "SGLang's and vLLM's routers: `--policy cache_aware`. Each repetition runs every row in turn (interleaved), all on 127.0.0.1.",
    f"- inferlb resident memory at the end (non-streaming/streaming instance): {rss} KiB\n",
]
summary = {}
for mode, title in (("whole", "Non-streaming"), ("stream", "Streaming (100 SSE chunks)")):
    lines.append(f"## {title}: medians of {reps} runs\n")
    lines.append("| row | req/s | × nginx (range) | CPU ms / 1,000 req | × nginx's CPU (range) | p50 | p99 | p99 × nginx's | added p99 over direct | × nginx's added p99 | non-2xx / socket errors |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if (r, mode, 1) not in runs:
            continue
        per = [runs[(r, mode, i)] for i in range(1, reps + 1)]
        ng = [runs[("nginx", mode, i)] for i in range(1, reps + 1)]
        dr = [runs[("direct", mode, i)] for i in range(1, reps + 1)]
        ratios = [a["rps"] / b["rps"] if b["rps"] else float("nan") for a, b in zip(per, ng)]
        added = [a["p99"] - d["p99"] for a, d in zip(per, dr)]
        ng_added = [g["p99"] - d["p99"] for g, d in zip(ng, dr)]
        added_ratio = [a / g if g > 0 else float("nan") for a, g in zip(added, ng_added)]
        p99_ratio = [a["p99"] / g["p99"] if g["p99"] > 0 else float("nan") for a, g in zip(per, ng)]
        cpu_ratio = [a["cpu"] / g["cpu"] if g["cpu"] > 0 else float("nan") for a, g in zip(per, ng)]
        row = {
            "rps": med(x["rps"] for x in per),
            "ratio": med(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "p50": med(x["p50"] for x in per),
            "p99": med(x["p99"] for x in per),
            "added_p99": med(added),
            "added_p99_ratio": med(added_ratio),
            "p99_ratio": med(p99_ratio),
            "cpu": med(x["cpu"] for x in per),
            "cpu_ratio": med(cpu_ratio),
            "cpu_ratio_min": min(cpu_ratio),
            "cpu_ratio_max": max(cpu_ratio),
            "errors": f"{sum(x['non2xx'] for x in per)} / {sum(x['socket_errors'] for x in per)}",
        }
        summary[f"{r}-{mode}"] = row
        rel = "—" if r == "direct" else f"{row['ratio']:.2f} ({row['ratio_min']:.2f}–{row['ratio_max']:.2f})"
        add = "—" if r == "direct" else f"{row['added_p99']:.2f} ms"
        addr = "—" if r in ("direct", "nginx") else f"{row['added_p99_ratio']:.2f}"
        cpu = "—" if math.isnan(row["cpu"]) else f"{row['cpu']:.1f}"
        cpur = "—" if r in ("direct", "nginx") or math.isnan(row["cpu_ratio"]) else f"{row['cpu_ratio']:.2f} ({row['cpu_ratio_min']:.2f}–{row['cpu_ratio_max']:.2f})"
        lines.append(f"| {r} | {row['rps']:,.0f} | {rel} | {cpu} | {cpur} | {row['p50']:.2f} ms | {row['p99']:.2f} ms | {'—' if r in ('direct', 'nginx') else format(row['p99_ratio'], '.2f')} | {add} | {addr} | {row['errors']} |")
    d, n, i = summary[f"direct-{mode}"], summary[f"nginx-{mode}"], summary[f"inferlb-{mode}"]
    target = 0.7 if mode == "whole" else 0.9
    lines.append("")
    lines.append(f"- generator headroom: direct {d['rps']:,.0f} req/s = {d['rps'] / max(max(summary[f'{r}-{mode}']['rps'] for r in rows if r != 'direct' and f'{r}-{mode}' in summary), 1):.2f} × the fastest proxy")
    lines.append(f"- inferlb / nginx throughput **{i['ratio']:.2f}** (target ≥ {target}) → {'met' if i['ratio'] >= target else 'NOT met'}; "
                 f"added p99 {i['added_p99_ratio']:.2f} × nginx's (target ≤ 1.5) → {'met' if i['added_p99_ratio'] <= 1.5 else 'NOT met (or not measurable: nan when nginx added nothing over direct, whose p99 is itself loaded)'}; "
                 f"p99 {i['p99_ratio']:.2f} × nginx's; "
                 f"CPU per 1,000 requests {i['cpu_ratio']:.2f} × nginx's"
                 + (f" (target ≤ 1.5) → {'met' if i['cpu_ratio'] <= 1.5 else 'NOT met'}" if mode == "whole" else "") + "\n")
    if f"nginx-log-{mode}" in summary and f"inferlb-nolog-{mode}" in summary:
        def paired(a, b, key):
            xs = [runs[(a, mode, k)][key] / runs[(b, mode, k)][key] for k in range(1, reps + 1) if runs[(b, mode, k)][key] > 0]
            return f"{med(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})" if xs else "nan"
        lines.append(f"- like for like, both logging every request: inferlb / nginx-log throughput {paired('inferlb', 'nginx-log', 'rps')}, "
                     f"CPU per 1,000 requests {paired('inferlb', 'nginx-log', 'cpu')}; "
                     f"neither logging: inferlb-nolog / nginx throughput {paired('inferlb-nolog', 'nginx', 'rps')}, CPU {paired('inferlb-nolog', 'nginx', 'cpu')}\n")
    lines.append("The medians are of each figure separately; ratios are per repetition (same minute), then their median.\n")
open(out, "w").write("\n".join(lines) + "\n")
json.dump({"summary": summary, "runs": {"/".join(map(str, k)): {kk: vv for kk, vv in v.items() if kk != "raw"} for k, v in runs.items()}},
          open(out[:-3] + ".json", "w"), indent=1)
print("\n".join(lines))
