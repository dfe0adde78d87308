#!/usr/bin/env bash
# Several replicas: what a router replica keeps privately (its in-flight counts and its
# approximate prefix index) costs when two replicas share one fleet behind a round-robin
# front, against one replica behind the same front (and one without a front).
# Usage: bench/replicas.sh [extra loadgen compare flags, e.g. --zipf 1.0 --seed 2]
# Needs nginx (apt-get install nginx-light). Results: bench/results/compare-*.md/json.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nginx >/dev/null || { echo "replicas.sh: needs nginx (apt-get install nginx-light)" >&2; exit 2; }
cargo build --release -p loadgen -p inferlb -p vllm-sim
target/release/loadgen compare --workload shared-prefix --policies default \
  --router-cmd "one-replica-behind-nginx=bench/replica_front.sh 1 {port} {workers}" \
  --router-cmd "two-replicas-behind-nginx=bench/replica_front.sh 2 {port} {workers}" \
  --note "two-replicas: two inferlb processes (default profile) behind nginx round-robin, keep-alive upstream; one-replica: the same front with one" \
  "$@"
