#!/usr/bin/env bash
# CPU and syscalls per proxied request, two or more inferlb binaries side by side (and the bare
# hyper proxy of examples/hyper_floor.rs): what bench/overhead.sh measures, narrowed to the
# question "did this change make a request cheaper, and where".
#
#   bench/ab_cpu.sh [SECONDS=5] [ROUNDS=6] NAME=BINARY [NAME=BINARY…]
#   FLOOR=1 bench/ab_cpu.sh 5 6 new=target/dist/inferlb       # with the hyper-floor row
#   EVENTS=syscalls:sys_enter_write,syscalls:sys_enter_futex bench/ab_cpu.sh 5 1 new=…
#
# Every binary proxies to the same two nginx `return 200` backends (bench/instant_backends.sh,
# as bench/profile_proxy.sh uses them). Each round drives every binary in turn with wrk -t2
# -c64 non-streaming (bench/wrk/post.lua) and, over a SECONDS window that starts a second
# into wrk's run, reads the proxy's user and system CPU from /proc/PID/stat and counts context
# switches and syscalls with `perf stat` (plus EVENTS). Requests in the window are wrk's rate times SECONDS, so the
# per-request figures are approximate in the same way for every row. Single rounds on 2 shared
# cores spread by ±15 %; the last lines give each row's medians and, per round, each row's
# user+sys against the first row's (the paired ratio), whose median is the figure to quote.
# Needs nginx, wrk and perf (Debian: nginx-light wrk linux-perf); builds nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-5}
ROUNDS=${2:-6}
shift 2 || { echo "usage: bench/ab_cpu.sh SECONDS ROUNDS NAME=BINARY…" >&2; exit 2; }
[ $# -ge 1 ] || { echo "usage: bench/ab_cpu.sh SECONDS ROUNDS NAME=BINARY…" >&2; exit 2; }
for c in nginx wrk perf python3 curl; do command -v "$c" >/dev/null || { echo "ab_cpu.sh: needs $c" >&2; exit 1; }; done
FLOOR_BIN=${FLOOR_BIN:-target/dist/examples/hyper_floor}
# shellcheck source=bench/instant_backends.sh
. bench/instant_backends.sh
bench_scratch
start_instant_backends
declare -A PID URL
NAMES=()
for spec in "$@"; do
  name=${spec%%=*}; bin=${spec#*=}
  [ -x "$bin" ] || { echo "ab_cpu.sh: $bin is not an executable" >&2; exit 1; }
  port=$(free_port)
  "$bin" --listen "127.0.0.1:$port" --backend "http://127.0.0.1:$B1" --backend "http://127.0.0.1:$B2" \
    >"$WORK/$name.log" 2>&1 & PID[$name]=$!; PIDS+=($!)
  URL[$name]="http://127.0.0.1:$port"
  NAMES+=("$name")
done
if [ -n "${FLOOR:-}" ]; then
  [ -x "$FLOOR_BIN" ] || { echo "ab_cpu.sh: no $FLOOR_BIN (cargo build --profile dist --example hyper_floor)" >&2; exit 1; }
  "$FLOOR_BIN" 127.0.0.1:0 "127.0.0.1:$B1" "127.0.0.1:$B2" >"$WORK/floor.addr" 2>"$WORK/floor.log" & PID[floor]=$!; PIDS+=($!)
  NAMES+=(floor)
fi
# Every proxy answers a chat completion before any round (a backend is ready once polled).
for name in "${NAMES[@]}"; do
  [ "$name" = floor ] && URL[floor]=$(floor_url "$WORK/floor.addr")
  wait_chat "${URL[$name]}" "$name"
done
echo "# bench/ab_cpu.sh $DUR $ROUNDS $*; $(git rev-parse --short HEAD); load $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$ROUNDS"); do
  for name in "${NAMES[@]}"; do
    pid=${PID[$name]}
    wrk -t2 -c64 -d"$((DUR + 2))s" -s bench/wrk/post.lua "${URL[$name]}/v1/chat/completions" >"$WORK/wrk.txt" & W=$!
    # The window starts once wrk's connections are open and ends before wrk stops.
    sleep 1
    t0=$(cut -d' ' -f14,15 "/proc/$pid/stat")
    perf stat -x, -e "task-clock,context-switches,raw_syscalls:sys_enter${EVENTS:+,$EVENTS}" -p "$pid" -o "$WORK/stat.txt" -- sleep "$DUR"
    t1=$(cut -d' ' -f14,15 "/proc/$pid/stat")
    wait "$W"
    if grep -q "Non-2xx" "$WORK/wrk.txt"; then echo "ab_cpu.sh: $name answered non-2xx" >&2; exit 1; fi
    python3 - "$WORK/stat.txt" "$name" "$(awk '/Requests\/sec/{print $2}' "$WORK/wrk.txt")" "$DUR" "$t0" "$t1" "$(getconf CLK_TCK)" <<'PY' | tee -a "$WORK/rows.txt"
import sys
path, name, rps, dur, t0, t1, tck = sys.argv[1:]
n = float(rps) * float(dur)
(u0, s0), (u1, s1) = (map(int, t.split()) for t in (t0, t1))
us = 1e6 / int(tck) / n
out = [f"{name} rps={float(rps):.0f} user_us={(u1 - u0) * us:.1f} sys_us={(s1 - s0) * us:.1f} total_us={(u1 - u0 + s1 - s0) * us:.1f}"]
for line in open(path):
    p = line.strip().split(",")
    if len(p) < 3 or not p[0] or p[0].startswith("<") or p[2] == "task-clock":
        continue
    out.append(f"{p[2]}={float(p[0]) / n:.2f}")
print(" ".join(out))
PY
  done
done
bench/paired_rows.py "$WORK/rows.txt" total_us
