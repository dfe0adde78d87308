#!/usr/bin/env python3
"""Goodput of prefill/decode layouts against a colocated fleet, swept over arrival rates.

Four simulators (crates/vllm-sim, its P/D cost model in FIDELITY.md) serve a prefill-heavy
workload — unique prompts of 2,000–8,000 tokens, 128–512 output tokens, Poisson arrivals —
once per layout and rate, with every seed:

- `colocated`: 4 × both, inferlb's default profile;
- `pd-2p2d`, `pd-1p3d`: 2 (1) prefill + 2 (3) decode simulators, `bench/policies/pd.toml`;
- `pd-spill-2p2d`: 2 + 2 with Dynamo's queue rule, `bench/policies/pd-spill.toml`.

Goodput is DistServe's measure: requests per simulated second whose TTFT and TPOT (per request,
`(E2E − TTFT) ÷ (tokens − 1)`) both meet the objective (`--slo-ttft-ms`, `--slo-tpot-ms`,
defaults 3000 and 10). The table gives, per layout and rate, the median over the seeds of
goodput, TTFT p90 and TPOT p90, with the goodput's min–max; the PNG plots goodput against rate.

usage: bench/pd_goodput.py [--no-build] [--rates 2,3,4,5,6] [--seeds 1,2,3]
                           [--slo-ttft-ms 3000] [--slo-tpot-ms 10] [--requests 240] OUT_MD

Each run's own table and JSON go under OUT_MD without its extension. The plot needs
matplotlib: when it is missing it is installed into a venv under ~/.cache/inferlb-bench.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import datetime, timezone

LOADGEN = os.environ.get("LOADGEN", "target/release/loadgen")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import provenance  # noqa: E402  (bench/provenance.py)

LAYOUTS = [
    # (name, loadgen arguments that define it)
    ("colocated", ["--policies", "default"]),
    ("pd-2p2d", ["--policy-file", "pd-2p2d=bench/policies/pd.toml", "--prefill-backends", "pd-2p2d=2"]),
    ("pd-1p3d", ["--policy-file", "pd-1p3d=bench/policies/pd.toml", "--prefill-backends", "pd-1p3d=1"]),
    ("pd-spill-2p2d", ["--policy-file", "pd-spill-2p2d=bench/policies/pd-spill.toml",
                       "--prefill-backends", "pd-spill-2p2d=2"]),
]

WORKLOAD = [
    "--workload", "unique", "--system-tokens", "2000", "--question-tokens", "0",
    "--prompt-tokens-max", "8000", "--output-tokens", "128", "--output-tokens-max", "512",
    "--backends", "4", "--num-gpu-blocks", "16384", "--time-scale", "4",
]


def compare_args(layout_args, rate, seed, a):
    """One `loadgen compare` call: every layout of LAYOUTS in one fleet-per-policy run."""
    return [*WORKLOAD, *layout_args, "--rate", str(rate), "--seed", str(seed),
            "--requests", str(a.requests), "--duration", "600",
            "--slo-ttft-ms", str(a.slo_ttft_ms), "--slo-tpot-ms", str(a.slo_tpot_ms)]


def all_layout_args():
    out = []
    for name, args in LAYOUTS:
        if name == "colocated":
            continue
        out += args
    return ["--policies", "default", *out]


def plot(png, rates, med):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        venv = os.path.expanduser("~/.cache/inferlb-bench/venv")
        py = os.path.join(venv, "bin", "python")
        if not os.path.exists(py):
            subprocess.run([sys.executable, "-m", "venv", venv], check=True)
            subprocess.run([py, "-m", "pip", "install", "-q", "matplotlib"], check=True)
        if os.path.abspath(sys.executable) != os.path.abspath(py):
            data = json.dumps({"rates": rates, "med": med})
            subprocess.run([py, os.path.abspath(__file__), "--plot-only", png, data], check=True)
            return
    draw(png, rates, med)


def draw(png, rates, med):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, _ in LAYOUTS:
        ys = [med[name][str(r)]["goodput"] for r in rates]
        ax.plot(rates, ys, marker="o", label=name)
    ax.plot(rates, rates, color="grey", linestyle=":", label="offered rate")
    ax.set_xlabel("arrival rate (requests / simulated s)")
    ax.set_ylabel("goodput (requests / simulated s)")
    ax.set_title("4 simulated servers, 2–8k-token prompts, 128–512 output tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--plot-only":
        data = json.loads(sys.argv[3])
        draw(sys.argv[2], data["rates"], data["med"])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-build", action="store_true")
    p.add_argument("--rates", default="2,3,4,5,6")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--slo-ttft-ms", type=float, default=3000)
    p.add_argument("--slo-tpot-ms", type=float, default=10)
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("out_md")
    a = p.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    if not a.no_build:
        subprocess.run(["cargo", "build", "--release", "-p", "loadgen", "-p", "inferlb"], check=True)
    header, stale = provenance.facts([LOADGEN, "target/release/inferlb"])
    if stale:
        sys.exit(f"pd_goodput.py: refusing to measure stale or missing binaries: {', '.join(stale)}")
    base = os.path.splitext(os.path.abspath(a.out_md))[0]
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    # values[layout][rate] = list of (goodput, ttft p90, tpot p90, errors) over seeds
    values = {name: {str(r): [] for r in rates} for name, _ in LAYOUTS}
    commands = []
    for seed in seeds:
        for rate in rates:
            rdir = os.path.join(base, f"rate-{rate:g}-seed-{seed}")
            os.makedirs(rdir, exist_ok=True)
            cmd = [LOADGEN, "compare", *compare_args(all_layout_args(), rate, seed, a), "--results-dir", rdir]
            commands.append(" ".join(cmd))
            print(f"[rate {rate:g} seed {seed}] {' '.join(cmd)}", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True, stdout=sys.stderr)
            jsons = sorted((os.path.join(rdir, f) for f in os.listdir(rdir) if f.endswith(".json")),
                           key=os.path.getmtime)
            with open(jsons[-1]) as f:
                run = json.load(f)
            for row in run["rows"]:
                name = "colocated" if row["policy"] == "default" else row["policy"]
                s = row.get("summary")
                if s is None:
                    values[name][str(rate)].append((0.0, float("nan"), float("nan"), -1))
                    continue
                errors = sum(s["errors"].values())
                values[name][str(rate)].append((s["goodput_per_s"], s["ttft"]["p90"], s["tpot"]["p90"], errors))

    med = {}
    for name, _ in LAYOUTS:
        med[name] = {}
        for r in rates:
            vs = values[name][str(r)]
            med[name][str(r)] = {
                "goodput": statistics.median(v[0] for v in vs),
                "goodput_min": min(v[0] for v in vs),
                "goodput_max": max(v[0] for v in vs),
                "ttft_p90": statistics.median(v[1] for v in vs),
                "tpot_p90": statistics.median(v[2] for v in vs),
                "errors": sum(v[3] for v in vs),
            }
    png = base + ".png"
    plot(png, rates, med)

    lines = [f"# P/D goodput — {started}", ""]
    lines += header
    lines += [
        f"- workload: {' '.join(WORKLOAD)}; {a.requests} requests per run, Poisson arrivals",
        f"- objective: TTFT ≤ {a.slo_ttft_ms:g} ms and TPOT ≤ {a.slo_tpot_ms:g} ms (simulated)",
        f"- seeds {a.seeds}; each cell the median over seeds (goodput min–max in brackets)",
        f"- plot: {os.path.basename(png)}",
        f"- command: bench/pd_goodput.py {' '.join(sys.argv[1:])}",
        "",
        "| layout | " + " | ".join(f"rate {r:g}" for r in rates) + " |",
        "| --- |" + " --- |" * len(rates),
    ]
    for name, _ in LAYOUTS:
        cells = []
        for r in rates:
            m = med[name][str(r)]
            cells.append(f"{m['goodput']:.2f} [{m['goodput_min']:.2f}–{m['goodput_max']:.2f}]")
        lines.append(f"| {name} goodput/s | " + " | ".join(cells) + " |")
    for metric, key in [("TTFT p90", "ttft_p90"), ("TPOT p90", "tpot_p90")]:
        for name, _ in LAYOUTS:
            cells = []
            for r in rates:
                v = med[name][str(r)][key]
                cells.append("-" if v != v else (f"{v:.2f}s" if key == "ttft_p90" else f"{v * 1e3:.1f}ms"))
            lines.append(f"| {name} {metric} | " + " | ".join(cells) + " |")
    best = {}
    for r in rates:
        col = med["colocated"][str(r)]["goodput"]
        top = max((med[n][str(r)]["goodput"], n) for n, _ in LAYOUTS if n != "colocated")
        best[str(r)] = (top[1], top[0] / col if col > 0 else float("inf"))
    lines += ["", "Best P/D layout ÷ colocated goodput, per rate: " + ", ".join(
        f"{r}: {n} {x:.2f}×" for r, (n, x) in best.items())]
    errs = {n: sum(med[n][str(r)]["errors"] for r in rates) for n, _ in LAYOUTS}
    lines += [f"Errors over all runs: {errs}", "", "## Commands", ""]
    lines += [f"    {c}" for c in commands]
    with open(a.out_md, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(base + ".json", "w") as f:
        json.dump({"rates": rates, "seeds": seeds, "median": med, "values": values}, f, indent=1)
    print("\n".join(lines[: 12 + 3 * len(LAYOUTS)]))


if __name__ == "__main__":
    main()
