# Sourced by the proxy benches (bench/profile_proxy.sh, ab_cpu.sh, instr_per_request.sh,
# pinned_cpu.sh; overhead.sh for the nginx proxy's configuration, wait_chat and floor_url):
#
#   bench_scratch            # WORK (a scratch directory), PIDS (an array of processes to
#                            # stop) and an EXIT trap that stops them and removes WORK
#   start_instant_backends   # two "instant" vLLM-shaped backends (needs WORK and PIDS; sets
#                            # B1, B2): one nginx serving two ports with `return 200` and a
#                            # chat-completion JSON, a real vLLM 0.32 `/metrics` page (the poller
#                            # reads it; a backend without one is not ready), `/health` and
#                            # `/v1/models`
#   start_sse_backends BIN CHUNKS
#                            # two streaming backends, examples/sse_responder built as BIN,
#                            # CHUNKS SSE events a request (needs WORK and PIDS; sets the array
#                            # SSE_PORTS once both have written their addresses)
#   write_nginx_proxy DIR PORT WORKERS BACKEND_PORT…
#                            # DIR/nginx.conf for nginx as the reference proxy: round robin
#                            # over the backends, keep-alive upstream, no access log, no buffering
#   free_port                # a free 127.0.0.1 port
#   wait_chat URL WHO [TRIES]
#                            # wait until a chat completion through URL answers 2xx, trying
#                            # every 0.1 s, TRIES times (300: 30 s); else name WHO, show the
#                            # tail of WORK/WHO.log if there is one, and exit 1
#   floor_url FILE           # the hyper floor's URL, once it has written its address to FILE
#                            # (waits up to 10 s)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_chat() {
  local _
  for _ in $(seq "${3:-300}"); do
    curl -sf -o /dev/null -H 'content-type: application/json' \
      -d '{"model":"bench","messages":[{"role":"user","content":"hi"}]}' \
      "$1/v1/chat/completions" && return 0
    sleep 0.1
  done
  echo "$(basename "$0"): $2 never answered a chat completion at $1; its log: $(tail -3 "$WORK/$2.log" 2>/dev/null)" >&2
  exit 1
}

floor_url() {
  local _
  for _ in $(seq 100); do [ -s "$1" ] && break; sleep 0.1; done
  echo "http://$(head -1 "$1" 2>/dev/null)"
}

bench_scratch() {
  WORK=$(mktemp -d)
  PIDS=()
  trap bench_cleanup EXIT
}

bench_cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}

write_nginx_proxy() {
  local dir=$1 port=$2 workers=$3 b
  shift 3
  mkdir -p "$dir/logs"
  {
    echo "worker_processes $workers;"
    echo "pid $dir/nginx.pid;"
    echo "error_log $dir/logs/error.log warn;"
    echo "events { worker_connections 8192; }"
    echo "http {"
    # NGINX_ACCESS_LOG=1: nginx's own default, one `combined` line per request written
    # unbuffered to logs/access.log (the like-for-like row against inferlb's access log).
    if [ -n "${NGINX_ACCESS_LOG:-}" ]; then
      echo "  access_log $dir/logs/access.log combined;"
    else
      echo "  access_log off;"
    fi
    echo "  upstream backends {"
    for b in "$@"; do echo "    server 127.0.0.1:$b;"; done
    echo "    keepalive 256;"
    echo "    keepalive_requests 1000000;"
    echo "  }"
    echo "  server {"
    echo "    listen 127.0.0.1:$port;"
    echo "    keepalive_requests 1000000;"
    echo "    location / {"
    echo "      proxy_pass http://backends;"
    echo "      proxy_http_version 1.1;"
    echo "      proxy_set_header Connection \"\";"
    echo "      proxy_buffering off;"
    echo "    }"
    echo "  }"
    echo "}"
  } >"$dir/nginx.conf"
}

start_instant_backends() {
  local answer models b
  answer='{"id":"cmpl-bench","object":"chat.completion","model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":48,"completion_tokens":100,"total_tokens":148}}'
  models='{"object":"list","data":[{"id":"bench","object":"model","owned_by":"bench"}]}'
  B1=$(free_port); B2=$(free_port)
  mkdir -p "$WORK/logs"
  chmod 755 "$WORK"
  cp ../shared/vllm-metrics/vllm-0.32-cpu.txt "$WORK/metrics.txt" 2>/dev/null \
    || printf 'vllm:num_requests_running{model_name="bench"} 0.0\nvllm:num_requests_waiting{model_name="bench"} 0.0\nvllm:kv_cache_usage_perc{model_name="bench"} 0.0\n' >"$WORK/metrics.txt"
  chmod 644 "$WORK/metrics.txt"
  {
    echo "worker_processes 1; pid $WORK/nginx.pid; error_log $WORK/logs/error.log warn;"
    echo "events { worker_connections 8192; } http { access_log off;"
    for b in $B1 $B2; do
      echo "server { listen 127.0.0.1:$b; keepalive_requests 1000000;"
      echo "  location = /metrics { default_type text/plain; alias $WORK/metrics.txt; }"
      echo "  location = /health { return 200 ''; }"
      echo "  location = /v1/models { default_type application/json; return 200 '$models'; }"
      echo "  location / { default_type application/json; return 200 '$answer'; } }"
    done
    echo "}"
  } >"$WORK/nginx.conf"
  nginx -p "$WORK" -c "$WORK/nginx.conf" -g 'daemon off;' &
  PIDS+=($!)
}

start_sse_backends() {
  local i _
  SSE_PORTS=()
  for i in 1 2; do
    "$1" 127.0.0.1:0 "$2" >"$WORK/sse$i.addr" 2>"$WORK/sse$i.log" &
    PIDS+=($!)
    for _ in $(seq 100); do [ -s "$WORK/sse$i.addr" ] && break; sleep 0.1; done
    SSE_PORTS+=("$(sed 's/.*://' "$WORK/sse$i.addr")")
  done
}
