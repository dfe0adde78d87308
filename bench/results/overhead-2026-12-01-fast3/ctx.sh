#!/usr/bin/env bash
# ctx.sh BIN|nginx PORT [args]: per-thread voluntary/nonvoluntary context switches across wrk -c64 6 s
BIN=$1; PORT=$2; shift 2
if [ "$BIN" = nginx ]; then
  nginx -p /tmp/fast3/proxy -c /tmp/fast3/proxy/nginx.conf -g 'daemon off;' >/dev/null 2>&1 & PID=$!; PORT=18420
else
  $BIN --listen 127.0.0.1:$PORT --backend http://127.0.0.1:18401 --backend http://127.0.0.1:18402 "$@" >/tmp/fast3/lb-$PORT.log 2>&1 & PID=$!
fi
for i in $(seq 100); do curl -sf -o /dev/null -H 'content-type: application/json' -d '{"model":"bench","messages":[{"role":"user","content":"hi"}]}' http://127.0.0.1:$PORT/v1/chat/completions && break; sleep 0.1; done
PIDS=$PID; [ "$BIN" = nginx ] && PIDS=$(pgrep -P $PID)
snap() { for p in $PIDS; do for t in /proc/$p/task/*; do echo "$(cat $t/comm) $(awk '/^voluntary_ctxt/{v=$2}/^nonvoluntary_ctxt/{n=$2}END{print v, n}' $t/status)"; done; done | sort; }
snap > /tmp/fast3/c0
cpu() { for p in $PIDS; do awk "{print \$14+\$15}" /proc/$p/stat; done | paste -sd+ | bc; }
ut() { for p in $PIDS; do awk "{print \$14}" /proc/$p/stat; done | paste -sd+ | bc; }
t0=$(cpu); u0=$(ut); f0=$(for p in $PIDS; do awk "{print \$10}" /proc/$p/stat; done | paste -sd+ | bc)
cd /work/wt-fast3
OUT=$(wrk -t2 -c64 -d6s -s bench/wrk/post.lua http://127.0.0.1:$PORT/v1/chat/completions)
snap > /tmp/fast3/c1
t1=$(cpu); u1=$(ut); f1=$(for p in $PIDS; do awk "{print \$10}" /proc/$p/stat; done | paste -sd+ | bc)
REQ=$(echo "$OUT" | awk '/requests in/{print $1}')
echo "$(basename $BIN) $* requests=$REQ rps=$(echo "$OUT" | awk '/Requests\/sec/{print $2}') minflt_per_req=$(python3 -c "print(round(($f1-$f0)/$REQ,3))") user_ms_per_1k=$(python3 -c "print(round(($u1-$u0)*1000/$(getconf CLK_TCK)/$REQ*1000,1))") cpu_ms_per_1k=$(python3 -c "print(round(($t1-$t0)*1000/$(getconf CLK_TCK)/$REQ*1000,1))") load=$(cut -d' ' -f1-3 /proc/loadavg)"
paste /tmp/fast3/c0 /tmp/fast3/c1 | awk -v r=$REQ '{dv=$5-$2; dn=$6-$3; if (dv+dn>50) printf "  %-20s vol %7d (%.3f/req) invol %7d (%.3f/req)\n", $1, dv, dv/r, dn, dn/r}'
kill $PID; wait $PID 2>/dev/null
