#!/usr/bin/env bash
# prof.sh: rr.toml inferlb under wrk -c64 12 s (full bench body), perf record -F 999 -g -p for 8 s
/tmp/fast3-base-inferlb --listen 127.0.0.1:18440 --backend http://127.0.0.1:18401 --backend http://127.0.0.1:18402 -c /tmp/fast3/rr.toml >/tmp/fast3/lb-18440.log 2>&1 & PID=$!
for i in $(seq 100); do curl -sf -o /dev/null http://127.0.0.1:18440/ready && break; sleep 0.1; done
BODY=$(cat /tmp/fast3/good.json) wrk -t2 -c64 -d12s -s /tmp/fast3/body.lua http://127.0.0.1:18440/v1/chat/completions > /tmp/fast3/prof.wrk &
W=$!
sleep 2
perf record -F 999 -g -p $PID -o /tmp/fast3/rr.perf -- sleep 8 2>&1 | tail -1
wait $W; grep Requests/sec /tmp/fast3/prof.wrk
kill $PID; wait $PID 2>/dev/null
echo "load $(cut -d' ' -f1-3 /proc/loadavg)"
