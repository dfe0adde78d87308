#!/usr/bin/env bash
# CPU per proxied request with the proxy alone on one core: the proxy (one worker) is pinned
# to CPU 1, the instant nginx backends and wrk to CPU 0. On two shared cores (bench/overhead.sh,
# bench/ab_cpu.sh) the proxy shares its core with the peers it wakes, is preempted by them
# (inferlb's workers 0.45 times a request, measured), and its CPU per request moves with that:
# rounds spread ±15 %. Pinned, nothing else runs on the proxy's core, so the figure is the
# proxy's own work and its syscalls.
#
#   bench/pinned_cpu.sh [SECONDS=5] [ROUNDS=6] NAME=BINARY [NAME=BINARY…]
#
# Rows: nginx (worker_processes 1, keep-alive upstream, as bench/overhead.sh configures it),
# the hyper floor (examples/hyper_floor.rs; one runtime, as it sees one core) and each inferlb
# binary (`--workers 1`, default profile and log level). Each round drives every row in turn
# with `wrk -t1 -c32` non-streaming (bench/wrk/post.lua) and reads the proxy's user + system
# time from /proc over a SECONDS window that starts a second into wrk's run; requests are
# wrk's rate times SECONDS. The last lines give medians and, per round, each row against
# nginx's (paired ratios), whose median is the figure to quote. Needs nginx, wrk, taskset
# (Debian: nginx-light wrk util-linux) and 2 or more cores; builds nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-5}
ROUNDS=${2:-6}
shift 2 || { echo "usage: bench/pinned_cpu.sh SECONDS ROUNDS NAME=BINARY…" >&2; exit 2; }
[ $# -ge 1 ] || { echo "usage: bench/pinned_cpu.sh SECONDS ROUNDS NAME=BINARY…" >&2; exit 2; }
for c in nginx wrk taskset python3 curl; do command -v "$c" >/dev/null || { echo "pinned_cpu.sh: needs $c" >&2; exit 1; }; done
[ "$(nproc)" -ge 2 ] || { echo "pinned_cpu.sh: needs 2 cores" >&2; exit 1; }
FLOOR_BIN=${FLOOR_BIN:-target/dist/examples/hyper_floor}
# shellcheck source=bench/instant_backends.sh
. bench/instant_backends.sh
bench_scratch
# The backends (and, below, wrk) on CPU 0: taskset -c 0 on this shell is inherited.
taskset -pc 0 $$ >/dev/null
start_instant_backends
declare -A PID URL
NAMES=()
# nginx as the reference, one worker on CPU 1.
P=$(free_port)
write_nginx_proxy "$WORK/proxy" "$P" 1 "$B1" "$B2"
taskset -c 1 nginx -p "$WORK/proxy" -c "$WORK/proxy/nginx.conf" -g 'daemon off;' &
PID[nginx]=$!; PIDS+=($!); URL[nginx]="http://127.0.0.1:$P"; NAMES+=(nginx)
if [ -x "$FLOOR_BIN" ]; then
  taskset -c 1 "$FLOOR_BIN" 127.0.0.1:0 "127.0.0.1:$B1" "127.0.0.1:$B2" >"$WORK/floor.addr" 2>"$WORK/floor.log" &
  PID[floor]=$!; PIDS+=($!); NAMES+=(floor)
fi
for spec in "$@"; do
  name=${spec%%=*}; bin=${spec#*=}
  [ -x "$bin" ] || { echo "pinned_cpu.sh: $bin is not an executable" >&2; exit 1; }
  port=$(free_port)
  taskset -c 1 "$bin" --workers 1 --listen "127.0.0.1:$port" --backend "http://127.0.0.1:$B1" \
    --backend "http://127.0.0.1:$B2" >"$WORK/$name.log" 2>&1 &
  PID[$name]=$!; PIDS+=($!); URL[$name]="http://127.0.0.1:$port"; NAMES+=("$name")
done
for name in "${NAMES[@]}"; do
  [ "$name" = floor ] && URL[floor]=$(floor_url "$WORK/floor.addr")
  wait_chat "${URL[$name]}" "$name"
done
# CPU of a row: nginx's master and its worker; any other row is one process.
cpu_of() {
  local pid=$1 total=0 p
  for p in "$pid" $(pgrep -P "$pid" || true); do
    total=$((total + $(cut -d' ' -f14 "/proc/$p/stat") + $(cut -d' ' -f15 "/proc/$p/stat")))
  done
  echo "$total"
}
echo "# bench/pinned_cpu.sh $DUR $ROUNDS $*; $(git rev-parse --short HEAD); load $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$ROUNDS"); do
  for name in "${NAMES[@]}"; do
    wrk -t1 -c32 -d"$((DUR + 2))s" -s bench/wrk/post.lua "${URL[$name]}/v1/chat/completions" >"$WORK/wrk.txt" & W=$!
    sleep 1
    t0=$(cpu_of "${PID[$name]}")
    sleep "$DUR"
    t1=$(cpu_of "${PID[$name]}")
    wait "$W"
    if grep -q "Non-2xx" "$WORK/wrk.txt"; then echo "pinned_cpu.sh: $name answered non-2xx" >&2; exit 1; fi
    rps=$(awk '/Requests\/sec/{print $2}' "$WORK/wrk.txt")
    python3 -c "import sys; n=float(sys.argv[2])*float(sys.argv[3]); print(f'{sys.argv[1]} rps={float(sys.argv[2]):.0f} cpu_us={(int(sys.argv[5])-int(sys.argv[4]))*1e6/int(sys.argv[6])/n:.2f}')" \
      "$name" "$rps" "$DUR" "$t0" "$t1" "$(getconf CLK_TCK)" | tee -a "$WORK/rows.txt"
  done
done
bench/paired_rows.py "$WORK/rows.txt" cpu_us nginx
