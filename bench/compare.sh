#!/usr/bin/env bash
# Routing-quality comparison at default scale: shared-prefix (all policies + SGLang's and
# vLLM's routers when installed), unique and multi-turn. Results: bench/results/compare-*.md/json.
# Usage: bench/compare.sh [extra loadgen compare flags, e.g. --policy-file NAME=path.toml]
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release -p loadgen -p inferlb
LG=target/release/loadgen
VENV=bench/.venv

# The two public Rust routers install from PyPI; they are optional reference rows.
if [ ! -x "$VENV/bin/vllm-router" ] || [ ! -x "$VENV/bin/sglang-router" ]; then
  python3 -m venv "$VENV" && "$VENV/bin/pip" install -q sglang-router vllm-router \
    || echo "compare.sh: could not install the external routers; continuing without them" >&2
fi
EXT=()
if "$VENV/bin/python" -c 'import sglang_router' 2>/dev/null; then
  EXT+=(--router-cmd "sglang-cache-aware=$VENV/bin/python -m sglang_router.launch_router --worker-urls {workers} --policy cache_aware --host 127.0.0.1 --port {port} --prometheus-host 127.0.0.1 --prometheus-port {metrics_port}")
fi
if [ -x "$VENV/bin/vllm-router" ]; then
  EXT+=(--router-cmd "vllm-router-cache-aware=$VENV/bin/vllm-router --worker-urls {workers} --policy cache_aware --host 127.0.0.1 --port {port} --prometheus-host 127.0.0.1 --prometheus-port {metrics_port}")
fi

# The results header names the versions of the external routers measured (loadgen records
# the commit and freshness of its own binaries).
NOTES=()
for pkg in sglang-router vllm-router; do
  v=$("$VENV/bin/pip" show "$pkg" 2>/dev/null | sed -n 's/^Version: //p' || true)
  [ -n "$v" ] && NOTES+=(--note "external router: $pkg $v (PyPI, $VENV)")
done

$LG compare --workload shared-prefix "${EXT[@]}" "${NOTES[@]}" "$@"
$LG compare --workload unique --policies random,round-robin,load-only,default "$@"
$LG compare --workload multi-turn --policies random,round-robin,load-only,default "$@"
