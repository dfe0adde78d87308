#!/usr/bin/env bash
# sctx.sh BIN|nginx PORT [args]: streaming (STREAM=true, sse_responder backends 18403/18404, 100 events) CPU per request
BIN=$1; PORT=$2; shift 2
if [ "$BIN" = nginx ]; then
  nginx -p /tmp/fast3/sproxy -c /tmp/fast3/sproxy/nginx.conf -g 'daemon off;' >/dev/null 2>&1 & PID=$!; PORT=18421; sleep 0.5; PIDS=$(pgrep -P $PID)
else
  $BIN --listen 127.0.0.1:$PORT --backend http://127.0.0.1:18403 --backend http://127.0.0.1:18404 "$@" >/tmp/fast3/lb-$PORT.log 2>&1 & PID=$!; PIDS=$PID
fi
for i in $(seq 100); do curl -sf -o /dev/null -H 'content-type: application/json' -d '{"model":"bench","messages":[{"role":"user","content":"hi"}]}' http://127.0.0.1:$PORT/v1/chat/completions && break; sleep 0.1; done
cpu() { for p in $PIDS; do awk "{print \$14+\$15}" /proc/$p/stat; done | paste -sd+ | bc; }
ut() { for p in $PIDS; do awk "{print \$14}" /proc/$p/stat; done | paste -sd+ | bc; }
t0=$(cpu); u0=$(ut)
cd /work/wt-fast3
OUT=$(STREAM=true wrk -t2 -c64 -d6s -s bench/wrk/post.lua http://127.0.0.1:$PORT/v1/chat/completions)
t1=$(cpu); u1=$(ut)
REQ=$(echo "$OUT" | awk '/requests in/{print $1}')
T=$(getconf CLK_TCK)
echo "$(basename $BIN) stream $* requests=$REQ rps=$(echo "$OUT" | awk '/Requests\/sec/{print $2}') non2xx=$(echo "$OUT" | awk '/Non-2xx/{print $NF}') user_ms_per_1k=$(python3 -c "print(round(($u1-$u0)*1000/$T/$REQ*1000,1))") cpu_ms_per_1k=$(python3 -c "print(round(($t1-$t0)*1000/$T/$REQ*1000,1))") load=$(cut -d' ' -f1-3 /proc/loadavg)"
kill $PID; wait $PID 2>/dev/null
