#!/usr/bin/env bash
# Real vLLM P/D through inferlb, where it can run: two vLLM 0.32 CPU servers with the
# NixlConnector (CPU KV buffer), one in the prefill role and one in the decode role, inferlb in
# front with [pd] on, one long completion, and the decode server's counters read afterwards.
#
#   bench/pd_real_vllm.sh OUT_MD
#
# Installs vLLM the way ../shared/real-vllm/serve.sh does (it starts and stops one plain server
# on port 18190 for that), then `pip install nixl` into the same venv. Every step's output is
# kept under $ROOT/logs; OUT_MD records what ran and how it ended (also when a step fails, which
# is the expected outcome on a machine without CUDA: the nixl wheels are CUDA builds).
set -uo pipefail
OUT=${1:?usage: bench/pd_real_vllm.sh OUT_MD}
HERE=$(cd "$(dirname "$0")/.." && pwd)
SERVE=${SERVE:-$HERE/../shared/real-vllm/serve.sh}
ROOT=${ROOT:-$HOME/.cache/inferlb-real-vllm}
VENV=$ROOT/venv
MODEL=$ROOT/tiny-llama
P=18200; D=18201; LB=18210
mkdir -p "$ROOT/logs" "$(dirname "$OUT")"
note() { echo "$*" | tee -a "$OUT"; }
: > "$OUT"
note "# Real vLLM P/D through inferlb — $(date -u +%Y-%m-%dT%H:%M:%SZ)"
note ""
note "- source: commit $(git -C "$HERE" rev-parse HEAD)"
stop_all() {
  for pid in ${PIDS:-}; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null; done
}
trap stop_all EXIT

if [ ! -x "$VENV/bin/vllm" ]; then
  note "- installing vLLM with serve.sh (one plain server on 18190, stopped again)"
  "$SERVE" 18190 > "$ROOT/logs/pd-install.log" 2>&1
  STOP=1 "$SERVE" 18190
fi
note "- vLLM: $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)' 2>&1 | tail -1)"
if ! "$VENV/bin/python" -c 'import nixl' > /dev/null 2>&1; then
  note "- pip install nixl:"
  "$VENV/bin/pip" install -q nixl > "$ROOT/logs/pd-nixl-install.log" 2>&1
  note "  exit $?; $(tail -1 "$ROOT/logs/pd-nixl-install.log")"
fi
note "- import nixl: $("$VENV/bin/python" -c 'import nixl; print("ok", nixl.__file__)' 2>&1 | tail -1)"
note "- import nixl_cu12 agent: $("$VENV/bin/python" -c 'from nixl._api import nixl_agent; print("ok")' 2>&1 | tail -1)"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CPU_KVCACHE_SPACE=1
KV='{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'
PIDS=""
for port in $P $D; do
  side=$((port == P ? 5600 : 5601))
  VLLM_NIXL_SIDE_CHANNEL_PORT=$side setsid nohup "$VENV/bin/vllm" serve "$MODEL" --served-model-name tiny-llama \
    --host 127.0.0.1 --port "$port" --max-model-len 4096 --enable-prefix-caching --dtype float32 \
    --kv-transfer-config "$KV" > "$ROOT/logs/pd-vllm-$port.log" 2>&1 &
  PIDS="$PIDS $!"
done
note "- servers: \`vllm serve … --kv-transfer-config '$KV'\` on $P (prefill) and $D (decode)"
up=1
for port in $P $D; do
  for _ in $(seq 1 120); do
    curl -s -m 2 -o /dev/null "http://127.0.0.1:$port/health" && break
    pgrep -f "port $port" > /dev/null || break
    sleep 2
  done
  if ! curl -s -m 2 -o /dev/null "http://127.0.0.1:$port/health"; then
    up=0
    note "- server $port did not come up; the last lines of its log:"
    note '```'
    grep -E "Error|error|NIXL|nixl" "$ROOT/logs/pd-vllm-$port.log" | tail -8 | tee -a "$OUT"
    note '```'
  fi
done
if [ "$up" = 1 ]; then
  CFG=$ROOT/pd-inferlb.toml
  printf 'listen = "127.0.0.1:%s"\n[pd]\nenabled = true\nthreshold_tokens = 64\n[[backends]]\nurl = "http://127.0.0.1:%s"\nrole = "prefill"\n[[backends]]\nurl = "http://127.0.0.1:%s"\nrole = "decode"\n' "$LB" "$P" "$D" > "$CFG"
  "$HERE/target/release/inferlb" --config "$CFG" > "$ROOT/logs/pd-inferlb.log" 2>&1 &
  PIDS="$PIDS $!"
  for _ in $(seq 1 60); do curl -s -m 2 -o /dev/null "http://127.0.0.1:$LB/ready" && break; sleep 1; done
  PROMPT=$(python3 -c 'print(" ".join(["the quick brown fox jumps over the lazy dog"] * 60))')
  RESP=$(curl -s -m 120 -D - "http://127.0.0.1:$LB/v1/completions" -H 'x-inferlb-explain: 1' \
    -H 'content-type: application/json' \
    -d "{\"model\":\"tiny-llama\",\"prompt\":\"$PROMPT\",\"max_tokens\":8}")
  note "- response through inferlb:"
  note '```'
  echo "$RESP" | grep -iE "^HTTP|x-inferlb-backend|x-inferlb-decision" | cut -c1-200 | tee -a "$OUT"
  echo "$RESP" | tail -1 | cut -c1-300 | tee -a "$OUT"
  note '```'
  note "- decode server's external prompt tokens: $(curl -s "http://127.0.0.1:$D/metrics" | grep -E '^vllm:prompt_tokens_by_source_total|^vllm:external_prefix_cache_hits_total' | tr '\n' ' ')"
  note "- inferlb: $(curl -s "http://127.0.0.1:$LB/metrics" | grep '^inferlb_pd_requests_total' | tr '\n' ' ')"
fi
