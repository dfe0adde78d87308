#!/usr/bin/env bash
# The status page in a real headless Chromium (Debian's package): it renders, shows the
# backends of a running router, and updates after new requests (two --dump-dom passes with
# requests between them); writes docs/status-page.png.
#   deploy/check-status-page.sh          # builds and uses the target/debug binaries
# Ports: 18300 (inferlb), 18301-18303 (simulators).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
cargo build -q -p inferlb -p vllm-sim --bins   # always: a stale binary would check old code
echo "== commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src || echo ' (uncommitted changes in src)'), $(date -u +%FT%TZ); $(chromium --version 2>/dev/null)"
work=$(mktemp -d /tmp/inferlb-page.XXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
target/debug/vllm-sim --host 127.0.0.1 --port 18301 --fleet 3 --served-model-name demo-llama > "$work/sim.log" 2>&1 & pids+=($!)
target/debug/inferlb --listen 127.0.0.1:18300 --backend http://127.0.0.1:18301 --backend http://127.0.0.1:18302 \
    --backend http://127.0.0.1:18303 --log-level warn > "$work/inferlb.log" 2>&1 & pids+=($!)
for _ in $(seq 1 100); do curl -fs http://127.0.0.1:18300/ready >/dev/null 2>&1 && break; sleep 0.2; done
chrome() {
    chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
        --disable-component-update --disable-sync --user-data-dir="$(mktemp -d "$work/profile.XXXX")" \
        --virtual-time-budget=3000 "$@" http://127.0.0.1:18300/admin 2>/dev/null
}
chat() {
    curl -fs -o /dev/null http://127.0.0.1:18300/v1/chat/completions -H 'content-type: application/json' \
        -d "{\"model\":\"demo-llama\",\"max_tokens\":8,\"messages\":[{\"role\":\"system\",\"content\":\"Shared system prompt of the status page check, long enough to span several prefix blocks of the index.\"},{\"role\":\"user\",\"content\":\"question $1\"}]}"
}
fail() { echo "FAIL: $*"; exit 1; }
count() { { grep -o "$1" "$2" || true; } | wc -l; }

chrome --dump-dom > "$work/first.html"
rows=$(count '<tr data-backend=' "$work/first.html")
echo "first render: $rows backend rows, $(count 'class="decision"' "$work/first.html") decisions"
[ "$rows" = 3 ] || fail "expected the 3 backends in the table"
for port in 18301 18302 18303; do grep -q "http://127.0.0.1:$port" "$work/first.html" || fail "backend $port missing"; done
grep -q '>healthy<' "$work/first.html" || fail "no healthy backend shown"
for i in 1 2 3 4 5 6; do chat "$i"; done
chrome --dump-dom > "$work/second.html"
decisions=$(count 'class="decision"' "$work/second.html")
echo "after 6 requests: $decisions decisions; winners: $(grep -o 'class="winner">[^<]*' "$work/second.html" | cut -d'>' -f2 | sort | uniq -c | tr -s ' \n' ' ')"
[ "$decisions" -ge 6 ] || fail "the page did not show the new decisions"
grep -q 'prefix-cache-scorer ×2' "$work/second.html" || fail "no per-scorer columns"
grep -q 'class="win"' "$work/second.html" || fail "no winner row highlighted"
chrome --screenshot="$PWD/docs/status-page.png" --window-size=1400,1000 >/dev/null
echo "screenshot: docs/status-page.png ($(stat -c %s docs/status-page.png) bytes)"
echo "PASS"
