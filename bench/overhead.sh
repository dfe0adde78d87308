#!/usr/bin/env bash
# Proxy overhead: loadgen closed loop (64 clients, 20 s per cell) against instant simulated
# backends — direct, through inferlb (default profile), through nginx (plain round robin).
# Writes bench/results/overhead-<date>.md.  Usage: bench/overhead.sh [SECONDS] [CONCURRENCY]
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-20}
CONC=${2:-64}
BACKENDS=2
cargo build --release -p loadgen -p inferlb -p vllm-sim
LG=target/release/loadgen
if ! command -v nginx >/dev/null; then
  apt-get install -y nginx >/dev/null 2>&1 \
    || { apt-get update >/dev/null && apt-get install -y nginx >/dev/null; } \
    || { echo "overhead.sh: nginx is required (apt-get install -y nginx)" >&2; exit 1; }
fi
NGINX=$(command -v nginx)

WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { # URL: wait (≤ 20 s) until it answers 200
  for _ in $(seq 200); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done
  echo "overhead.sh: $1 never became ready" >&2; exit 1
}

URLS=()
UPSTREAM=""
for i in $(seq "$BACKENDS"); do
  P=$(free_port)
  target/release/vllm-sim --instant --port "$P" >"$WORK/sim$i.log" 2>&1 &
  PIDS+=($!)
  URLS+=("http://127.0.0.1:$P")
  UPSTREAM+="    server 127.0.0.1:$P;"$'\n'
done
for u in "${URLS[@]}"; do wait_http "$u/health"; done

LB_PORT=$(free_port)
BACKEND_FLAGS=()
for u in "${URLS[@]}"; do BACKEND_FLAGS+=(--backend "$u"); done
target/release/inferlb --listen "127.0.0.1:$LB_PORT" --log-level warn "${BACKEND_FLAGS[@]}" >"$WORK/inferlb.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$LB_PORT/ready"

NG_PORT=$(free_port)
mkdir -p "$WORK/nginx/logs"
cat >"$WORK/nginx/nginx.conf" <<NGX
worker_processes 2;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/logs/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  upstream backends {
$UPSTREAM    keepalive 256;
  }
  server {
    listen 127.0.0.1:$NG_PORT;
    location / {
      proxy_pass http://backends;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
NGX
"$NGINX" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -g 'daemon off;' &
PIDS+=($!)
wait_http "http://127.0.0.1:$NG_PORT/health"

run() { # NAME URL STREAMFLAG
  local extra=()
  [ "$3" = "whole" ] && extra+=(--no-stream)
  "$LG" run --url "$2" --workload unique --system-tokens 32 --question-tokens 16 \
    --output-tokens 100 --concurrency "$CONC" --duration "$DUR" --drain-secs 10 \
    "${extra[@]}" --json "$WORK/$1-$3.json" >"$WORK/$1-$3.txt"
}
for mode in whole stream; do
  run direct "${URLS[0]}" "$mode"   # one backend directly (the proxies spread over all)
  run inferlb "http://127.0.0.1:$LB_PORT" "$mode"
  run nginx "http://127.0.0.1:$NG_PORT" "$mode"
done
# A second direct baseline over every backend is not possible without a proxy: the direct
# column is one backend, which the instant simulator serves without its own queueing.

# Keep-alive check: connections inferlb opened to the backends over all runs (and scrapes).
curl -sf "http://127.0.0.1:$LB_PORT/metrics" | grep '^inferlb_upstream_connections_opened_total' \
  | awk '{print $2}' >"$WORK/conns.txt" || echo "?" >"$WORK/conns.txt"

DATE=$(date -u +%Y-%m-%d)
OUT=bench/results/overhead-$DATE.md
mkdir -p bench/results
NGINX_VERSION=$("$NGINX" -v 2>&1 | sed 's/^nginx version: //')
python3 bench/provenance.py --note "nginx: $NGINX_VERSION" target/release/inferlb target/release/loadgen target/release/vllm-sim >"$WORK/provenance.md"
python3 - "$WORK" "$OUT" "$DUR" "$CONC" "$BACKENDS" <<'PY'
import json, sys, subprocess, datetime, os
work, out, dur, conc, nb = sys.argv[1:]
provenance = open(f"{work}/provenance.md").read().rstrip("\n")
cpu = next((l.split(':',1)[1].strip() for l in subprocess.run(['lscpu'],capture_output=True,text=True).stdout.splitlines() if l.startswith('Model name')), 'unknown')
nproc = subprocess.run(['nproc'],capture_output=True,text=True).stdout.strip()
rows = []
lines = [f"# Proxy overhead: direct vs inferlb vs nginx\n",
         f"- command: `bench/overhead.sh {dur} {conc}`",
         f"- machine: nproc {nproc}, CPU {cpu} (shared with other work; absolute numbers are indicative, ratios matter)",
         f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}",
         provenance,
         f"- setup: {nb} `vllm-sim --instant` backends; loadgen closed loop, {conc} clients, {dur} s per cell, unique 48-token prompts, max_tokens 100 (ignore_eos); inferlb default profile; nginx `worker_processes 2`, upstream keepalive 256, round robin, proxy_buffering off; all on 127.0.0.1\n"]
for mode, title in [('whole','Non-streaming'),('stream','Streaming (SSE, 100 chunks)')]:
    d = {n: json.load(open(f"{work}/{n}-{mode}.json")) for n in ['direct','inferlb','nginx']}
    lines.append(f"## {title}\n")
    lines.append("| target | req/s | p50 | p99 | errors |")
    lines.append("| --- | --- | --- | --- | --- |")
    for n in ['direct','inferlb','nginx']:
        s = d[n]
        lines.append(f"| {n} | {s['requests_per_s']:.0f} | {s['e2e']['p50']*1e3:.2f} ms | {s['e2e']['p99']*1e3:.2f} ms | {sum(s['errors'].values())} |")
    i, g, x = d['inferlb'], d['nginx'], d['direct']
    thr = i['requests_per_s']/g['requests_per_s'] if g['requests_per_s'] else float('nan')
    add_i = i['e2e']['p99'] - x['e2e']['p99']
    add_g = g['e2e']['p99'] - x['e2e']['p99']
    ratio = add_i/add_g if add_g > 0 else float('nan')
    lines.append("")
    lines.append(f"- inferlb/nginx throughput: **{thr:.2f}** (target ≥ 0.9) → {'met' if thr >= 0.9 else 'NOT met'}")
    lines.append(f"- added p99 over direct: inferlb {add_i*1e3:.2f} ms, nginx {add_g*1e3:.2f} ms, ratio **{ratio:.2f}** (target ≤ 1.5) → {'met' if ratio <= 1.5 else 'NOT met'}")
    lines.append(f"- inferlb p50 / nginx p50: {i['e2e']['p50']/g['e2e']['p50']:.2f}\n")
conns = open(f"{work}/conns.txt").read().strip() or "?"
total = sum(json.load(open(f"{work}/inferlb-{m}.json"))['requests'] for m in ('whole','stream'))
lines.append(f"inferlb opened {conns} connections to the backends for {total} requests (plus its scrapes): keep-alive at work.\n")
open(out,'w').write("\n".join(lines)+"\n")
print("\n".join(lines))
PY
echo "wrote $OUT"
