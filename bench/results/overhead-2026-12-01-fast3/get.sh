#!/usr/bin/env bash
# get.sh BIN|backend PORT PATH [args]: GET PATH under wrk -c64 6 s; CPU per 1k requests of the server
BIN=$1; PORT=$2; P=$3; shift 3
if [ "$BIN" = backend ]; then
  PIDS=$(pgrep -P $(cat /tmp/fast3/backend/master.pid)); PORT=18401
else
  $BIN --listen 127.0.0.1:$PORT --backend http://127.0.0.1:18401 --backend http://127.0.0.1:18402 "$@" >/tmp/fast3/lb-$PORT.log 2>&1 & PID=$!; PIDS=$PID
  for i in $(seq 100); do curl -sf -o /dev/null http://127.0.0.1:$PORT/ready && break; sleep 0.1; done
fi
cpu() { for p in $PIDS; do awk "{print \$14+\$15}" /proc/$p/stat; done | paste -sd+ | bc; }
ut() { for p in $PIDS; do awk "{print \$14}" /proc/$p/stat; done | paste -sd+ | bc; }
t0=$(cpu); u0=$(ut)
OUT=$(wrk -t2 -c64 -d6s http://127.0.0.1:$PORT$P)
t1=$(cpu); u1=$(ut)
REQ=$(echo "$OUT" | awk '/requests in/{print $1}')
T=$(getconf CLK_TCK)
echo "$(basename $BIN) GET $P $* requests=$REQ rps=$(echo "$OUT" | awk '/Requests\/sec/{print $2}') non2xx=$(echo "$OUT" | awk '/Non-2xx/{print $NF}') user_ms_per_1k=$(python3 -c "print(round(($u1-$u0)*1000/$T/$REQ*1000,1))") cpu_ms_per_1k=$(python3 -c "print(round(($t1-$t0)*1000/$T/$REQ*1000,1))") load=$(cut -d' ' -f1-3 /proc/loadavg)"
[ -n "${PID:-}" ] && { kill $PID; wait $PID 2>/dev/null; }
