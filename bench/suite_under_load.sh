#!/usr/bin/env bash
# Tests that hold under load (issue #24): every test binary `cargo test --workspace
# --all-features` builds, run twice at once (two copies of the suite on the same 2 cores), for
# N rounds. Cargo's artifact lock would serialise two `cargo test`s, so the binaries run
# directly, each from its package's directory as cargo runs it. Doc tests are not included.
set -u
N=${1:-3}
cd "$(dirname "$0")/.."
cargo test --workspace --all-features --no-run --message-format=json 2>/dev/null | python3 -c '
import sys, json
for l in sys.stdin:
    try:
        m = json.loads(l)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["executable"], m["manifest_path"])
' > /tmp/proof-bins.txt
echo "$(wc -l < /tmp/proof-bins.txt) test binaries"
run_copy() {
  local out=/tmp/proof-r$1-c$2.log
  : > "$out"
  while read -r exe manifest; do
    dir=$(dirname "$manifest")
    (cd "$dir" && CARGO_MANIFEST_DIR="$dir" "$exe" >> "$out" 2>&1) || echo "BINARY FAILED: $exe" >> "$out"
  done < /tmp/proof-bins.txt
}
for r in $(seq 1 "$N"); do
  start=$(date +%s)
  run_copy "$r" 1 & run_copy "$r" 2 & wait
  for c in 1 2; do
    f=/tmp/proof-r$r-c$c.log
    passed=$(grep -o '[0-9]* passed' "$f" | awk '{s+=$1} END {print s+0}')
    failed=$(grep -o '[0-9]* failed' "$f" | awk '{s+=$1} END {print s+0}')
    bad=$(grep -c 'BINARY FAILED' "$f")
    echo "round $r copy $c: $passed passed, $failed failed, $bad binaries failed ($(( $(date +%s) - start )) s)"
  done
done
