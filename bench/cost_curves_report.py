#!/usr/bin/env python3
"""The report of `bench/cost_curves.py`: from its JSON, the Markdown table, each curve's log-log
slopes and verdict, and the PNG (matplotlib; installed into a venv under ~/.cache/inferlb-bench
when missing, as `bench/pd_goodput.py` does).

usage: bench/cost_curves_report.py RESULTS.json [OUT_MD]   (re-render without re-measuring;
       OUT_MD defaults to RESULTS.md, the PNG goes beside it)
"""
import argparse
import json
import math
import os
import subprocess
import sys

# (key in a row, label, unit) of every curve, in table and plot order.
CURVES = [
    ("approx_p50_us", "decision, approximate (p50)", "µs"),
    ("precise_p50_us", "decision, precise (p50)", "µs"),
    ("poll_cores", "poller CPU at 50 ms", "cores"),
    ("ingest_cores", "KV-event ingest CPU", "cores"),
    ("membership_p50_us", "membership change (p50)", "µs"),
    ("rss_mb", "resident memory", "MB"),
]


def slopes(ns, ys):
    """log-log slope between consecutive sizes, and from the first to the last."""
    def s(i, j):
        if i == j or ys[i] is None or ys[j] is None or ys[i] <= 0 or ys[j] <= 0:
            return float("nan")
        return math.log(ys[j] / ys[i]) / math.log(ns[j] / ns[i])
    return [s(i, i + 1) for i in range(len(ns) - 1)], s(0, len(ns) - 1)


def verdict(key, ns, rows, steps, whole):
    """One sentence per curve: linear or better, and what the numbers say about why not."""
    if whole != whole:
        return "not computable (a value was missing or not positive)"
    worst = max((x for x in steps if x == x), default=whole)
    ok = whole <= 1.1
    text = (f"end-to-end slope {whole:.2f} (consecutive: {', '.join(f'{x:.2f}' for x in steps)}): "
            + ("linear or better" if ok else "**superlinear**"))
    if ok and worst > 1.3:
        i = steps.index(worst)
        text += f", but superlinear between {ns[i]} and {ns[i + 1]} ({worst:.2f})"
    if key == "poll_cores":
        behind = [r["n"] for r in rows if r["poll_scrapes_per_s"] < 0.9 * r["poll_nominal_per_s"]]
        per = [r["poll_us_per_scrape"] for r in rows]
        s, w = slopes(ns, per)
        text += f"; CPU per scrape {per[0]:.0f} → {per[-1]:.0f} µs (slope {w:.2f})"
        if behind:
            text += (f"; the poller fell behind its 50 ms at N = {', '.join(map(str, behind))} "
                     "(scrapes below 90 % of N ÷ 50 ms): there the CPU curve flattens by saturation, "
                     "and the cost per scrape is the figure to judge")
    if key == "ingest_cores":
        per = [r["ingest_us_per_block"] for r in rows]
        s, w = slopes(ns, per)
        text += f"; CPU per block {per[0]:.2f} → {per[-1]:.2f} µs (slope {w:.2f})"
        short = [r["n"] for r in rows if r["ingest_blocks_per_s"] < 0.95 * r["target_blocks_per_s"]]
        if short:
            text += (f"; ingest below 95 % of the stated rate at N = {', '.join(map(str, short))} "
                     "(publishers slowed by a subscriber that did not keep up, or starved of CPU: "
                     "see the published / target column)")
        lost = [r["n"] for r in rows if r["ingested_blocks"] < r["published_blocks"] or r["gaps"]]
        text += (f"; **blocks lost or gaps** at N = {', '.join(map(str, lost))}" if lost else
                 "; every block published was ingested, no gap")
    if key == "rss_mb":
        text += "; includes the process's fixed base (runtime, binary), so small N read flatter"
    return text


def fmt(x, digits=1):
    if x is None or x != x:
        return "-"
    return f"{x:,.{digits}f}"


def report(data, png, json_name):
    a = argparse.Namespace(**data["args"])
    rows, header, started, argv = data["rows"], data["header"], data["started"], data["argv"]
    finished, load_before, load_after = data["finished"], data["load_before"], data["load_after"]
    captured = data.get("captured")
    ns = [r["n"] for r in rows]
    lines = [f"# Cost curves: 10 to 1,000 backends — {started}", ""]
    lines += header
    lines += [
        f"- load average before: {load_before}; after: {load_after} (per measurement below)",
        f"- finished {finished}; command: `bench/cost_curves.py {' '.join(argv)}`",
        f"- KV events: {a.blocks_per_s} blocks/s per publisher, {a.blocks_per_msg} blocks per message "
        f"(one new {a.blocks_per_msg}-block chain from a prompt's start, vLLM 0.32 encoding, random ids "
        f"over a 128k vocabulary), block size {a.block_size}, each store kept at {a.keep_blocks} blocks by "
        f"the publishers' own BlockRemoved (the window starts once they are full); inferlb polling every "
        f"{a.kv_poll_interval_ms} ms meanwhile",
        f"- windows: {a.window:g} s (poller and ingest), {a.baseline:g} s idle baseline before ingest, "
        f"{a.settle:g} s settle; decisions: {a.decisions} timed per mode, membership changes: {a.changes}, "
        f"each the median of {a.repeats} bench run(s) (ranges in the JSON)",
        f"- CPU: utime + stime from /proc/PID/stat, in 1/{data.get('clock_ticks_per_s', 100)} s ticks "
        "(at the smallest N a window holds few ticks: read the small-N slopes with that in mind)",
        ("- backends: `vllm-sim --fleet N --instant`" if a.backends == "sim" else
         "- backends: one nginx worker listening on N ports and answering the poller's requests with the "
         f"pages one simulator gives ({captured}): the same bytes inferlb reads from vllm-sim, served "
         "for a fraction of the simulator's CPU (vllm-sim renders its whole page per scrape, ~300 µs: "
         "N = 1,000 at 50 ms would need 6 cores; `--backends sim` uses it anyway)"),
        f"- plot: {os.path.basename(png)}; raw numbers: {json_name}",
        "",
        "| N | decision approx p50 (p99) | decision precise p50 (p99) | poller CPU at 50 ms | "
        "µs / scrape (scrapes/s of nominal) | ingest CPU | µs / block | ingested of target "
        "blocks/s | membership change p50 (p99) | RSS |",
        "| --- |" + " --- |" * 9,
    ]
    for r in rows:
        lines.append(
            f"| {r['n']:,} | {fmt(r['approx_p50_us'])} ({fmt(r['approx_p99_us'])}) µs "
            f"| {fmt(r['precise_p50_us'])} ({fmt(r['precise_p99_us'])}) µs "
            f"| {fmt(r['poll_cores'], 3)} core "
            f"| {fmt(r['poll_us_per_scrape'], 0)} ({r['poll_scrapes_per_s']:,.0f} of {r['poll_nominal_per_s']:,.0f}) "
            f"| {fmt(r['ingest_cores'], 3)} core | {fmt(r['ingest_us_per_block'], 2)} "
            f"| {r['ingest_blocks_per_s']:,.0f} of {r['target_blocks_per_s']:,} "
            f"| {fmt(r['membership_p50_us'])} ({fmt(r['membership_p99_us'])}) µs "
            f"| {fmt(r['rss_mb'])} MB |")
    lines += ["", "## Linear or better?", "",
              "Log-log slope of each curve (1 = linear in N, below 1 = better):", ""]
    for key, label, _ in CURVES:
        steps, whole = slopes(ns, [r[key] for r in rows])
        lines.append(f"- **{label}**: {verdict(key, ns, rows, steps, whole)}.")
    lines += ["", "## Conditions per size", "",
              "| N | load at decisions | load at poller | load at ingest | backends' CPU while polled "
              "| publishers' CPU | ingest idle base | published / target blocks (late ticks) "
              "| ingested total | gaps | streams at end | RSS after poller window | precise blocks per store |",
              "| --- |" + " --- |" * 12]
    for r in rows:
        lines.append(
            f"| {r['n']:,} | {r['decision_load']} | {r['poll_load']} | {r['kv_load']} "
            f"| {fmt(r['backends_cores'], 3)} core | {fmt(r['publisher_cores'], 3)} core "
            f"| {fmt(r['kv_idle_cores'], 3)} core "
            f"| {r['published_blocks']:,} / {r['published_target_blocks']:,.0f} ({r['late_ticks']:,}) "
            f"| {r['ingested_blocks']:,} | {r['gaps']} | {r['streams']} | {fmt(r['poll_rss_mb'])} MB "
            f"| {fmt(r['precise_blocks_per_store'], 0)} |")
    lines += ["", "## Commands, per figure", "",
              "- build: `cargo build --release -p inferlb -p vllm-sim` and "
              "`cargo build --release -p inferlb --bench cost_curves` (its binary copied to "
              "`target/release/cost_curves`)", ""]
    for r in rows:
        lines += [f"N = {r['n']}:", "",
                  f"- decisions and membership: `{r['decision_command']}`",
                  f"- backends (poller and ingest): {r['backends_command']}",
                  f"- poller: `{r['poll_command']}`",
                  f"- ingest: `{r['kv_command']}` with `{r['publish_command']}`", ""]
    return lines


def plot(png, data, json_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        venv = os.path.expanduser("~/.cache/inferlb-bench/venv")
        py = os.path.join(venv, "bin", "python")
        if not os.path.exists(py):
            subprocess.run([sys.executable, "-m", "venv", venv], check=True)
            subprocess.run([py, "-m", "pip", "install", "-q", "matplotlib"], check=True)
        if os.path.abspath(sys.executable) != os.path.abspath(py):
            subprocess.run([py, os.path.abspath(__file__), "--plot-only", png, json_path], check=True)
            return
    draw(png, data)


def draw(png, data):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = data["rows"]
    ns = [r["n"] for r in rows]
    from matplotlib.ticker import FuncFormatter, NullFormatter
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5), dpi=110)

    def two_five(v, _):
        if v <= 0:
            return ""
        lead = round(v / 10 ** math.floor(math.log10(v) + 1e-9))
        return f"{v:g}" if lead in (2, 5) else ""

    def log_log(ax):
        # Plain numbers (after set_*scale, which resets the formatters): the sizes on x, powers
        # of ten and their 2s and 5s on y.
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(ns)
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(FuncFormatter(two_five))

    def panel(ax, title, unit, series):
        for label, key, style in series:
            ys = [r.get(key) for r in rows]
            ax.plot(ns, ys, style, marker="o", label=label)
        first = series[0][1]
        y0 = rows[0].get(first)
        if y0 and y0 > 0:
            ax.plot(ns, [y0 * n / ns[0] for n in ns], ":", color="grey", label="∝ N from the first point")
        log_log(ax)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("backends")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)

    panel(axes[0][0], "decision time", "µs", [
        ("approximate p50", "approx_p50_us", "-"), ("approximate p99", "approx_p99_us", "--"),
        ("precise p50", "precise_p50_us", "-"), ("precise p99", "precise_p99_us", "--")])
    panel(axes[0][1], "poller CPU, 50 ms interval", "share of one core", [
        ("inferlb", "poll_cores", "-"), ("the backends it polls", "backends_cores", "--")])
    panel(axes[0][2], f"KV-event ingest, {data['args']['blocks_per_s']} blocks/s per publisher",
          "share of one core", [("inferlb (idle base removed)", "ingest_cores", "-"),
                                ("the publishers", "publisher_cores", "--")])
    panel(axes[1][0], "membership change (one backend replaced)", "µs", [
        ("p50", "membership_p50_us", "-"), ("p99", "membership_p99_us", "--")])
    panel(axes[1][1], "inferlb resident memory", "MB", [
        ("after ingest window (polled, stores full)", "rss_mb", "-"),
        ("after poller window", "poll_rss_mb", "--")])
    ax = axes[1][2]
    for label, key in [("poller: CPU µs per scrape", "poll_us_per_scrape"),
                       ("ingest: CPU µs per block", "ingest_us_per_block")]:
        ax.plot(ns, [r.get(key) for r in rows], marker="o", label=label)
    log_log(ax)
    ax.set_title("cost per unit of work (flat = linear total)", fontsize=10)
    ax.set_xlabel("backends")
    ax.set_ylabel("µs of CPU")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.suptitle(f"inferlb cost curves, {data['started']} (commit {data['commit'][:10]})", fontsize=11)
    fig.tight_layout()
    fig.savefig(png)


def render(json_path, out_md=None):
    """Write the Markdown and the PNG of one run; returns the Markdown lines."""
    base = os.path.splitext(json_path)[0]
    out_md = out_md or base + ".md"
    png = os.path.splitext(out_md)[0] + ".png"
    with open(json_path) as f:
        data = json.load(f)
    plot(png, data, json_path)
    lines = report(data, png, os.path.basename(json_path))
    with open(out_md, "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--plot-only":
        with open(sys.argv[3]) as f:
            draw(sys.argv[2], json.load(f))
        return
    if len(sys.argv) not in (2, 3) or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    print("\n".join(render(os.path.abspath(sys.argv[1]), sys.argv[2] if len(sys.argv) == 3 else None)))


if __name__ == "__main__":
    main()
