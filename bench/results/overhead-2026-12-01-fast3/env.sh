#!/usr/bin/env bash
# start two nginx return-200 backends on 18401/18402 (idempotent)
set -e
W=/tmp/fast3/backend
mkdir -p $W/logs
ANSWER='{"id":"cmpl-bench","object":"chat.completion","model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":48,"completion_tokens":100,"total_tokens":148}}'
MODELS='{"object":"list","data":[{"id":"bench","object":"model","owned_by":"bench"}]}'
printf 'vllm:num_requests_running{model_name="bench"} 0.0\nvllm:num_requests_waiting{model_name="bench"} 0.0\nvllm:kv_cache_usage_perc{model_name="bench"} 0.0\n' > $W/metrics.txt
chmod 755 /tmp/fast3 $W; chmod 644 $W/metrics.txt
S=""
for p in 18401 18402; do S+="server { listen 127.0.0.1:$p reuseport; keepalive_requests 1000000;
 location = /metrics { default_type text/plain; alias $W/metrics.txt; }
 location = /v1/models { default_type application/json; return 200 '$MODELS'; }
 location = /health { return 200 ''; }
 location / { default_type application/json; return 200 '$ANSWER'; } }
"; done
cat > $W/nginx.conf <<NGX
worker_processes 2;
pid $W/nginx.pid;
error_log $W/logs/error.log warn;
events { worker_connections 8192; }
http { access_log off; client_body_buffer_size 16k;
$S}
NGX
nginx -p $W -c $W/nginx.conf -g 'daemon off;' &
echo $! > $W/master.pid
