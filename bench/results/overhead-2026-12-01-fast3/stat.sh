#!/usr/bin/env bash
# stat.sh BIN|nginx PORT [args]: proxy under wrk -c64 7 s; perf stat cs + migrations on it for 5 s
BIN=$1; PORT=$2; shift 2
if [ "$BIN" = nginx ]; then
  nginx -p /tmp/fast3/proxy -c /tmp/fast3/proxy/nginx.conf -g 'daemon off;' >/dev/null 2>&1 & PID=$!; PORT=18420
else
  $BIN --listen 127.0.0.1:$PORT --backend http://127.0.0.1:18401 --backend http://127.0.0.1:18402 "$@" >/tmp/fast3/lb-$PORT.log 2>&1 & PID=$!
fi
for i in $(seq 100); do curl -sf -o /dev/null -H 'content-type: application/json' -d '{"model":"bench","messages":[{"role":"user","content":"hi"}]}' http://127.0.0.1:$PORT/v1/chat/completions && break; sleep 0.1; done
PIDS=$PID; [ "$BIN" = nginx ] && PIDS=$(pgrep -P $PID | paste -sd,)
cd /work/wt-fast3
STREAM=${STREAM:-false} wrk -t2 -c64 -d7s -s bench/wrk/post.lua http://127.0.0.1:$PORT/v1/chat/completions > /tmp/fast3/ss.wrk &
W=$!
sleep 1
perf stat -e 'raw_syscalls:sys_enter,syscalls:sys_enter_writev,syscalls:sys_enter_recvfrom,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_madvise,syscalls:sys_enter_mmap,syscalls:sys_enter_munmap,syscalls:sys_enter_futex,syscalls:sys_enter_write,syscalls:sys_enter_sched_yield,syscalls:sys_enter_getrandom,syscalls:sys_enter_clock_gettime,syscalls:sys_enter_setsockopt,syscalls:sys_enter_getsockopt,syscalls:sys_enter_read,syscalls:sys_enter_sendto' -p $PIDS -- sleep 5 2>&1 | grep -E "context|migr|sys_enter|elapsed"
wait $W; grep -E "requests in|Requests/sec" /tmp/fast3/ss.wrk
kill $PID; wait $PID 2>/dev/null
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
