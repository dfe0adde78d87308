#!/usr/bin/env bash
# Routing policies side by side on two REAL vLLM servers (CPU build, tiny random-weight model,
# ../shared/real-vllm/serve.sh), outside CI. Both servers start once with a small KV cache
# (BLOCKS=64 blocks of 128 tokens each), KV-cache events on (KV_EVENTS=1) and
# POST /reset_prefix_cache (DEV=1). For each policy: reset both caches, start inferlb with the
# policy, run the same seeded shared-prefix workload with loadgen, read vLLM's own counters,
# stop inferlb. Prints one table and writes bench/results/real-vllm-<date>[-zipf].md.
#   bench/real_vllm.sh [POLICIES="random load-only approximate precise approximate-x2 precise-x2"]
# Policies: random, round-robin, load-only, prefix-only; approximate (the default profile, no
# KV events); precise (the default profile with every backend's KV-event stream and the model's
# tokenizer); any other NAME: bench/policies/NAME.toml (its tests/fixtures/tiny-llama tokenizer
# replaced by the served model's); NAME-x2: two such inferlb replicas behind an nginx round-robin front.
# sglang: SGLang's Rust router from PyPI (`--policy cache_aware`, its defaults), installed into
# bench/.venv when missing, bound to 127.0.0.1.
# Env: WORKLOAD (shared-prefix, default, or multi-turn), ZIPF (group popularity exponent, default
# 0 = uniform), SEED (1), GROUPS_N (14), PROMPTS (4 per group), CONVERSATIONS (8), TURNS (6),
# SYSTEM (300), QUESTION (30), OUTPUT (8) loadgen tokens, RATE (3), REPEAT (1: each policy runs
# REPEAT times, the policies interleaved; the table gives medians and [min–max]),
# EXISTING="http://host1:port http://host2:port" (servers already running with KV_EVENTS=1 DEV=1,
# each pinned to a core of its own: VLLM_CPU_OMP_THREADS_BIND=0 serve.sh P1; …=1 serve.sh P2).
# The bound ("max"): every request's prompt tokenized by vLLM itself (POST /tokenize); a
# request can hit at most the full 128-token blocks an earlier request already had, and never
# its last token (bench/real_vllm_bound.py). ORACLE=1 adds the best fixed split of the groups
# found with hindsight on these evicting caches (bench/lru_oracle.py; minutes for 14 groups).
set -euo pipefail
cd "$(dirname "$0")/.."
SERVE=${SERVE:-../shared/real-vllm/serve.sh}
POLICIES=${1:-"random load-only approximate precise approximate-x2 precise-x2"}
P1=${P1:-18100}
P2=${P2:-18101}
ZIPF=${ZIPF:-0}
SEED=${SEED:-1}
GROUPS_N=${GROUPS_N:-14}
RATE=${RATE:-3}
WORKLOAD=${WORKLOAD:-shared-prefix}
PROMPTS=${PROMPTS:-4}
CONVERSATIONS=${CONVERSATIONS:-8}
TURNS=${TURNS:-6}
SYSTEM=${SYSTEM:-300}
QUESTION=${QUESTION:-30}
OUTPUT=${OUTPUT:-8}
REPEAT=${REPEAT:-1}
export WORKLOAD PROMPTS CONVERSATIONS TURNS SYSTEM QUESTION OUTPUT REPEAT
VENV=bench/.venv
case " $POLICIES " in *" sglang "*)
  "$VENV/bin/python" -c 'import sglang_router' 2>/dev/null || { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q sglang-router; } ;;
esac
export BLOCKS=${BLOCKS:-64} KV_EVENTS=1 DEV=1
OUT=$(mktemp -d)
case "$POLICIES" in *-x2*) command -v nginx >/dev/null || { echo "the -x2 policies need nginx (apt-get install nginx-light)" >&2; exit 2; } ;; esac
# NO_BUILD=1 uses the binaries as they are; INFERLB_BIN runs another inferlb binary (an A/B).
[ -n "${NO_BUILD:-}" ] || cargo build --release -q -p inferlb -p loadgen
BIN=${INFERLB_BIN:-target/release/inferlb}
export INFERLB_BIN=$BIN
VLLM_ROOT=${ROOT:-$HOME/.cache/inferlb-real-vllm}
VENV_PY=$VLLM_ROOT/venv/bin/python
TOKENIZER=${TOKENIZER:-$VLLM_ROOT/tiny-llama}
VLLM_VERSION=$("$VENV_PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null || echo "unknown")
python3 bench/provenance.py --note "vLLM: $VLLM_VERSION ($VLLM_ROOT/venv)" "$BIN" target/release/loadgen >"$OUT/provenance.md"
LB=""
cleanup() { [ -n "$LB" ] && kill "$LB" 2>/dev/null || true; [ -n "${EXISTING:-}" ] || STOP=1 "$SERVE" "$P1" "$P2" >/dev/null 2>&1 || true; }
trap cleanup EXIT

profile() {  # the config fragment of a policy
  case "${1%-x2}" in
    sglang) : ;;
    random) printf '[[plugins]]\ntype = "random-picker"\n[[scheduling_profiles]]\nname = "random"\nplugins = [{ plugin_ref = "random-picker" }]\n' ;;
    round-robin) printf '[[plugins]]\ntype = "round-robin-picker"\n[[scheduling_profiles]]\nname = "round-robin"\nplugins = [{ plugin_ref = "round-robin-picker" }]\n' ;;
    load-only) printf '[[plugins]]\ntype = "queue-scorer"\n[[plugins]]\ntype = "kv-cache-utilization-scorer"\n[[plugins]]\ntype = "inflight-scorer"\n[[plugins]]\ntype = "max-score-picker"\n[[scheduling_profiles]]\nname = "load-only"\nplugins = [{ plugin_ref = "queue-scorer", weight = 2 }, { plugin_ref = "kv-cache-utilization-scorer", weight = 2 }, { plugin_ref = "inflight-scorer", weight = 1 }, { plugin_ref = "max-score-picker" }]\n' ;;
    prefix-only) printf '[[plugins]]\ntype = "prefix-cache-scorer"\n[[plugins]]\ntype = "max-score-picker"\n[[scheduling_profiles]]\nname = "prefix-only"\nplugins = [{ plugin_ref = "prefix-cache-scorer", weight = 1 }, { plugin_ref = "max-score-picker" }]\n' ;;
    approximate|default) : ;;
    precise) printf '[kv_events]\ndefault = "auto"\n[tokenization]\ndir = "%s"\n' "$TOKENIZER" ;;
    *) if [ -f "bench/policies/${1%-x2}.toml" ]; then  # a policy file, its fixture tokenizer swapped for the model's
         sed "s#tests/fixtures/tiny-llama#$TOKENIZER#" "bench/policies/${1%-x2}.toml"
       else echo "unknown policy $1" >&2; exit 2; fi ;;
  esac
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

URLS=${EXISTING:-"http://127.0.0.1:$P1 http://127.0.0.1:$P2"}
if [ -z "${EXISTING:-}" ]; then
  echo "== starting two vLLM servers (BLOCKS=$BLOCKS, KV events, dev endpoints)" >&2
  # One core each: left to itself, the CPU build binds every server's OpenMP thread to core 0
  # (reserving the other for the frontend), so two servers share one core and a request that
  # meets the other's step waits seconds (TTFT p90 1–3 s here, against 50–100 ms pinned apart).
  VLLM_CPU_OMP_THREADS_BIND=0 "$SERVE" "$P1" >&2
  VLLM_CPU_OMP_THREADS_BIND=$(( $(nproc) > 1 ? 1 : 0 )) "$SERVE" "$P2" >&2
fi
# Warm-up: each server first serves the workload (other seeds) directly, twice, so the first
# policy does not meet a server's first batches (WARMUP=0 skips it).
if [ "${WARMUP:-1}" != 0 ]; then
  for u in $URLS; do
    for w in 1 2; do
      target/release/loadgen run --url "$u" --model tiny-llama --workload "$WORKLOAD" --groups "$GROUPS_N" --prompts "$PROMPTS" \
        --conversations "$CONVERSATIONS" --turns "$TURNS" --system-tokens "$SYSTEM" --question-tokens "$QUESTION" \
        --output-tokens "$OUTPUT" --rate "$RATE" --seed $((1000 + w)) --zipf "$ZIPF" >/dev/null 2>&1 &
    done
  done
  wait
fi
for rep in $(seq 1 "$REPEAT"); do
for policy in $POLICIES; do
  run=$policy; [ "$REPEAT" = 1 ] || run=$policy.r$rep
  for u in $URLS; do curl -sf -X POST "$u/reset_prefix_cache" >/dev/null || { echo "cannot reset $u's prefix cache (needs DEV=1)" >&2; exit 1; }; done
  profile "$policy" > "$OUT/$policy.fragment.toml"
  PORT=$(free_port)
  if [ "$policy" = sglang ]; then
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m sglang_router.launch_router --worker-urls $URLS --policy cache_aware \
      --host 127.0.0.1 --port "$PORT" --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" \
      >"$OUT/$run.router.log" 2>&1 &
  elif [[ "$policy" == *-x2 ]]; then
    rm -f "$OUT/$run.replicas"
    PORTS_FILE="$OUT/$run.replicas" EXTRA_CONFIG="$OUT/$policy.fragment.toml" bench/replica_front.sh 2 "$PORT" $URLS &
  else
    { printf 'listen = "127.0.0.1:%s"\nlog_level = "warn"\n' "$PORT"; for u in $URLS; do printf '[[backends]]\nurl = "%s"\n' "$u"; done; cat "$OUT/$policy.fragment.toml"; } > "$OUT/$policy.toml"
    "$BIN" --config "$OUT/$policy.toml" &
  fi
  LB=$!
  for _ in $(seq 1 300); do curl -sf -o /dev/null "http://127.0.0.1:$PORT/v1/models" && break; sleep 0.1; done
  if [ "$policy" = sglang ]; then  # its /v1/models answers before its workers are registered
    n=$(echo "$URLS" | wc -w)
    for _ in $(seq 1 300); do
      [ "$(curl -sf "http://127.0.0.1:$PORT/workers" | grep -o '"is_healthy":true' | wc -l)" -ge "$n" ] && break; sleep 0.1
    done
  fi
  METRICS=()
  for u in $URLS; do METRICS+=(--backend-metrics "$u"); done
  for u in $URLS; do curl -s "$u/metrics" > "$OUT/$run.before.$(echo "$u" | tr -c 'a-z0-9\n' _)"; done
  target/release/loadgen run --url "http://127.0.0.1:$PORT" --model tiny-llama --workload "$WORKLOAD" --groups "$GROUPS_N" --prompts "$PROMPTS" \
    --conversations "$CONVERSATIONS" --turns "$TURNS" \
    --system-tokens "$SYSTEM" --question-tokens "$QUESTION" --output-tokens "$OUTPUT" --rate "$RATE" --seed "$SEED" --zipf "$ZIPF" --block-size 128 \
    "${METRICS[@]}" --json "$OUT/$run.json" --dump-requests "$OUT/$run.requests.jsonl" >&2
  for u in $URLS; do curl -s "$u/metrics" > "$OUT/$run.after.$(echo "$u" | tr -c 'a-z0-9\n' _)"; done
  # The router's own series (prefix returns, thrash, replicas) for inferlb policies.
  if [[ "$policy" == *-x2 ]]; then
    i=0; while read -r rp; do i=$((i + 1)); curl -s "http://127.0.0.1:$rp/metrics" > "$OUT/$run.router$i.metrics" || true; done < "$OUT/$run.replicas"
  elif [ "$policy" != sglang ]; then
    curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/$run.router.metrics" || true
  fi
  kill "$LB"; wait "$LB" 2>/dev/null || true; LB=""
done
done

python3 bench/real_vllm_bound.py "$OUT" "$(echo "$URLS" | cut -d' ' -f1)" "$ZIPF" "$SEED" "$GROUPS_N" "$RATE" $POLICIES
# The requests each run sent (with each answer's backend) stay there, for bench/lru_oracle.py.
echo "requests, metrics pages and loadgen summaries: $OUT" >&2
