#!/usr/bin/env bash
# Compare vllm-sim with a real vLLM 0.32 CPU server (outside CI; the real server's first install
# takes ~3 min and ~6.5 GB). Writes crates/vllm-sim/FIDELITY.md.
#
#   crates/vllm-sim/scripts/fidelity.sh            # REAL_PORT=18100 SIM_PORT=18200 BLOCKS=64
#   KEEP=1 crates/vllm-sim/scripts/fidelity.sh     # leave the real server running
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
SHARED=${SHARED:-$ROOT/../shared}
REAL_PORT=${REAL_PORT:-18100}
SIM_PORT=${SIM_PORT:-18200}
BLOCKS=${BLOCKS:-64}
MAX_LEN=${MAX_LEN:-2048}
cd "$ROOT"
cargo build --release -q -p vllm-sim
if ! curl -s -m 2 -o /dev/null "http://127.0.0.1:$REAL_PORT/health"; then
  BLOCKS=$BLOCKS MAX_LEN=$MAX_LEN "$SHARED/real-vllm/serve.sh" "$REAL_PORT"
fi
# Same block size (128 on the CPU build), block count and max length as the real server.
target/release/vllm-sim --port "$SIM_PORT" --served-model-name tiny-llama --block-size 128 \
  --num-gpu-blocks "$BLOCKS" --max-model-len "$MAX_LEN" --time-scale 50 >/dev/null 2>&1 &
SIM_PID=$!
trap 'kill $SIM_PID 2>/dev/null; [ -n "${KEEP:-}" ] || STOP=1 "$SHARED/real-vllm/serve.sh" "$REAL_PORT"' EXIT
for _ in $(seq 1 50); do curl -s -m 1 -o /dev/null "http://127.0.0.1:$SIM_PORT/health" && break; sleep 0.2; done
python3 "$HERE/fidelity.py" "http://127.0.0.1:$REAL_PORT" "http://127.0.0.1:$SIM_PORT" tiny-llama 128 \
  > "$HERE/../FIDELITY.md"
echo "wrote $HERE/../FIDELITY.md"
