#!/usr/bin/env bash
# The Responses API behind inferlb with real vLLM and the real OpenAI Python SDK: two vLLM 0.32
# CPU servers with the response store on (VLLM_ENABLE_RESPONSES_API_STORE=1), two inferlb
# replicas over them, and bench/responses_real_vllm.py's checks (three turns by
# previous_response_id, retrieve through both replicas, a streamed create and its follow-up,
# cancel reaching the holder, an unknown id).
#
#   bench/responses_real_vllm.sh OUT_MD
#
# Starts the servers with ../shared/real-vllm/serve.sh (which installs vLLM once) and stops
# everything it started. Needs target/release/inferlb (cargo build --release -p inferlb).
set -uo pipefail
OUT=${1:?usage: bench/responses_real_vllm.sh OUT_MD}
HERE=$(cd "$(dirname "$0")/.." && pwd)
SERVE=${SERVE:-$HERE/../shared/real-vllm/serve.sh}
ROOT=${ROOT:-$HOME/.cache/inferlb-real-vllm}
A=18300; B=18301; LB1=18310; LB2=18311
mkdir -p "$ROOT/logs" "$(dirname "$OUT")"
PIDS=""
stop_all() {
  for pid in $PIDS; do kill "$pid" 2>/dev/null; done
  STOP=1 "$SERVE" $A $B
}
trap stop_all EXIT
VLLM_ENABLE_RESPONSES_API_STORE=1 "$SERVE" $A $B > "$ROOT/logs/responses-serve.log" 2>&1 \
  || { tail -5 "$ROOT/logs/responses-serve.log"; exit 1; }
# The tree's state before OUT (which may be tracked) is rewritten.
SRC="commit $(git -C "$HERE" rev-parse HEAD)$(git -C "$HERE" diff --quiet HEAD -- . ":(exclude)$OUT" || echo ' (dirty)')"
for lb in $LB1 $LB2; do
  CFG=$ROOT/responses-inferlb-$lb.toml
  printf 'listen = "127.0.0.1:%s"\n[[backends]]\nurl = "http://127.0.0.1:%s"\n[[backends]]\nurl = "http://127.0.0.1:%s"\n' "$lb" $A $B > "$CFG"
  "$HERE/target/release/inferlb" --config "$CFG" > "$ROOT/logs/responses-inferlb-$lb.log" 2>&1 &
  PIDS="$PIDS $!"
done
for lb in $LB1 $LB2; do
  for _ in $(seq 1 60); do curl -s -m 2 -o /dev/null "http://127.0.0.1:$lb/ready" && break; sleep 1; done
done
{
  echo "# The Responses API behind inferlb: real vLLM, real OpenAI SDK — $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "- command: \`bench/responses_real_vllm.sh $OUT\`"
  echo "- source: $SRC"
  echo "- vLLM: $("$ROOT/venv/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1), openai SDK $("$ROOT/venv/bin/python" -c 'import openai; print(openai.__version__)'), servers on $A and $B with VLLM_ENABLE_RESPONSES_API_STORE=1"
  echo "- two inferlb replicas on $LB1 and $LB2 over both servers (default config)"
  echo
} > "$OUT"
"$ROOT/venv/bin/python" "$HERE/bench/responses_real_vllm.py" "http://127.0.0.1:$LB1" "http://127.0.0.1:$LB2" \
  "http://127.0.0.1:$A" "http://127.0.0.1:$B" 2>&1 | tee -a "$OUT"
rc=${PIPESTATUS[0]}
{
  echo
  echo "inferlb replica 2's lookups: $(curl -s "http://127.0.0.1:$LB2/metrics" | grep '^inferlb_responses_affinity_total' | tr '\n' ' ')"
  echo
  echo "exit $rc"
} | tee -a "$OUT"
exit "$rc"
