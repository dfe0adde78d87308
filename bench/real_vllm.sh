#!/usr/bin/env bash
# Routing policies side by side on two REAL vLLM servers (CPU build, tiny random-weight model,
# ../shared/real-vllm/serve.sh), outside CI. For each policy: start both servers cold with a
# small KV cache (BLOCKS=64 blocks of 128 tokens each), start inferlb with the policy, run the
# same seeded shared-prefix workload with loadgen, read vLLM's own prefix-cache counters, stop
# everything. Prints one table and writes bench/results/real-vllm-<date>.md.
#   bench/real_vllm.sh [POLICIES="random round-robin load-only prefix-only default"]
# With EXISTING="http://host1:port http://host2:port" it uses servers that are already running
# instead (no cold restart between policies: later policies then see earlier policies' cache).
set -euo pipefail
cd "$(dirname "$0")/.."
SERVE=${SERVE:-../shared/real-vllm/serve.sh}
POLICIES=${1:-"random round-robin load-only prefix-only default"}
P1=${P1:-18100}
P2=${P2:-18101}
export BLOCKS=${BLOCKS:-64}
OUT=$(mktemp -d)
cargo build --release -q -p inferlb -p loadgen
VLLM_ROOT=${ROOT:-$HOME/.cache/inferlb-real-vllm}
VLLM_VERSION=$("$VLLM_ROOT/venv/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null || echo "unknown")
python3 bench/provenance.py --note "vLLM: $VLLM_VERSION ($VLLM_ROOT/venv)" target/release/inferlb target/release/loadgen >"$OUT/provenance.md"
LB=""
cleanup() { [ -n "$LB" ] && kill "$LB" 2>/dev/null || true; [ -n "${EXISTING:-}" ] || STOP=1 "$SERVE" "$P1" "$P2" >/dev/null 2>&1 || true; }
trap cleanup EXIT

profile() {  # the [[scheduling_profiles]] of a policy, as loadgen compare generates them
  case "$1" in
    random) printf '[[plugins]]\ntype = "random-picker"\n[[scheduling_profiles]]\nname = "random"\nplugins = [{ plugin_ref = "random-picker" }]\n' ;;
    round-robin) printf '[[plugins]]\ntype = "round-robin-picker"\n[[scheduling_profiles]]\nname = "round-robin"\nplugins = [{ plugin_ref = "round-robin-picker" }]\n' ;;
    load-only) printf '[[plugins]]\ntype = "queue-scorer"\n[[plugins]]\ntype = "kv-cache-utilization-scorer"\n[[plugins]]\ntype = "inflight-scorer"\n[[plugins]]\ntype = "max-score-picker"\n[[scheduling_profiles]]\nname = "load-only"\nplugins = [{ plugin_ref = "queue-scorer", weight = 2 }, { plugin_ref = "kv-cache-utilization-scorer", weight = 2 }, { plugin_ref = "inflight-scorer", weight = 1 }, { plugin_ref = "max-score-picker" }]\n' ;;
    prefix-only) printf '[[plugins]]\ntype = "prefix-cache-scorer"\n[[plugins]]\ntype = "max-score-picker"\n[[scheduling_profiles]]\nname = "prefix-only"\nplugins = [{ plugin_ref = "prefix-cache-scorer", weight = 1 }, { plugin_ref = "max-score-picker" }]\n' ;;
    default) : ;;
  esac
}

URLS=${EXISTING:-"http://127.0.0.1:$P1 http://127.0.0.1:$P2"}
for policy in $POLICIES; do
  if [ -z "${EXISTING:-}" ]; then
    echo "== $policy: starting two vLLM servers cold (BLOCKS=$BLOCKS)" >&2
    "$SERVE" "$P1" "$P2" >&2
  fi
  PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  { printf 'listen = "127.0.0.1:%s"\nlog_level = "warn"\n' "$PORT"; for u in $URLS; do printf '[[backends]]\nurl = "%s"\n' "$u"; done; profile "$policy"; } > "$OUT/$policy.toml"
  target/release/inferlb --config "$OUT/$policy.toml" &
  LB=$!
  for _ in $(seq 1 100); do curl -sf -o /dev/null "http://127.0.0.1:$PORT/ready" && break; sleep 0.1; done
  METRICS=()
  for u in $URLS; do METRICS+=(--backend-metrics "$u"); done
  target/release/loadgen run --url "http://127.0.0.1:$PORT" --workload shared-prefix --groups 14 --prompts 4 \
    --system-tokens 300 --question-tokens 30 --output-tokens 8 --rate 3 --seed 1 --block-size 128 \
    "${METRICS[@]}" --json "$OUT/$policy.json" >&2
  kill "$LB"; wait "$LB" 2>/dev/null || true; LB=""
  if [ -z "${EXISTING:-}" ]; then
    STOP=1 "$SERVE" "$P1" "$P2"
    # Wait until both ports are free before the next cold start.
    for _ in $(seq 1 100); do ! curl -s -o /dev/null "http://127.0.0.1:$P1/health" && ! curl -s -o /dev/null "http://127.0.0.1:$P2/health" && break; sleep 0.2; done
  fi
done

python3 - "$OUT" $POLICIES <<'PY'
import json, os, sys, datetime, subprocess
out, policies = sys.argv[1], sys.argv[2:]
cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True, text=True).stdout.strip()
lines = ["# Routing policies on two real vLLM 0.32 servers (CPU build, tiny random-weight model)", "",
         f"- command: `bench/real_vllm.sh \"{' '.join(policies)}\"` (BLOCKS=64: 64 KV blocks of 128 tokens per server)",
         f"- machine: nproc {os.cpu_count()}, CPU {cpu}", f"- date: {datetime.datetime.utcnow().isoformat(timespec='seconds')}Z",
         open(os.path.join(out, "provenance.md")).read().rstrip("\n"),
         "- workload: shared-prefix, 14 groups × 4 prompts, system 300 / question 30 / output 8 loadgen tokens, Poisson 3 req/s, seed 1; servers restarted cold per policy",
         "- hit rate: Δvllm:prefix_cache_hits_total ÷ Δvllm:prefix_cache_queries_total over both servers, read from vLLM itself; hit/req: Δvllm:prompt_tokens_cached_total ÷ Δvllm:prompt_tokens_total (each request once)", "",
         "| policy | requests ok | TTFT p50 | TTFT p90 | E2E p90 | vLLM hit rate | hit/req | request share per server | errors |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
for p in policies:
    s = json.load(open(os.path.join(out, p + ".json")))
    f = s.get("fleet") or {}
    share = " / ".join(f"{v*100:.0f}%" for v in (f.get("request_share") or {}).values())
    lines.append(f"| {p} | {s['ok']}/{s['requests']} | {s['ttft']['p50']*1000:.0f} ms | {s['ttft']['p90']*1000:.0f} ms | "
                 f"{s['e2e']['p90']*1000:.0f} ms | {f.get('hit_rate', 0):.3f} | "
                 + ("-" if f.get('hit_rate_per_request') is None else f"{f['hit_rate_per_request']:.3f}")
                 + f" | {share} | {json.dumps(s['errors'])} |")
text = "\n".join(lines) + "\n"
print(text)
path = f"bench/results/real-vllm-{datetime.date.today().isoformat()}.md"
open(path, "w").write(text)
print("wrote", path)
PY
