#!/usr/bin/env python3
"""Cost curves (issue #27): what inferlb costs as the fleet grows from 10 to 1,000 backends.

For every fleet size N (`--sizes`, default 10,30,100,300,1000), one after the other:

1. **Decision time**, approximate and precise, and **membership change**: the in-process bench
   `benches/cost_curves.rs` (`cost_curves measure --n N`): N healthy backends, the default
   profile; p50 / p99 of single decisions (approximate: 1,000-character chat prompts, 64
   groups in the prefix index; precise: every backend's KV-event store live, 8 token-id prompts
   of 4,096 tokens in 16-token blocks held in different shares); `Pool::reconcile` of the whole
   set with one backend replaced. Each figure is the median of `--repeats` runs of the bench.
2. **Poller CPU at 50 ms**: inferlb in front of N backends with `--poll-interval-ms 50` and no
   traffic (`bench/poller_cpu.sh`, ported): inferlb's CPU (utime + stime from /proc/PID/stat)
   over `--window` seconds → share of one core, and CPU per scrape from the scrapes its /metrics
   counted in the window (not the nominal N / 50 ms: a poller that falls behind scrapes less).
   The backends (`--backends`): by default one nginx worker on N ports serving the very pages a
   `vllm-sim --instant` answers to the poller's requests (captured from one simulator at the
   start), because the simulator renders its whole metrics page per scrape (~300 µs of CPU):
   1,000 of them polled every 50 ms would need 6 cores, and on 2 the poller would measure the
   simulators. `--backends sim` runs `vllm-sim --fleet N --instant` as `poller_cpu.sh` does.
3. **KV-event ingest with N publishers**: `cost_curves publish` opens N ZeroMQ PUB sockets on
   127.0.0.1 and, once inferlb (`--kv-events port+OFF`, polling every `--kv-poll-interval-ms`)
   has all N streams live, publishes vLLM 0.32 messages on each at `--blocks-per-s` blocks per
   second (`--blocks-per-msg` blocks of `--block-size` tokens per message, one new chain from a
   prompt's start, and the blocks stored `--keep-blocks` earlier removed again). Once the stores
   are full (keep ÷ rate seconds after the start: every message then removes as many blocks as
   it stores, as a busy vLLM's do), inferlb's CPU over `--window` s minus its own idle rate (measured over `--baseline` s just before, streams
   live, nothing published) → share of a core and CPU µs per block; blocks ingested (sum of
   `/admin/backends` `blocks_stored`) against blocks published; gaps.
4. **Resident memory**: inferlb's VmRSS at the end of the ingest window (N backends polled,
   N live stores of up to `--keep-blocks` blocks each); also at the end of the poller window.

Writes the raw numbers as JSON and, through `bench/cost_curves_report.py` (which re-renders them
alone, `bench/cost_curves_report.py RESULTS.json`), OUT_MD (default
bench/results/cost-curves-<date>.md) and a PNG beside it. Every
figure's command, the commit, binary freshness and the load average at the start of each
measurement are in the Markdown. Each curve's log-log slope between consecutive sizes and from
the first to the last says whether it is linear (1) or better (< 1).

usage: bench/cost_curves.py [--quick] [--sizes 10,30,100,300,1000] [--window 20] [--baseline 10]
                            [--blocks-per-s 100] [--blocks-per-msg 10] [--block-size 128]
                            [--keep-blocks 1000] [--decisions 5000] [--changes 200] [--repeats 3]
                            [--kv-poll-interval-ms 1000] [--backends nginx|sim]
                            [--no-build] [--allow-stale] [OUT_MD]

`--quick`: sizes 10,30,100, windows of 3 s (baseline 2 s), 500 decisions, one bench run per
size (the full run takes the median of 3), keep 100 blocks: a smoke run of the whole pipeline
(under a minute after the build), not a measurement. The full run takes about 7 minutes after
the build on 2 cores. The plot
needs matplotlib: when it is missing it is installed into a venv under ~/.cache/inferlb-bench.
Every process it starts is stopped on exit, error or Ctrl-C; everything binds 127.0.0.1.
"""
import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import cost_curves_report  # noqa: E402  (bench/cost_curves_report.py: table, slopes, plot)
import provenance  # noqa: E402  (bench/provenance.py)

INFERLB = "target/release/inferlb"
VLLM_SIM = "target/release/vllm-sim"
# The bench binary, copied here from target/release/deps/cost_curves-<hash> after the build
# (provenance.py knows what it is built from by this name).
BENCH = "target/release/cost_curves"
HZ = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------------------
# processes, ports, /proc

class Procs:
    """Every process this script starts; `stop_all` ends each (by its own pid)."""

    def __init__(self):
        self.running = []

    def start(self, cmd, **kw):
        p = subprocess.Popen(cmd, cwd=ROOT, **kw)
        self.running.append(p)
        return p

    def stop(self, p):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in (p.stdin, p.stdout, p.stderr):
            if f:
                f.close()
        if p in self.running:
            self.running.remove(p)

    def stop_all(self):
        for p in list(reversed(self.running)):
            self.stop(p)


def raise_nofile(need):
    """Children inherit the limit: N listeners and N connections per process at N = 1,000."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        sys.exit(f"cost_curves.py: open files limit {soft} < {need} needed; raise `ulimit -Hn`")


class Ports:
    """Runs of consecutive free ports on 127.0.0.1 below the ephemeral range (outgoing
    connections never take them), each run after the previous one (no reuse within a run)."""

    def __init__(self, start=15000, end=32000):
        self.next, self.end = start, end

    def run(self, count):
        while self.next + count < self.end:
            base, self.next = self.next, self.next + count + 16
            if all(self.free(base + i) for i in range(count)):
                return base
        sys.exit(f"cost_curves.py: no {count} consecutive free ports below {self.end}")

    @staticmethod
    def listening(port):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    @staticmethod
    def free(port):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as tokio's listeners do
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
        finally:
            s.close()


def cpu_ticks(pid):
    """utime + stime of a process (all its threads), in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return int(rest[11]) + int(rest[12])


def rss_mb(pid):
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def http_get(url, timeout=30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_for(what, check, timeout=120, every=0.2):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            last = check()
            if last is True:
                return
        except OSError as e:
            last = e
        time.sleep(every)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what} (last: {last})")


def metric_sum(page, name):
    """Sum of every series of `name` (all label sets) on a Prometheus page."""
    total = 0.0
    for line in page.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def timed(read):
    """(value, monotonic time at the middle of the read): a read of 1,000 backends takes tens
    of ms, which would otherwise be counted into the window."""
    t = time.monotonic()
    v = read()
    return v, (t + time.monotonic()) / 2


def admin(lb):
    return json.loads(http_get(f"http://{lb}/admin/backends", timeout=60))["backends"]


def kv_totals(backends):
    """Summed KV-event counters over the backends' stores, and their statuses."""
    out = {"blocks_stored": 0, "blocks_held": 0, "messages": 0, "gaps": 0, "restarts": 0,
           "decode_errors": 0, "status": {}}
    for b in backends:
        k = b.get("kv_events") or {}
        st = k.get("status", "?")
        out["status"][st] = out["status"].get(st, 0) + 1
        out["blocks_stored"] += k.get("blocks_stored", 0)
        out["blocks_held"] += k.get("blocks", 0)
        for key in ("messages", "gaps", "restarts", "decode_errors"):
            out[key] += k.get(key, 0)
    return out


# ---------------------------------------------------------------------------------------------
# one fleet size

def sim_cmd(n, base, a):
    return [VLLM_SIM, "--fleet", str(n), "--port", str(base), "--instant",
            "--block-size", str(a.block_size), "--num-gpu-blocks", str(max(2048, 2 * a.keep_blocks))]


def start_sims(procs, ports, n, a, tmp):
    """`vllm-sim --fleet N`: (process, first port, URLs, command)."""
    base = ports.run(n)
    out = open(os.path.join(tmp, f"sims-{n}.txt"), "w+")
    cmd = sim_cmd(n, base, a)
    env = dict(os.environ, RUST_LOG="warn")
    p = procs.start(cmd, stdout=out, stderr=subprocess.DEVNULL, env=env)

    def up():
        if p.poll() is not None:
            raise RuntimeError(f"vllm-sim exited with {p.returncode}")
        out.seek(0)
        return sum(1 for line in out if line.startswith("http")) >= n or "starting"
    wait_for(f"{n} simulators", up)
    out.seek(0)
    urls = [line.split()[0] for line in out if line.startswith("http")]
    return p, base, urls, " ".join(cmd)


def capture_pages(procs, ports, a, tmp):
    """What one simulator answers to the poller's requests (`/metrics/?<its query>`,
    `/v1/models`), saved for the static backends."""
    query = subprocess.run([BENCH, "metrics-query"], cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout.strip()
    sim, _, urls, cmd = start_sims(procs, ports, 1, a, tmp)
    try:
        page = http_get(f"{urls[0]}/metrics/?{query}")
        models = http_get(f"{urls[0]}/v1/models")
    finally:
        procs.stop(sim)
    for name, text in (("metrics.txt", page), ("models.json", models)):
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    return f"`{cmd}`, `GET /metrics/?{query}` ({len(page)} bytes) and `GET /v1/models`"


def start_nginx(procs, ports, n, tmp):
    """One nginx worker listening on N ports of 127.0.0.1, answering the poller's requests with
    the captured pages: (process, first port, URLs, description)."""
    base = ports.run(n)
    d = os.path.join(tmp, f"nginx-{n}")
    os.makedirs(os.path.join(d, "logs"), exist_ok=True)
    listens = "".join(f"    listen 127.0.0.1:{base + i};\n" for i in range(n))
    conf = f"""worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/logs/error.log warn;
events {{ worker_connections {2 * n + 256}; }}
http {{
  access_log off;
  keepalive_requests 100000000;
  keepalive_timeout 600s;
  server {{
{listens}    location = /metrics/ {{ default_type text/plain; alias {tmp}/metrics.txt; }}
    location = /metrics {{ default_type text/plain; alias {tmp}/metrics.txt; }}
    location = /v1/models {{ default_type application/json; alias {tmp}/models.json; }}
    location = /health {{ return 200 ''; }}
  }}
}}
"""
    with open(os.path.join(d, "nginx.conf"), "w") as f:
        f.write(conf)
    cmd = [shutil.which("nginx") or "nginx", "-p", d, "-c", os.path.join(d, "nginx.conf"), "-g", "daemon off;"]
    p = procs.start(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(n)]

    def up():
        if p.poll() is not None:
            raise RuntimeError(f"nginx exited with {p.returncode}; see {d}/logs/error.log")
        return all(Ports.listening(base + i) for i in (0, n - 1)) or "starting"
    wait_for(f"nginx on {n} ports", up)
    desc = (f"{nginx_version()} (1 worker, keep-alive unlimited) on ports {base}–{base + n - 1} "
            "serving the captured pages at /metrics/, /metrics, /v1/models and /health")
    return p, base, urls, desc


def nginx_version():
    r = subprocess.run([shutil.which("nginx") or "nginx", "-v"], capture_output=True, text=True)
    return (r.stderr or r.stdout).strip().replace("nginx version: ", "")


def family(pid):
    """A process and its children (nginx's workers)."""
    out = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def start_lb(procs, ports, urls, extra, tmp, tag):
    listen = f"127.0.0.1:{ports.run(1)}"
    cmd = [INFERLB, "--listen", listen, "--log-level", "warn", *extra]
    args = cmd + [x for u in urls for x in ("--backend", u)]
    log = open(os.path.join(tmp, f"inferlb-{tag}.log"), "w")
    p = procs.start(args, stdout=log, stderr=subprocess.STDOUT)

    def healthy():
        if p.poll() is not None:
            raise RuntimeError(f"inferlb exited with {p.returncode}; see {log.name}")
        n = sum(1 for b in admin(listen) if b.get("healthy"))
        return n == len(urls) or f"{n} healthy"
    wait_for(f"inferlb with {len(urls)} healthy backends", healthy)
    shown = " ".join(cmd) + f" --backend <each of the {len(urls)} backends>"
    return p, listen, shown


def poller_phase(procs, ports, n, urls, a, tmp, backends):
    """inferlb polling N backends every 50 ms, no traffic."""
    row = {"poll_load": loadavg()}
    lb, listen, cmd = start_lb(procs, ports, urls, ["--poll-interval-ms", "50"], tmp, f"poll-{n}")
    try:
        time.sleep(a.settle)
        m0, r0 = timed(lambda: http_get(f"http://{listen}/metrics"))
        fam = family(backends.pid)
        t0, c0, s0 = time.monotonic(), cpu_ticks(lb.pid), sum(map(cpu_ticks, fam))
        time.sleep(a.window)
        t1, c1, s1 = time.monotonic(), cpu_ticks(lb.pid), sum(map(cpu_ticks, fam))
        m1, r1 = timed(lambda: http_get(f"http://{listen}/metrics"))
        row["poll_rss_mb"] = rss_mb(lb.pid)
    finally:
        procs.stop(lb)
    secs = t1 - t0
    cpu = (c1 - c0) / HZ
    name = "inferlb_backend_scrape_duration_seconds_count"
    # Scrapes per second between the two reads, applied to the CPU window.
    scrapes = (metric_sum(m1, name) - metric_sum(m0, name)) / (r1 - r0) * secs
    errors = (metric_sum(m1, "inferlb_backend_scrape_errors_total")
              - metric_sum(m0, "inferlb_backend_scrape_errors_total"))
    row.update({
        "poll_seconds": secs, "poll_cpu_s": cpu, "poll_cores": cpu / secs,
        "poll_scrapes_per_s": scrapes / secs, "poll_nominal_per_s": n / 0.05,
        "poll_us_per_scrape": 1e6 * cpu / scrapes if scrapes else float("nan"),
        "poll_scrape_errors": errors, "backends_cores": (s1 - s0) / HZ / secs,
        "poll_command": cmd,
    })
    return row


def ingest_phase(procs, ports, n, backend_base, urls, a, tmp):
    """N publishers at a fixed rate, inferlb subscribed to all of them."""
    row = {"kv_load": loadavg()}
    pub_base = ports.run(n)
    pub_cmd = [BENCH, "publish", "--port-base", str(pub_base), "--count", str(n),
               "--blocks-per-s", str(a.blocks_per_s), "--blocks-per-msg", str(a.blocks_per_msg),
               "--block-size", str(a.block_size), "--keep-blocks", str(a.keep_blocks),
               "--max-seconds", str(int(a.window * 3 + 120))]
    pub = procs.start(pub_cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = pub.stdout.readline()
    if not line.startswith('{"bound"'):
        raise RuntimeError(f"publishers did not bind: {line!r} (exit {pub.poll()})")
    extra = ["--poll-interval-ms", str(a.kv_poll_interval_ms), "--kv-events", f"port+{pub_base - backend_base}"]
    lb, listen, cmd = start_lb(procs, ports, urls, extra, tmp, f"kv-{n}")
    try:
        def live():
            t = kv_totals(admin(listen))
            return t["status"].get("live", 0) == n or t["status"]
        wait_for(f"{n} live KV-event streams", live)
        # A subscription travels to the PUB socket after connect returns: let them all arrive.
        time.sleep(max(1.0, a.settle))
        t0, c0 = time.monotonic(), cpu_ticks(lb.pid)
        time.sleep(a.baseline)
        t1, c1 = time.monotonic(), cpu_ticks(lb.pid)
        idle_rate = (c1 - c0) / HZ / (t1 - t0)
        pub.stdin.write("go\n")
        pub.stdin.flush()
        # Measure the steady state: stores full, each message removing what it stores.
        time.sleep(max(a.settle, a.keep_blocks / a.blocks_per_s))
        k0, r0 = timed(lambda: kv_totals(admin(listen)))
        t0, c0, p0 = time.monotonic(), cpu_ticks(lb.pid), cpu_ticks(pub.pid)
        time.sleep(a.window)
        t1, c1, p1 = time.monotonic(), cpu_ticks(lb.pid), cpu_ticks(pub.pid)
        k1, r1 = timed(lambda: kv_totals(admin(listen)))
        row["rss_mb"] = rss_mb(lb.pid)
        pub.stdin.write("stop\n")
        pub.stdin.flush()
        sent = json.loads(pub.stdout.readline())
        # What was published before `stop` must all arrive.
        def drained():
            k = kv_totals(admin(listen))
            return k["blocks_stored"] >= sent["blocks"] or k["blocks_stored"]
        try:
            wait_for("ingest to drain", drained, timeout=30, every=0.5)
        except RuntimeError:
            pass
        k2 = kv_totals(admin(listen))
    finally:
        procs.stop(lb)
        procs.stop(pub)
    secs = t1 - t0
    cpu = (c1 - c0) / HZ
    ingest = cpu - idle_rate * secs
    blocks = (k1["blocks_stored"] - k0["blocks_stored"]) / (r1 - r0) * secs
    row.update({
        "kv_seconds": secs, "kv_cpu_s": cpu, "kv_idle_cores": idle_rate,
        "ingest_cores": ingest / secs,
        "ingest_blocks_per_s": blocks / secs,
        "target_blocks_per_s": n * a.blocks_per_s,
        "ingest_us_per_block": 1e6 * ingest / blocks if blocks else float("nan"),
        "published_blocks": sent["blocks"], "published_seconds": sent["seconds"],
        "published_target_blocks": sent["target_blocks"], "late_ticks": sent["late_ticks"],
        "published_bytes": sent["payload_bytes"],
        "ingested_blocks": k2["blocks_stored"], "gaps": k2["gaps"],
        "restarts": k2["restarts"], "decode_errors": k2["decode_errors"],
        "blocks_held": k2["blocks_held"], "streams": k2["status"],
        "publisher_cores": (p1 - p0) / HZ / secs,
        "kv_command": cmd, "publish_command": " ".join(pub_cmd),
    })
    return row


def decision_phase(n, a):
    """`--repeats` runs of the bench at N (each its own process: fleets built afresh, new hash
    seeds); each figure is the median over the runs, its range kept."""
    cmd = [BENCH, "measure", "--n", str(n), "--decisions", str(a.decisions), "--changes", str(a.changes)]
    load = loadavg()
    runs = []
    for _ in range(a.repeats):
        out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    row = {"decision_load": load, "decision_command": " ".join(cmd) + f"  (× {a.repeats}, medians)",
           "precise_blocks_per_store": runs[0]["precise_blocks_per_store"], "decision_raw": runs}
    for key, part in (("approx", "approximate"), ("precise", "precise"), ("membership", "membership")):
        for q in ("p50", "p99"):
            vals = [r[part][f"{q}_ns"] / 1e3 for r in runs]
            row[f"{key}_{q}_us"] = statistics.median(vals)
            row[f"{key}_{q}_range_us"] = [min(vals), max(vals)]
    return row


# ---------------------------------------------------------------------------------------------

def build(a):
    if a.no_build:
        return
    subprocess.run(["cargo", "build", "--release", "-p", "inferlb", "-p", "vllm-sim"], cwd=ROOT, check=True)
    out = subprocess.run(["cargo", "build", "--release", "-p", "inferlb", "--bench", "cost_curves",
                          "--message-format=json-render-diagnostics"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    exe = None
    for line in out.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") == "compiler-artifact" and msg["target"]["name"] == "cost_curves":
            exe = msg.get("executable") or exe
    if not exe:
        sys.exit("cost_curves.py: cargo named no cost_curves bench executable")
    shutil.copy2(exe, os.path.join(ROOT, BENCH))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sizes")
    p.add_argument("--window", type=float)
    p.add_argument("--baseline", type=float)
    p.add_argument("--settle", type=float)
    p.add_argument("--blocks-per-s", type=int, default=100)
    p.add_argument("--blocks-per-msg", type=int, default=10)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--keep-blocks", type=int)
    p.add_argument("--decisions", type=int)
    p.add_argument("--changes", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--kv-poll-interval-ms", type=int, default=1000)
    p.add_argument("--backends", choices=["nginx", "sim"], default="nginx")
    p.add_argument("--no-build", action="store_true")
    p.add_argument("--allow-stale", action="store_true",
                   help="measure binaries older than their sources (the file says so)")
    p.add_argument("out_md", nargs="?")
    a = p.parse_args()
    quick = {"sizes": "10,30,100", "window": 3.0, "baseline": 2.0, "settle": 1.0,
             "keep_blocks": 100, "decisions": 500, "changes": 40, "repeats": 1}
    full = {"sizes": "10,30,100,300,1000", "window": 20.0, "baseline": 10.0, "settle": 2.0,
            "keep_blocks": 1000, "decisions": 5000, "changes": 200, "repeats": 3}
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    sizes = [int(x) for x in a.sizes.split(",")]
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    out_md = a.out_md or os.path.join(ROOT, "bench", "results",
                                      f"cost-curves-{date}{'-quick' if a.quick else ''}.md")
    base = os.path.splitext(os.path.abspath(out_md))[0]
    os.chdir(ROOT)
    # A SIGTERM stops the run as Ctrl-C does: through the `finally` that ends every process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    raise_nofile(4 * max(sizes) + 1024)

    build(a)
    header, stale = provenance.facts([INFERLB, VLLM_SIM, BENCH])
    if stale and not a.allow_stale:
        sys.exit(f"cost_curves.py: refusing to measure stale or missing binaries: {', '.join(stale)}"
                 " (rebuild, or --allow-stale to measure them anyway)")
    header = [line for line in header if not line.startswith("- load average at start")]
    if a.quick:
        header.insert(0, "- **--quick smoke run: short windows and small N; not a measurement**")
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    load_before = loadavg()
    tmp = tempfile.mkdtemp(prefix="cost-curves-")
    os.chmod(tmp, 0o755)  # nginx's workers (user nobody) read the captured pages
    procs, ports, rows = Procs(), Ports(), []
    ok = False
    try:
        captured = capture_pages(procs, ports, a, tmp) if a.backends == "nginx" else None
        for n in sizes:
            print(f"[N = {n}] decisions and membership", file=sys.stderr, flush=True)
            row = {"n": n, **decision_phase(n, a)}
            if a.backends == "sim":
                backends, first, urls, desc = start_sims(procs, ports, n, a, tmp)
                desc = f"`{desc}`"
            else:
                backends, first, urls, desc = start_nginx(procs, ports, n, tmp)
            row["backends_command"] = desc
            try:
                print(f"[N = {n}] poller CPU, {a.window:g} s", file=sys.stderr, flush=True)
                row.update(poller_phase(procs, ports, n, urls, a, tmp, backends))
                print(f"[N = {n}] KV-event ingest, {a.baseline:g} + {a.window:g} s", file=sys.stderr, flush=True)
                row.update(ingest_phase(procs, ports, n, first, urls, a, tmp))
            finally:
                procs.stop(backends)
            rows.append(row)
            print(f"[N = {n}] approx {row['approx_p50_us']:.1f} µs, precise {row['precise_p50_us']:.1f} µs, "
                  f"poller {row['poll_cores']:.3f} core, ingest {row['ingest_cores']:.3f} core "
                  f"({row['ingest_blocks_per_s']:,.0f}/{row['target_blocks_per_s']:,} blocks/s), "
                  f"membership {row['membership_p50_us']:.1f} µs, RSS {row['rss_mb']:.1f} MB",
                  file=sys.stderr, flush=True)
        ok = True
    finally:
        procs.stop_all()
        if not ok:
            print(f"cost_curves.py: logs kept in {tmp}", file=sys.stderr)
    finished = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    load_after = loadavg()
    shutil.rmtree(tmp, ignore_errors=True)
    data = {"started": started, "finished": finished, "commit": provenance.git("rev-parse", "HEAD") or "",
            "header": header, "load_before": load_before, "load_after": load_after,
            "args": vars(a), "argv": sys.argv[1:], "captured": captured, "clock_ticks_per_s": HZ,
            "rows": rows}
    with open(base + ".json", "w") as f:
        json.dump(data, f, indent=1)
    print("\n".join(cost_curves_report.render(base + ".json", out_md)))


if __name__ == "__main__":
    main()
