#!/usr/bin/env bash
# Where inferlb's CPU goes on the non-streaming proxy path: `perf record` of the dist build
# while wrk drives it as bench/overhead.sh does (64 connections, bench/wrk/post.lua, two nginx
# `return 200` backends), then the top symbols by self time, user-space and kernel apart.
#
#   bench/profile_proxy.sh [SECONDS] > profile.txt     # default 10; builds nothing
#   CALL_GRAPH=dwarf PERF_DATA=/tmp/p.data bench/profile_proxy.sh 5   # callers of libc symbols too
#
# Needs target/dist/inferlb (cargo build --profile dist --all-features -p inferlb --bin
# inferlb), nginx, wrk and perf (Debian: nginx wrk linux-perf). Run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-10}
LB=${LB:-target/dist/inferlb}
for c in nginx wrk perf; do command -v "$c" >/dev/null || { echo "profile_proxy.sh: needs $c" >&2; exit 1; }; done
[ -x "$LB" ] || { echo "profile_proxy.sh: no $LB (build the dist profile first)" >&2; exit 1; }
# shellcheck source=bench/instant_backends.sh
. bench/instant_backends.sh
bench_scratch
start_instant_backends
P=$(free_port)
"$LB" --listen "127.0.0.1:$P" --backend "http://127.0.0.1:$B1" --backend "http://127.0.0.1:$B2" \
  >"$WORK/inferlb.log" 2>&1 & LBPID=$!; PIDS+=($LBPID)
for _ in $(seq 300); do
  curl -sf -o /dev/null -H 'content-type: application/json' \
    -d '{"model":"bench","messages":[{"role":"user","content":"hi"}]}' \
    "http://127.0.0.1:$P/v1/chat/completions" && break
  sleep 0.1
done
wrk -t2 -c64 -d"$((DUR + 4))s" -s bench/wrk/post.lua "http://127.0.0.1:$P/v1/chat/completions" >"$WORK/wrk.txt" & WRK=$!
# let wrk's connections open before sampling
perf record -q -F 999 --call-graph "${CALL_GRAPH:-fp}" -p "$LBPID" -o "$WORK/perf.data" -- sleep "$DUR" 2>/dev/null
wait "$WRK"
if grep -q "Non-2xx" "$WORK/wrk.txt"; then
  echo "profile_proxy.sh: the proxy answered non-2xx; its log: $(tail -3 "$WORK/inferlb.log")" >&2; exit 1
fi
echo "# perf profile of $LB under wrk -t2 -c64 (bench/wrk/post.lua), $DUR s; $(git rev-parse --short HEAD); load $(cut -d' ' -f1-3 /proc/loadavg)"
grep -E "Requests/sec|Non-2xx|Socket errors" "$WORK/wrk.txt"
echo
echo "## user-space symbols by self time (share of all samples)"
perf report -i "$WORK/perf.data" --no-children --sort sym --percent-limit 0.5 --stdio -g none 2>/dev/null \
  | grep -v '^#' | grep -v '^$' | grep -v '\[k\]' | head -60
# PERF_DATA=path keeps the recording (for perf report -G on one symbol)
[ -n "${PERF_DATA:-}" ] && cp "$WORK/perf.data" "$PERF_DATA"
echo
echo "## kernel and user-space shares"
perf report -i "$WORK/perf.data" --no-children --sort sym --stdio -g none 2>/dev/null \
  | grep -E '^ +[0-9]' | awk '/\[k\]/ {k+=$1; next} {u+=$1} END {printf "kernel symbols: %.1f %% of samples, user-space %.1f %%\n", k, u}'
