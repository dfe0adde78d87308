#!/usr/bin/env bash
# Checks (cargo check: everything but code generation) the whole workspace with exactly the toolchain Cargo.toml declares (`rust-version`),
# from the committed Cargo.lock (--locked), so the claim cannot drift: Debian 13's rustc/cargo
# (1.85.1) in a debian:trixie-slim container. Fails when the declared version and the
# container's toolchain differ, or when any locked crate needs a newer compiler.
#   deploy/check-msrv.sh            # prints the versions and cargo's output, exits non-zero on failure
set -euo pipefail
cd "$(dirname "$0")/.."
. deploy/podman-env.sh
declared=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
echo "== declared rust-version: $declared ($(git rev-parse --short HEAD)$(git diff --quiet HEAD -- Cargo.toml Cargo.lock || echo ', Cargo.toml/Cargo.lock modified'))"
for m in crates/*/Cargo.toml; do
    v=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' "$m")
    [ "$v" = "$declared" ] || { echo "FAIL: $m declares rust-version '${v:-none}', not $declared"; exit 1; }
done
ensure_base_image
ca_mount=()
if [ -n "${SSL_CERT_FILE:-}" ]; then ca_mount=(--volume "$SSL_CERT_FILE:/host-ca.crt:ro" --env CARGO_HTTP_CAINFO=/host-ca.crt); fi
# A throwaway container with the source mounted read-only; cargo's output goes to a volume
# of its own so the host's target/ is untouched.
"${PODMAN[@]}" run --rm --network host "${ca_mount[@]}" \
    --volume "$PWD:/src:ro" --volume inferlb-msrv-target:/target --volume inferlb-msrv-cargo:/root/.cargo \
    --env CARGO_TARGET_DIR=/target --env DECLARED="$declared" --workdir /src \
    "$BASE_IMAGE" bash -euc '
        if ! command -v cargo >/dev/null; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cargo rustc gcc libc6-dev ca-certificates >/dev/null
        fi
        echo "== toolchain: $(cargo --version) / $(rustc --version)"
        have=$(rustc --version | sed "s/rustc \([0-9]*\.[0-9]*\).*/\1/")
        [ "$have" = "$DECLARED" ] || { echo "FAIL: container rustc $have is not the declared $DECLARED"; exit 1; }
        set -o pipefail
        echo "== cargo check --workspace --all-targets --all-features --locked"
        cargo check --workspace --all-targets --all-features --locked 2>&1 | { grep -v "^ *\(Compiling\|Checking\|Downloaded\|Downloading\)" || true; }
        echo "OK: the workspace (every target, every feature) type-checks with rustc $have, the declared rust-version"'
