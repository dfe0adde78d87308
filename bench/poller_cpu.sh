#!/usr/bin/env bash
# The poller's CPU cost: inferlb in front of N simulated backends (default 100), polling every
# 50 ms for SECONDS (default 60) with no request traffic; prints the CPU seconds inferlb used
# (user + system, from /proc) as a fraction of one core. Aim (issue #4): under 0.1 core.
#   bench/poller_cpu.sh [BACKENDS=100] [SECONDS=60]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-100}
SECS=${2:-60}
cargo build --release -q -p inferlb -p vllm-sim
# For the results file: the commit and freshness of what is measured, and the machine's load.
python3 bench/provenance.py target/release/inferlb target/release/vllm-sim
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
BASE=$(free_port)
LISTEN=$(free_port)
OUT=$(mktemp -d)
trap 'kill $SIM $LB 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$OUT"' EXIT
target/release/vllm-sim --fleet "$N" --port "$BASE" --instant > "$OUT/sims.txt" &
SIM=$!
for _ in $(seq 1 200); do [ "$(grep -c '^http' "$OUT/sims.txt" || true)" -ge "$N" ] && break; sleep 0.1; done
ARGS=()
while read -r url _; do ARGS+=(--backend "$url"); done < <(grep '^http' "$OUT/sims.txt")
target/release/inferlb --listen "127.0.0.1:$LISTEN" --poll-interval-ms 50 --log-level warn "${ARGS[@]}" &
LB=$!
for _ in $(seq 1 200); do curl -sf -o /dev/null "http://127.0.0.1:$LISTEN/ready" && break; sleep 0.1; done
ticks() { awk '{print $14 + $15}' "/proc/$LB/stat"; }
HZ=$(getconf CLK_TCK)
T0=$(ticks); sleep "$SECS"; T1=$(ticks)
PAGE=$(curl -s "http://127.0.0.1:$LISTEN/metrics")
SCRAPES=$(awk '/^inferlb_backend_scrape_duration_seconds_count/ {s += $2} END {print s}' <<<"$PAGE")
echo "connections opened: $(awk '/^inferlb_upstream_connections_opened_total/ {print $2}' <<<"$PAGE"); scrape errors: $(awk '/^inferlb_backend_scrape_errors_total/ {s += $2} END {print s + 0}' <<<"$PAGE")"
python3 - "$T0" "$T1" "$HZ" "$SECS" "$N" "$SCRAPES" <<'PY'
import sys
t0, t1, hz, secs, n, scrapes = map(float, sys.argv[1:])
cpu = (t1 - t0) / hz
print(f"inferlb polling {n:.0f} backends every 50 ms for {secs:.0f} s: {cpu:.2f} CPU s = {cpu/secs:.3f} core; "
      f"{scrapes:.0f} scrapes since start, about {1e6 * cpu / max(1.0, n * secs / 0.05):.0f} µs of CPU per scrape")
PY
