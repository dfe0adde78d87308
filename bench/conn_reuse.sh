#!/usr/bin/env bash
# Connection reuse to backends under wrk: how many TCP connections inferlb opens to its backends
# for how many requests. Two nginx backends (`return 200` with a chat-completion JSON, as in
# bench/overhead.sh) count the connections they accept (`stub_status`); `ss` samples the
# established connections from inferlb to them in the middle of the run.
#
#   bench/conn_reuse.sh OUT_MD [SECONDS=10] [CONNECTIONS=64]
#
# Needs wrk and nginx (apt-get install -y wrk nginx-light) and target/release/inferlb.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bench/conn_reuse.sh OUT_MD [SECONDS] [CONNECTIONS]}
DUR=${2:-10}
CONN=${3:-64}
LB=${LB:-target/release/inferlb}
WORK=$(mktemp -d)
chmod 755 "$WORK"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

PORTS=("$(free_port)" "$(free_port)")
STATUS=$(free_port)
ANSWER='{"id":"cmpl-bench","object":"chat.completion","model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":48,"completion_tokens":100,"total_tokens":148}}'
MODELS='{"object":"list","data":[{"id":"bench","object":"model","owned_by":"bench"}]}'
printf 'vllm:num_requests_running{model_name="bench"} 0.0\nvllm:num_requests_waiting{model_name="bench"} 0.0\nvllm:kv_cache_usage_perc{model_name="bench"} 0.0\n' >"$WORK/metrics.txt"
chmod 644 "$WORK/metrics.txt"
SERVERS=""
for p in "${PORTS[@]}"; do
  SERVERS+="  server {
    listen 127.0.0.1:$p;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    location = /metrics { default_type text/plain; alias $WORK/metrics.txt; }
    location = /v1/models { default_type application/json; return 200 '$MODELS'; }
    location = /health { return 200 ''; }
    location / { default_type application/json; return 200 '$ANSWER'; }
  }
"
done
mkdir -p "$WORK/logs"
# One worker, so stub_status counts every connection of both servers in one place.
cat >"$WORK/nginx.conf" <<NGX
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/logs/error.log warn;
events { worker_connections 8192; }
http {
  access_log off;
  client_body_buffer_size 16k;
  server { listen 127.0.0.1:$STATUS; location / { stub_status; } }
$SERVERS}
NGX
nginx -p "$WORK" -c "$WORK/nginx.conf" -g 'daemon off;' &
PIDS+=($!)
P=$(free_port)
"$LB" --listen "127.0.0.1:$P" --backend "http://127.0.0.1:${PORTS[0]}" --backend "http://127.0.0.1:${PORTS[1]}" >"$WORK/inferlb.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 300); do curl -sf -o /dev/null "http://127.0.0.1:$P/ready" && break; sleep 0.1; done
accepts() { curl -s "http://127.0.0.1:$STATUS/" | awk 'NR==3 {print $1}'; }
handled_requests() { curl -s "http://127.0.0.1:$STATUS/" | awk 'NR==3 {print $3}'; }
established() { # connections from anything to the two backend ports, established now
  ss -Htn state established "( dport = :${PORTS[0]} or dport = :${PORTS[1]} )" | wc -l
}
# Warm-up (opens the pool), then the measured run.
wrk -t2 -c"$CONN" -d2s -s bench/wrk/post.lua "http://127.0.0.1:$P/v1/chat/completions" >/dev/null
A0=$(accepts); R0=$(handled_requests)
wrk -t2 -c"$CONN" -d"${DUR}s" -s bench/wrk/post.lua "http://127.0.0.1:$P/v1/chat/completions" >"$WORK/wrk.txt" &
WRK=$!
sleep "$((DUR / 2))"
MID=$(established)
wait "$WRK"
A1=$(accepts); R1=$(handled_requests)
SENT=$(awk '/requests in/ {print $1}' "$WORK/wrk.txt")
NON2XX=$(awk '/Non-2xx/ {print $NF}' "$WORK/wrk.txt")
NEW=$((A1 - A0)); BACKEND_REQ=$((R1 - R0))
{
  echo "# Connection reuse to backends under wrk — $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "- command: \`bench/conn_reuse.sh $OUT $DUR $CONN\`"
  echo "- source: commit $(git rev-parse HEAD); binary \`$LB\`"
  echo "- machine: nproc $(nproc), load average at start $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "- wrk -t2 -c$CONN -d${DUR}s (bench/wrk/post.lua, non-streaming chat) through inferlb to 2 nginx backends, after a 2 s warm-up"
  echo
  echo "| measure | value |"
  echo "| --- | --- |"
  echo "| requests answered to wrk | $SENT (non-2xx: ${NON2XX:-0}) |"
  echo "| requests the backends handled (incl. the poller's) | $BACKEND_REQ |"
  echo "| new backend connections accepted during the run | $NEW |"
  echo "| requests per new backend connection | $( [ "$NEW" -gt 0 ] && echo $((BACKEND_REQ / NEW)) || echo "all on connections opened in the warm-up" ) |"
  echo "| established connections to the backends, mid-run (\`ss\`) | $MID |"
  echo
  echo '```'
  cat "$WORK/wrk.txt"
  echo '```'
} | tee "$OUT"
