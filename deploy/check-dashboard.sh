#!/usr/bin/env bash
# Proves the Grafana dashboard against the real thing: Debian's Prometheus scrapes a running
# inferlb and three vllm-sim servers (loopback) while a load runs, then EVERY panel expression
# of deploy/grafana/inferlb-dashboard.json is evaluated through Prometheus's HTTP query API
# ($__rate_interval → 1m). Fails when any query errors or returns no series — so a panel naming
# a metric nobody exports fails.
#   deploy/check-dashboard.sh           # builds and uses the target/debug binaries
# Ports: 18200 (inferlb), 18201-18203 (simulators), 18290 (Prometheus).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v prometheus >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }
cargo build -q -p inferlb -p vllm-sim --bins   # always: a stale binary would check old code
echo "== commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (uncommitted changes)'), $(date -u +%FT%TZ); $(prometheus --version 2>&1 | head -n1)"
work=$(mktemp -d /tmp/inferlb-dash.XXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
# The simulators publish KV-cache events (ports 28201-28203) and tokenize with the fixture's
# Hugging Face tokenizer; inferlb subscribes (--kv-events auto) and tokenizes with the same one,
# so the precise-scoring and tokenization panels have data.
target/debug/vllm-sim --host 127.0.0.1 --port 18201 --fleet 3 --served-model-name demo-llama --time-scale 0.2 \
    --tokenizer tests/fixtures/tiny-llama \
    --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:28201","topic":"kv"}' \
    > "$work/sim.log" 2>&1 & pids+=($!)
target/debug/inferlb --listen 127.0.0.1:18200 --backend http://127.0.0.1:18201 --backend http://127.0.0.1:18202 \
    --backend http://127.0.0.1:18203 --tokenizer tests/fixtures/tiny-llama --kv-events auto \
    --log-level warn > "$work/inferlb.log" 2>&1 & pids+=($!)
cat > "$work/prometheus.yml" <<YML
global: { scrape_interval: 1s, evaluation_interval: 1s }
scrape_configs:
  - job_name: inferlb
    static_configs: [{ targets: ["127.0.0.1:18200"] }]
  - job_name: vllm
    static_configs: [{ targets: ["127.0.0.1:18201", "127.0.0.1:18202", "127.0.0.1:18203"] }]
YML
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/data" \
    --web.listen-address=127.0.0.1:18290 > "$work/prometheus.log" 2>&1 & pids+=($!)
for _ in $(seq 1 150); do curl -fs http://127.0.0.1:18200/ready >/dev/null 2>&1 && curl -fs http://127.0.0.1:18290/-/ready >/dev/null 2>&1 && break; sleep 0.2; done
curl -fs http://127.0.0.1:18200/ready >/dev/null || { echo "FAIL: inferlb not ready"; cat "$work/inferlb.log"; exit 1; }
# Tokenizing starts once some backend's event stream is live: wait for all three (bounded).
for _ in $(seq 1 100); do
    curl -fs http://127.0.0.1:18200/metrics | grep -q '^inferlb_kv_event_streams{state="live"} 3' && break; sleep 0.2
done
curl -fs http://127.0.0.1:18200/metrics | grep '^inferlb_kv_event_streams{state="live"}' || { echo "FAIL: no live KV-event stream"; exit 1; }

echo "== load: 240 chat requests (8 shared system prompts, a quarter streamed, 4 concurrent) + 12 for an unknown model; status codes seen:"
req() {
    local i=$1 model=demo-llama stream=false
    [ $((i % 4)) = 0 ] && stream=true
    [ $((i % 20)) = 0 ] && model=no-such-model
    curl -s -o /dev/null -w '%{http_code}\n' http://127.0.0.1:18200/v1/chat/completions -H 'content-type: application/json' \
        -d "{\"model\":\"$model\",\"stream\":$stream,\"max_tokens\":16,\"messages\":[{\"role\":\"system\",\"content\":\"You are assistant number $((i % 8)). $(printf 'Follow the house rules carefully. %.0s' $(seq 1 30))\"},{\"role\":\"user\",\"content\":\"question $i\"}]}"
}
export -f req
# Halfway, the third simulator starts answering every completion with 500: retries move those
# requests to the others, and outlier detection ejects it (the retry and ejection panels).
{ seq 1 126 | xargs -P 4 -I{} bash -c 'req {}'
  curl -fsS -o /dev/null http://127.0.0.1:18203/sim/faults -H 'content-type: application/json' -d '{"fail_rate": 1.0}'
  seq 127 252 | xargs -P 4 -I{} bash -c 'req {}'; } | sort | uniq -c
# Two more scrapes after the load, so every rate() has the last samples.
sleep 3

echo "== every panel expression of deploy/grafana/inferlb-dashboard.json"
python3 - <<'PY'
import json, sys, urllib.parse, urllib.request
dash = json.load(open("deploy/grafana/inferlb-dashboard.json"))
failed = total = 0
for panel in dash["panels"]:
    for t in panel["targets"]:
        total += 1
        expr = t["expr"].replace("$__rate_interval", "1m")
        url = "http://127.0.0.1:18290/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            body = json.load(urllib.request.urlopen(url, timeout=10))
        except Exception as e:  # HTTP 400 for a bad expression
            body = {"status": "error", "error": str(getattr(e, "read", lambda: e)())}
        result = body.get("data", {}).get("result", []) if body.get("status") == "success" else []
        ok = body.get("status") == "success" and len(result) > 0
        failed += not ok
        sample = ", ".join(f"{json.dumps(r['metric'], separators=(',', ':'))}={float(r['value'][1]):.4g}" for r in result[:3])
        print(f"{'ok  ' if ok else 'FAIL'} [{panel['title']}] {expr}\n       {len(result)} series" + (f": {sample}" if sample else f" {body.get('error', '')}"))
print(f"{total - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
PY
