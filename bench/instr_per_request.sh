#!/usr/bin/env bash
# User-space instructions per proxied request, counted by valgrind's callgrind: a figure that
# does not move with the machine's load, for A/B steps too small for bench/ab_cpu.sh's ±15 %
# rounds to see. (No hardware counters in this VM, so `perf stat -e instructions` is not an
# option.) Instructions are not time: cache misses, syscalls and the kernel's share are not in
# them, so a step is confirmed with bench/ab_cpu.sh or bench/overhead.sh before it is quoted as
# CPU.
#
#   bench/instr_per_request.sh [SECONDS=15] NAME=BINARY [NAME=BINARY…]
#   FLOOR=1 bench/instr_per_request.sh 15 new=target/release/inferlb   # with the hyper floor
#   TOP=40 bench/instr_per_request.sh 15 new=…   # and each binary's 40 costliest inferlb functions
#   SSE=1 bench/instr_per_request.sh 15 new=…   # streaming: examples/sse_responder backends
#                                      # (SSE_CHUNKS events a request, 100), wrk asking for streams
#   bench/instr_per_request.sh 15 on=BIN "off=BIN --log-level info,inferlb::access=off"
#                                      # words after the binary are its extra arguments
#
# Each binary runs under `valgrind --tool=callgrind --instr-atstart=no` in front of the two
# nginx `return 200` backends of bench/instant_backends.sh, is warmed for 3 s with
# `wrk -t1 -c8` (bench/wrk/post.lua, non-streaming), then counted for SECONDS of the same load
# (instrumentation switched on and off around it with callgrind_control). Requests are wrk's
# count for that window. The poller's work (a timer, not a request's) is taken out: it is the
# inclusive count of `Poller::run`, and under valgrind's ~30× slowdown it would otherwise be a
# tenth of the total. Other work that runs per second, not per request (the log writer's
# flushes, timers), is spread over however many requests valgrind got through, so compare
# binaries in one run on a quiet machine with SECONDS of 12 or more: a 4 s window on a busy
# machine read 77.3k where 12 s on a quiet one read 75.7k for the same binary. Even so, runs
# of one binary have spread by up to 0.75 % (72.3k to 72.9k on 2026-12-07): repeat a
# step below ~1 % before trusting it.
# Needs valgrind, nginx, wrk (Debian: valgrind nginx-light wrk).
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-15}
shift || true
[ $# -ge 1 ] || { echo "usage: bench/instr_per_request.sh SECONDS NAME=BINARY…" >&2; exit 2; }
for c in valgrind callgrind_control callgrind_annotate nginx wrk python3 curl; do
  command -v "$c" >/dev/null || { echo "instr_per_request.sh: needs $c" >&2; exit 1; }
done
FLOOR_BIN=${FLOOR_BIN:-target/dist/examples/hyper_floor}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# shellcheck source=bench/instant_backends.sh
. bench/instant_backends.sh
bench_scratch
if [ -n "${SSE:-}" ]; then
  # Streaming: two examples/sse_responder backends (100 events a request, each its own chunk)
  # in the nginx backends' place, and wrk asks for streams.
  SSE_BIN=${SSE_BIN:-target/release/examples/sse_responder}
  [ -x "$SSE_BIN" ] || { echo "instr_per_request.sh: SSE=1 needs $SSE_BIN (cargo build --release --example sse_responder)" >&2; exit 1; }
  start_sse_backends "$SSE_BIN" "${SSE_CHUNKS:-100}"
  B1=${SSE_PORTS[0]}; B2=${SSE_PORTS[1]}
  export STREAM=true
else
  start_instant_backends
fi
SPECS=("$@")
[ -n "${FLOOR:-}" ] && SPECS+=("floor=$FLOOR_BIN")
echo "# bench/instr_per_request.sh $DUR $*${FLOOR:+ (FLOOR=1)}; $(git rev-parse --short HEAD); callgrind outputs in $OUT"
for spec in "${SPECS[@]}"; do
  name=${spec%%=*}
  read -ra words <<<"${spec#*=}"
  bin=${words[0]}; extra=("${words[@]:1}")
  [ -x "$bin" ] || { echo "instr_per_request.sh: $bin is not an executable" >&2; exit 1; }
  port=$(free_port)
  rm -f "$OUT/$name".*   # a reused OUT must not add an earlier run's counts
  if [ "$name" = floor ]; then
    args=("127.0.0.1:$port" "127.0.0.1:$B1" "127.0.0.1:$B2")
  else
    args=(--listen "127.0.0.1:$port" --backend "http://127.0.0.1:$B1" --backend "http://127.0.0.1:$B2" "${extra[@]}")
  fi
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$OUT/$name.%p" \
    "$bin" "${args[@]}" >"$WORK/$name.log" 2>&1 &
  vg=$!; PIDS+=("$vg")
  url="http://127.0.0.1:$port/v1/chat/completions"
  # Up to 120 s: valgrind starts the binary ~30 × slower.
  wait_chat "http://127.0.0.1:$port" "$name" 1200
  wrk -t1 -c8 -d3s -s bench/wrk/post.lua "$url" >/dev/null
  callgrind_control -i on "$vg" >/dev/null 2>&1
  wrk -t1 -c8 -d"${DUR}s" -s bench/wrk/post.lua "$url" >"$WORK/wrk.txt"
  callgrind_control -i off "$vg" >/dev/null 2>&1
  if grep -q "Non-2xx" "$WORK/wrk.txt"; then echo "instr_per_request.sh: $name answered non-2xx" >&2; exit 1; fi
  requests=$(awk '/requests in/ {print $1}' "$WORK/wrk.txt")
  callgrind_control -d "$vg" >/dev/null 2>&1
  kill "$vg"; wait "$vg" 2>/dev/null || true
  python3 - "$name" "$requests" "${TOP:-0}" "$OUT"/"$name".* <<'PY'
import re, subprocess, sys
name, requests, top, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
total = poller = 0
funcs = {}
for f in files:
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--auto=no", "--threshold=100", f],
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = re.match(r"^\s*([\d,]+) \([^)]*\)\s+(.*)$", line)
        if not m:
            continue
        n, what = int(m.group(1).replace(",", "")), m.group(2)
        if "PROGRAM TOTALS" in what:
            total += n
        elif "inferlb::endpoints::poller::Poller::run::{{closure}} [" in what:
            poller = max(poller, n)
        elif what.startswith("/work") or "src/" in what:
            fn = re.sub(r" \[[^]]*\]$", "", what.split(":", 1)[-1])
            if fn.startswith("inferlb::") or fn.startswith("<inferlb::"):
                funcs[fn] = max(funcs.get(fn, 0), n)
per = (total - poller) / max(requests, 1)
print(f"{name}: {per:,.0f} instructions per request ({requests} requests; poller's {poller / max(total, 1):.1%} of the count taken out)")
for fn, n in sorted(funcs.items(), key=lambda kv: -kv[1])[:top]:
    print(f"    {n / max(requests, 1):>8,.0f}  {fn[:150]}")
PY
done
