#!/usr/bin/env python3
"""Soak test (outside CI): mixed streaming load for a fixed time while backends fail and recover
at random, then reconcile what the load generator, inferlb and the backends each counted, and
check inferlb's memory stayed bounded. Everything binds 127.0.0.1 and stops by itself.

    bench/soak.py [--minutes 10] [--rate 12] [--seed 7]

Writes bench/results/soak-<date>.md. Needs release builds of inferlb, vllm-sim and loadgen
(built here with cargo). Python standard library only.
"""
import argparse, datetime, json, os, random, re, signal, socket, subprocess, sys, time, urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, timeout=5):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def scrape_sum(text, name, where=None):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if where and not all(f'{k}="{v}"' in line for k, v in where.items()):
                continue
            total += float(line.rsplit(" ", 1)[1])
    return total


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--rate", type=float, default=12, help="requests/s (wall clock)")
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--rss-bound-mib", type=float, default=64, help="allowed RSS growth after warm-up")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "inferlb", "-p", "vllm-sim", "-p", "loadgen"], cwd=ROOT, check=True)
    # The commit and freshness of what is measured, and the machine's load (bench/provenance.py).
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import provenance
    cwd = os.getcwd()
    os.chdir(ROOT)
    provenance_lines, _ = provenance.facts([os.path.join("target", "release", b) for b in ("inferlb", "vllm-sim", "loadgen")])
    os.chdir(cwd)

    procs = []
    def stop_all():
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()

    try:
        # Simulated vLLM fleet, 10x faster than real time, each with an admin port that stays
        # up while its main port refuses connections.
        base, admin = free_port(), free_port()
        while abs(admin - base) < args.backends + 1:
            admin = free_port()
        sims = subprocess.Popen([os.path.join(BIN, "vllm-sim"), "--fleet", str(args.backends), "--port", str(base),
                                 "--admin-port", str(admin), "--time-scale", "10", "--served-model-name", "soak",
                                 "--num-gpu-blocks", "1024"], stdout=subprocess.PIPE, text=True)
        procs.append(sims)
        urls, admins = [], []
        while len(urls) < args.backends:
            line = sims.stdout.readline()
            if not line:
                sys.exit("vllm-sim exited early")
            m = re.match(r"(http://\S+) admin=(http://\S+)", line.strip())
            if m:
                urls.append(m.group(1)); admins.append(m.group(2))
        listen, metrics_port = free_port(), free_port()
        router_cmd = [os.path.join(BIN, "inferlb"), "--listen", f"127.0.0.1:{listen}", "--admin-listen",
                      f"127.0.0.1:{metrics_port}", "--log-level", "warn"]
        for u in urls:
            router_cmd += ["--backend", u]
        router = subprocess.Popen(router_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(router)
        for _ in range(200):
            try:
                http("GET", f"http://127.0.0.1:{listen}/ready", timeout=1); break
            except Exception:
                time.sleep(0.05)
        seconds = int(args.minutes * 60)
        summary = os.path.join("/tmp", f"soak-{os.getpid()}.json")
        lg_cmd = [os.path.join(BIN, "loadgen"), "run", "--url", f"http://127.0.0.1:{listen}", "--model", "soak",
                  "--workload", "shared-prefix", "--zipf", "1.0", "--groups", "24", "--prompts", "1000000",
                  "--system-tokens", "800", "--question-tokens", "80", "--output-tokens", "60",
                  "--rate", str(args.rate), "--duration", str(seconds), "--drain-secs", "60",
                  "--seed", str(args.seed), "--json", summary]
        for u in urls:
            lg_cmd += ["--backend-metrics", u]
        lg = subprocess.Popen(lg_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(lg)

        faults_log, rss = [], []
        started = time.time()
        warm_rss = None
        next_fault = started + 15
        while lg.poll() is None:
            now = time.time()
            rss.append((round(now - started), rss_kib(router.pid)))
            if warm_rss is None and now - started > 30:
                warm_rss = rss[-1][1]
            if now >= next_fault and now - started < seconds - 20:
                i = rng.randrange(len(admins))
                kind = rng.choice(["kill", "fail", "cut", "hang-metrics", "garbage-metrics", "stall"])
                patch = {
                    "kill": {"refuse_connections": True, "refuse_for_ms": rng.randint(3000, 12000)},
                    "fail": {"fail_rate": 0.5},
                    "cut": {"cut_stream_after": 10},
                    "hang-metrics": {"metrics_hang": True},
                    "garbage-metrics": {"metrics_garbage": True},
                    "stall": {"first_token_stall_ms": 3000},
                }[kind]
                try:
                    http("POST", f"{admins[i]}/sim/faults", {"reset": True})
                    http("POST", f"{admins[i]}/sim/faults", patch)
                    faults_log.append((round(now - started), i, kind))
                except Exception as e:
                    faults_log.append((round(now - started), i, f"{kind} (not applied: {e})"))
                # Each fault lasts 5-15 s, then the backend is healed.
                heal_at = now + rng.uniform(5, 15)
                while time.time() < heal_at and lg.poll() is None:
                    time.sleep(1)
                    rss.append((round(time.time() - started), rss_kib(router.pid)))
                for a in admins:
                    try:
                        http("POST", f"{a}/sim/faults", {"reset": True, "refuse_connections": False})
                    except Exception:
                        pass
                next_fault = time.time() + rng.uniform(5, 20)
            time.sleep(1)
        for a in admins:
            try:
                http("POST", f"{a}/sim/faults", {"reset": True, "refuse_connections": False})
            except Exception:
                pass
        end_rss = rss_kib(router.pid)
        page = http("GET", f"http://127.0.0.1:{metrics_port}/metrics")
        backend_pages = [http("GET", f"{u}/metrics") for u in urls]
        with open(summary) as f:
            s = json.load(f)
    finally:
        stop_all()

    sent = s["requests"]
    ok = s["ok"]
    errors = s["errors"]
    lb_total = scrape_sum(page, "inferlb_requests_total")
    lb_2xx = sum(scrape_sum(page, "inferlb_requests_total", {"code": c}) for c in ["200"])
    lb_interrupted = scrape_sum(page, "inferlb_streams_interrupted_total")
    lb_retried = scrape_sum(page, "inferlb_upstream_responses_total") + scrape_sum(page, "inferlb_upstream_attempt_failures_total") - lb_total
    be_success = sum(scrape_sum(p, "vllm:request_success_total") for p in backend_pages)
    be_abort = sum(scrape_sum(p, "vllm:request_success_total", {"finished_reason": "abort"}) for p in backend_pages)
    unanswered = errors.get("aborted", 0) + errors.get("timeout", 0) + errors.get("connect", 0)
    growth_mib = (end_rss - (warm_rss or end_rss)) / 1024
    checks = [
        ("every request got an answer (no client timeouts, aborts or connect errors)", unanswered == 0, f"{unanswered} unanswered"),
        ("loadgen's requests == inferlb_requests_total", sent == lb_total, f"{sent} vs {lb_total:.0f}"),
        ("loadgen's successes == inferlb 200s − interrupted streams", ok == lb_2xx - lb_interrupted,
         f"{ok} vs {lb_2xx:.0f} − {lb_interrupted:.0f}"),
        (f"inferlb RSS growth after warm-up ≤ {args.rss_bound_mib} MiB", growth_mib <= args.rss_bound_mib,
         f"{(warm_rss or 0)/1024:.1f} → {end_rss/1024:.1f} MiB"),
    ]
    date = datetime.date.today().isoformat()
    cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True, text=True).stdout.strip()
    out = [f"# Soak: {args.minutes:g} minutes of mixed streaming load with failing backends", "",
           f"- command: `bench/soak.py --minutes {args.minutes:g} --rate {args.rate:g} --backends {args.backends} --seed {args.seed}`",
           f"- machine: nproc {os.cpu_count()}, CPU {cpu}", f"- date: {datetime.datetime.utcnow().isoformat(timespec='seconds')}Z",
           *provenance_lines, "",
           f"Workload: shared-prefix, 24 groups with Zipf(1.0) popularity, 800+80 prompt tokens, 60 output tokens, streaming, "
           f"Poisson {args.rate:g} requests/s for {seconds} s, {args.backends} simulated backends (time scale 10). "
           f"Faults: {len(faults_log)} injected, 5-15 s each, one backend at a time.", "",
           "| check | result | detail |", "| --- | --- | --- |"]
    for name, passed, detail in checks:
        out.append(f"| {name} | {'PASS' if passed else 'FAIL'} | {detail} |")
    out += ["", "| count | value |", "| --- | --- |",
            f"| loadgen requests | {sent} |", f"| loadgen successes | {ok} |", f"| loadgen errors by kind | {json.dumps(errors)} |",
            f"| inferlb_requests_total | {lb_total:.0f} |", f"| inferlb 200 answers | {lb_2xx:.0f} |",
            f"| inferlb_streams_interrupted_total | {lb_interrupted:.0f} |",
            f"| extra upstream attempts (retries) | {lb_retried:.0f} |",
            f"| backends' vllm:request_success_total (incl. {be_abort:.0f} aborts) | {be_success:.0f} |",
            f"| TTFT p50 / p99 (s, wall) | {s['ttft']['p50']:.3f} / {s['ttft']['p99']:.3f} |", "",
            "Faults injected (second, backend, kind): " + ", ".join(f"{t}s #{i} {k}" for t, i, k in faults_log), "",
            "inferlb RSS (MiB) every ~60 s: " + ", ".join(f"{t}s {k/1024:.1f}" for t, k in rss[::60])]
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    path = os.path.join(ROOT, "bench", "results", f"soak-{date}.md")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    print("\n".join(out))
    sys.exit(0 if all(p for _, p, _ in checks) else 1)


if __name__ == "__main__":
    main()
