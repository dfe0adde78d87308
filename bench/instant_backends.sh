# Sourced by bench/profile_proxy.sh and bench/ab_cpu.sh: two "instant" vLLM-shaped backends, one
# nginx serving two ports with `return 200` and a chat-completion JSON, a real vLLM 0.32
# `/metrics` page (the poller reads it; a backend without one is not ready), `/health` and
# `/v1/models`.
#
#   start_instant_backends   # needs WORK (a scratch directory) and PIDS (an array); sets B1, B2
#
# Also defines free_port (a free 127.0.0.1 port).
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

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
