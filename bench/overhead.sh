#!/usr/bin/env bash
# Proxy overhead, driven by wrk (C, epoll; not the bottleneck: the `direct` row shows it).
#
# Rows, all in one run and interleaved per repetition: direct (wrk → one backend), nginx
# (round robin, keep-alive upstream, worker_processes = cores), inferlb (default profile,
# default log level), hyper-floor (`examples/hyper_floor.rs`: a bare hyper proxy with inferlb's
# worker model and nothing else, the floor of the stack inferlb is built on), and SGLang's and vLLM's routers when bench/.venv has them
# (`python3 -m venv bench/.venv && bench/.venv/bin/pip install sglang-router vllm-router`).
# Backends (2): nginx `return 200` with a chat-completion JSON for non-streaming; for
# streaming, `examples/sse_responder.rs` (100 SSE events per request, each its own chunk,
# written as fast as the client reads). wrk POSTs a chat-completion body (bench/wrk/post.lua).
#
# Every cell is run REPS times; the table gives medians (and the range of the ratios). Beside
# requests/s, each proxy's CPU per 1,000 requests: its processes' utime + stime (from
# /proc/PID/stat, the nginx proxy's master and workers summed) over the wrk run, divided by the
# requests wrk completed; on shared cores it is steadier than requests/s.
# LIKE_FOR_LIKE=1 adds `inferlb-nolog` and `nginx-log` (see below): each proxy logging as the
# other does, since the nginx row runs with `access_log off` and inferlb's default logs every
# request.
# Usage: bench/overhead.sh [SECONDS=10] [CONNECTIONS=64] [REPS=3] [LABEL]
# Writes bench/results/overhead-<date>[-LABEL].md (and a .json of every run).
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-10}
CONN=${2:-64}
REPS=${3:-3}
LABEL=${4:-}
NPROC=$(nproc)
WRK_THREADS=${WRK_THREADS:-2}
VENV=bench/.venv

need() { # COMMAND PACKAGE
  command -v "$1" >/dev/null && return 0
  apt-get install -y "$2" >/dev/null 2>&1 \
    || { apt-get update >/dev/null && apt-get install -y "$2" >/dev/null; } \
    || { echo "overhead.sh: $1 is required (apt-get install -y $2)" >&2; exit 1; }
}
need wrk wrk
need nginx nginx-light
NGINX=$(command -v nginx)

if [ -z "${NO_BUILD:-}" ]; then
  # The production profile (Cargo.toml's [profile.dist]: LTO), as the image ships it.
  cargo build --profile dist --all-features -p inferlb --bin inferlb --example sse_responder \
    --example hyper_floor
fi
LB=${LB:-target/dist/inferlb}
SSE=${SSE:-target/dist/examples/sse_responder}
FLOOR=${FLOOR:-target/dist/examples/hyper_floor}

WORK=$(mktemp -d)
chmod 755 "$WORK"   # nginx workers (user nobody) read the metrics page from it
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  [ -n "${KEEP:-}" ] && echo "kept $WORK" >&2 || rm -rf "$WORK"
}
trap cleanup EXIT

# free_port and write_nginx_proxy (the nginx proxy row's configuration, shared with
# bench/pinned_cpu.sh)
# shellcheck source=bench/instant_backends.sh
. bench/instant_backends.sh
wait_http() { # URL [METHOD]: wait (≤ 30 s) until it answers 2xx
  for _ in $(seq 300); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done
  echo "overhead.sh: $1 never became ready" >&2; exit 1
}

# --- backends -------------------------------------------------------------------------
WHOLE_PORTS=("$(free_port)" "$(free_port)")
mkdir -p "$WORK/backend/logs" "$WORK/proxy/logs"
ANSWER='{"id":"cmpl-bench","object":"chat.completion","model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":48,"completion_tokens":100,"total_tokens":148}}'
MODELS='{"object":"list","data":[{"id":"bench","object":"model","owned_by":"bench"}]}'
cp /work/shared/vllm-metrics/vllm-0.32-cpu.txt "$WORK/backend/metrics.txt" 2>/dev/null \
  || printf 'vllm:num_requests_running{model_name="bench"} 0.0\nvllm:num_requests_waiting{model_name="bench"} 0.0\nvllm:kv_cache_usage_perc{model_name="bench"} 0.0\n' >"$WORK/backend/metrics.txt"
SERVERS=""
chmod 644 "$WORK/backend/metrics.txt"
for p in "${WHOLE_PORTS[@]}"; do
  SERVERS+="  server {
    listen 127.0.0.1:$p reuseport;
    keepalive_requests 1000000;
    location = /metrics { default_type text/plain; alias $WORK/backend/metrics.txt; }
    location = /v1/models { default_type application/json; return 200 '$MODELS'; }
    location = /health { return 200 ''; }
    location / { default_type application/json; return 200 '$ANSWER'; }
  }
"
done
cat >"$WORK/backend/nginx.conf" <<NGX
worker_processes $NPROC;
pid $WORK/backend/nginx.pid;
error_log $WORK/backend/logs/error.log warn;
events { worker_connections 8192; }
http {
  access_log off;
  client_body_buffer_size 16k;
$SERVERS}
NGX
"$NGINX" -p "$WORK/backend" -c "$WORK/backend/nginx.conf" -g 'daemon off;' &
PIDS+=($!)
start_sse_backends "$SSE" 100
STREAM_PORTS=("${SSE_PORTS[@]}")
for p in "${WHOLE_PORTS[@]}" "${STREAM_PORTS[@]}"; do wait_http "http://127.0.0.1:$p/v1/models"; done

# --- proxies: one instance per backend kind ---------------------------------------------
declare -A URL   # URL[row-mode]
declare -A CPU_PID   # CPU_PID[row-mode]: the proxy's main process (its children are counted too)
for mode in whole stream; do
  if [ "$mode" = whole ]; then PORTS=("${WHOLE_PORTS[@]}"); else PORTS=("${STREAM_PORTS[@]}"); fi
  URL[direct-$mode]="http://127.0.0.1:${PORTS[0]}"
  WORKERS=""; FLAGS=()
  for p in "${PORTS[@]}"; do
    FLAGS+=(--backend "http://127.0.0.1:$p")
    WORKERS+=" http://127.0.0.1:$p"
  done

  P=$(free_port)
  "$LB" --listen "127.0.0.1:$P" "${FLAGS[@]}" >"$WORK/inferlb-$mode.log" 2>&1 &
  PIDS+=($!)
  echo "$!" >"$WORK/inferlb-$mode.pid"
  CPU_PID[inferlb-$mode]=$!
  URL[inferlb-$mode]="http://127.0.0.1:$P"
  # LB_PREV=path/to/an/older/inferlb adds a row `inferlb-prev`: before/after in one run.
  if [ -n "${LB_PREV:-}" ]; then
    P=$(free_port)
    "$LB_PREV" --listen "127.0.0.1:$P" "${FLAGS[@]}" >"$WORK/inferlb-prev-$mode.log" 2>&1 &
    PIDS+=($!)
    CPU_PID[inferlb-prev-$mode]=$!
    URL[inferlb-prev-$mode]="http://127.0.0.1:$P"
  fi

  # LIKE_FOR_LIKE=1 adds two rows that log as the other proxy does: `inferlb-nolog` (inferlb
  # with its access log off, as the nginx row runs) and `nginx-log` (nginx with its default
  # access log, one line per request, as inferlb's default does).
  if [ -n "${LIKE_FOR_LIKE:-}" ]; then
    P=$(free_port)
    "$LB" --listen "127.0.0.1:$P" "${FLAGS[@]}" --log-level info,inferlb::access=off \
      >"$WORK/inferlb-nolog-$mode.log" 2>&1 &
    PIDS+=($!)
    CPU_PID[inferlb-nolog-$mode]=$!
    URL[inferlb-nolog-$mode]="http://127.0.0.1:$P"
    P=$(free_port)
    NGINX_ACCESS_LOG=1 write_nginx_proxy "$WORK/proxy-log-$mode" "$P" "$NPROC" "${PORTS[@]}"
    "$NGINX" -p "$WORK/proxy-log-$mode" -c "$WORK/proxy-log-$mode/nginx.conf" -g 'daemon off;' &
    PIDS+=($!)
    CPU_PID[nginx-log-$mode]=$!
    URL[nginx-log-$mode]="http://127.0.0.1:$P"
  fi

  # The floor is a non-streaming reference only: streamed through it, 100 chunks took 40 ms
  # (p50) and 9 x nginx's CPU, a defect of the example, not of hyper (inferlb streams at par).
  if [ "$mode" = whole ] && [ -z "${NO_FLOOR:-}" ] && [ -x "$FLOOR" ]; then
    # shellcheck disable=SC2046
    "$FLOOR" 127.0.0.1:0 $(printf '127.0.0.1:%s ' "${PORTS[@]}") >"$WORK/floor-$mode.addr" \
      2>"$WORK/floor-$mode.log" &
    PIDS+=($!)
    CPU_PID[hyper-floor-$mode]=$!
    URL[hyper-floor-$mode]=$(floor_url "$WORK/floor-$mode.addr")
  fi

  P=$(free_port)
  write_nginx_proxy "$WORK/proxy-$mode" "$P" "$NPROC" "${PORTS[@]}"
  "$NGINX" -p "$WORK/proxy-$mode" -c "$WORK/proxy-$mode/nginx.conf" -g 'daemon off;' &
  PIDS+=($!)
  CPU_PID[nginx-$mode]=$!
  URL[nginx-$mode]="http://127.0.0.1:$P"

  # The two public Rust routers, with their LLM-aware policy (as inferlb's default profile is).
  if [ -z "${NO_EXTERNAL:-}" ] && "$VENV/bin/python" -c 'import sglang_router' 2>/dev/null; then
    P=$(free_port); M=$(free_port)
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m sglang_router.launch_router --worker-urls $WORKERS --policy cache_aware \
      --host 127.0.0.1 --port "$P" --prometheus-host 127.0.0.1 --prometheus-port "$M" \
      >"$WORK/sglang-$mode.log" 2>&1 &
    PIDS+=($!)
    CPU_PID[sglang-$mode]=$!
    URL[sglang-$mode]="http://127.0.0.1:$P"
  fi
  if [ -z "${NO_EXTERNAL:-}" ] && [ -x "$VENV/bin/vllm-router" ]; then
    P=$(free_port); M=$(free_port)
    # shellcheck disable=SC2086
    "$VENV/bin/vllm-router" --worker-urls $WORKERS --policy cache_aware \
      --host 127.0.0.1 --port "$P" --prometheus-host 127.0.0.1 --prometheus-port "$M" \
      >"$WORK/vllm-router-$mode.log" 2>&1 &
    PIDS+=($!)
    CPU_PID[vllm-router-$mode]=$!
    URL[vllm-router-$mode]="http://127.0.0.1:$P"
  fi
done
ROWS=(direct nginx inferlb)
[ -n "${URL[inferlb-prev-whole]:-}" ] && ROWS+=(inferlb-prev)
[ -n "${URL[hyper-floor-whole]:-}" ] && ROWS+=(hyper-floor)
[ -n "${URL[inferlb-nolog-whole]:-}" ] && ROWS+=(inferlb-nolog nginx-log)
# NO_EXTERNAL=1 leaves SGLang's and vLLM's routers out (quicker A/B runs of inferlb).
if [ -z "${NO_EXTERNAL:-}" ]; then
  [ -n "${URL[sglang-whole]:-}" ] && ROWS+=(sglang)
  [ -n "${URL[vllm-router-whole]:-}" ] && ROWS+=(vllm-router)
fi
for mode in whole stream; do
  for r in "${ROWS[@]}"; do
    [ -n "${URL[$r-$mode]:-}" ] && wait_chat "${URL[$r-$mode]}" "$r-$mode"
  done
done

# CPU ticks (utime + stime, 1/CLK_TCK s) of a process and its children (nginx's workers).
cpu_ticks() { # PID
  local total=0 t
  for q in "$1" $(pgrep -P "$1" || true); do
    # Fields after "pid (comm) ": state is the 1st, utime the 12th, stime the 13th.
    t=$(sed 's/^.*) //' "/proc/$q/stat" 2>/dev/null | awk '{print $12 + $13}') || t=0
    total=$((total + ${t:-0}))
  done
  echo "$total"
}
getconf CLK_TCK >"$WORK/clk_tck"

# --- runs --------------------------------------------------------------------------------
LOAD_BEFORE=$(uptime)
for rep in $(seq "$REPS"); do
  for mode in whole stream; do
    [ "$mode" = stream ] && S=true || S=false
    for r in "${ROWS[@]}"; do
      [ -n "${URL[$r-$mode]:-}" ] || continue
      PID=${CPU_PID[$r-$mode]:-}
      [ -n "$PID" ] && BEFORE=$(cpu_ticks "$PID")
      STREAM=$S wrk -t"$WRK_THREADS" -c"$CONN" -d"${DUR}s" --latency -s bench/wrk/post.lua \
        "${URL[$r-$mode]}/v1/chat/completions" >"$WORK/$r-$mode-$rep.txt" 2>&1 || true
      [ -n "$PID" ] && echo $(($(cpu_ticks "$PID") - BEFORE)) >"$WORK/$r-$mode-$rep.cpu"
      echo "rep $rep $mode $r: $(grep -E 'Requests/sec' "$WORK/$r-$mode-$rep.txt" || echo failed)" >&2
    done
  done
done
LOAD_AFTER=$(uptime)
RSS=$(for mode in whole stream; do ps -o rss= -p "$(cat "$WORK/inferlb-$mode.pid")" | tr -d ' '; done | paste -sd/)

DATE=$(date -u +%Y-%m-%d)
OUT=bench/results/overhead-$DATE${LABEL:+-$LABEL}.md
mkdir -p bench/results
NGINX_VERSION=$("$NGINX" -v 2>&1 | sed 's/^nginx version: //')
WRK_VERSION=$( (wrk -v 2>&1 || true) | head -1 | awk '{print $2}')
EXT=""
for pkg in sglang-router vllm-router; do
  v=$("$VENV/bin/pip" show "$pkg" 2>/dev/null | sed -n 's/^Version: //p' || true)
  [ -n "$v" ] && EXT+="$pkg $v; "
done
python3 bench/provenance.py --note "nginx: $NGINX_VERSION; wrk $WRK_VERSION; ${EXT:-no external routers}" "$LB" ${LB_PREV:+"$LB_PREV"} "$SSE" ${URL[hyper-floor-whole]:+"$FLOOR"} >"$WORK/provenance.md"
python3 bench/overhead_table.py "$WORK" "$OUT" "$DUR" "$CONN" "$REPS" "$WRK_THREADS" "$LOAD_BEFORE" "$LOAD_AFTER" "$RSS" "${ROWS[@]}"
echo "wrote $OUT"
