#!/usr/bin/env bash
# N inferlb replicas (default profile, same backends) behind one nginx round-robin front on
# PORT: the shape of several router replicas behind a Kubernetes Service. Used by
# bench/replicas.sh through `loadgen compare --router-cmd`; stops everything on SIGTERM.
# Usage: bench/replica_front.sh N PORT WORKER_URL...
# EXTRA_CONFIG=FILE appends FILE (a config fragment: a profile, [kv_events], …) to every replica's config.
# PORTS_FILE=FILE writes each replica's own port there, one per line (to read its /metrics).
set -euo pipefail
cd "$(dirname "$0")/.."
N=$1; PORT=$2; shift 2
BIN=${INFERLB_BIN:-target/release/inferlb}
DIR=$(mktemp -d /tmp/inferlb-replicas.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
trap 'exit 0' TERM INT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
upstreams=""
for i in $(seq 1 "$N"); do
  p=$(free_port)
  {
    echo "listen = \"127.0.0.1:$p\""
    echo "log_level = \"warn\""
    for w in "$@"; do echo "[[backends]]"; echo "url = \"$w\""; done
    [ -z "${EXTRA_CONFIG:-}" ] || cat "$EXTRA_CONFIG"
  } > "$DIR/r$i.toml"
  "$BIN" --config "$DIR/r$i.toml" &
  pids+=($!)
  upstreams+="    server 127.0.0.1:$p;"$'\n'
  [ -z "${PORTS_FILE:-}" ] || echo "$p" >> "$PORTS_FILE"
done
cat > "$DIR/nginx.conf" <<CONF
worker_processes 1;
pid $DIR/nginx.pid;
error_log $DIR/error.log;
events { worker_connections 4096; }
http {
  access_log off;
  upstream replicas {
$upstreams    keepalive 64;
  }
  server {
    listen 127.0.0.1:$PORT;
    location / {
      proxy_pass http://replicas;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 600s;
    }
  }
}
CONF
nginx -c "$DIR/nginx.conf" -g 'daemon off;' &
pids+=($!)
wait
