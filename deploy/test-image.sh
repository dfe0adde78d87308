#!/usr/bin/env bash
# Builds the image from the Dockerfile with podman on this machine and runs it: the router
# container answers /health (and its own HEALTHCHECK passes), routes a chat completion to a
# vllm-sim container started from the same image, runs as a non-root user, and exits 0 on
# SIGTERM. Not part of CI (a dist build, fat LTO, of both binaries: ~40 minutes on 2 cores).
#   deploy/test-image.sh [TAG]      # TAG defaults to inferlb:test
# Containers use the host network (published ports do not work in this sandbox) on loopback
# ports 18100 (router) and 18101 (simulator).
set -euo pipefail
cd "$(dirname "$0")/.."
. deploy/podman-env.sh
tag=${1:-inferlb:test}
lb_port=18100 sim_port=18101
echo "== commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (uncommitted changes)'), $(date -u +%FT%TZ), $(nproc) cores"
ensure_base_image
ca=()
# This machine's package registries need the host's trust store: mounted into the build only.
if [ -n "${SSL_CERT_FILE:-}" ]; then ca=(--volume "$SSL_CERT_FILE:/host-ca.crt:ro" --build-arg BUILD_CA_FILE=/host-ca.crt); fi
# The build context is a snapshot of HEAD (git archive), not the working tree: the build takes
# long enough on 2 cores that edits made meanwhile would otherwise reach later steps (a first run
# here built the binaries from one commit and copied another commit's config.toml).
ctx=$(mktemp -d /tmp/inferlb-image-ctx.XXXXXX)
git archive HEAD | tar -x -C "$ctx"
echo "== podman build (context: git archive $(git rev-parse --short HEAD))"
start=$(date +%s)
"${PODMAN[@]}" build --network host --format docker "${ca[@]}" -t "$tag" "$ctx" > /tmp/inferlb-image-build.log 2>&1 \
    || { tail -n 40 /tmp/inferlb-image-build.log; exit 1; }
grep -E "^cargo [0-9]|^rustc [0-9]|Finished" /tmp/inferlb-image-build.log || true
echo "build took $(( $(date +%s) - start )) s"
echo "image size: $("${PODMAN[@]}" image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.1f MB", $1/1e6}')"
echo "healthcheck: $("${PODMAN[@]}" image inspect --format '{{json .HealthCheck.Test}}' "$tag")"

cleanup() { "${PODMAN[@]}" rm -f -t 0 ilb-test ilb-sim-test >/dev/null 2>&1 || true; rm -rf "$ctx"; }
trap cleanup EXIT
cleanup
"${PODMAN[@]}" run -d --name ilb-sim-test --network host --entrypoint vllm-sim "$tag" \
    --host 127.0.0.1 --port "$sim_port" --served-model-name demo-llama >/dev/null
"${PODMAN[@]}" run -d --name ilb-test --network host -e INFERLB_LISTEN=127.0.0.1:$lb_port "$tag" \
    --backend "http://127.0.0.1:$sim_port" >/dev/null
fail() { echo "FAIL: $*"; "${PODMAN[@]}" logs ilb-test 2>&1 | tail -n 20; exit 1; }
for _ in $(seq 1 100); do
    curl -fsS "http://127.0.0.1:$lb_port/ready" >/dev/null 2>&1 && break
    sleep 0.2
done
echo "== GET /health: $(curl -sS -w ' (%{http_code})' "http://127.0.0.1:$lb_port/health")"
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$lb_port/health")" = 200 ] || fail "/health"
"${PODMAN[@]}" healthcheck run ilb-test && echo "== HEALTHCHECK (the image's own command): healthy" || fail "HEALTHCHECK"
echo "== user inside the container: $("${PODMAN[@]}" exec ilb-test id)"
[ "$("${PODMAN[@]}" exec ilb-test id -u)" != 0 ] || fail "runs as root"
echo "== POST /v1/chat/completions"
out=$(curl -sS -D /tmp/inferlb-image-headers.txt "http://127.0.0.1:$lb_port/v1/chat/completions" \
    -H 'content-type: application/json' \
    -d '{"model":"demo-llama","max_tokens":8,"messages":[{"role":"user","content":"Hello from the image test"}]}')
status=$(head -n1 /tmp/inferlb-image-headers.txt | tr -d '\r')
backend=$(grep -i '^x-inferlb-backend:' /tmp/inferlb-image-headers.txt | tr -d '\r' | cut -d' ' -f2)
echo "$status; x-inferlb-backend: $backend"
echo "${out:0:300}"
[[ "$status" == *" 200"* ]] || fail "chat completion status"
[ "$backend" = "http://127.0.0.1:$sim_port" ] || fail "served by '$backend', not the simulator container"
echo "$out" | grep -q '"chat.completion"' || fail "not a chat completion"
echo "== SIGTERM"
"${PODMAN[@]}" kill --signal TERM ilb-test >/dev/null
code=$("${PODMAN[@]}" wait ilb-test)
echo "router container exit code after SIGTERM: $code"
"${PODMAN[@]}" logs ilb-test 2>&1 | tail -n 3
[ "$code" = 0 ] || fail "exit code $code"
"${PODMAN[@]}" kill --signal TERM ilb-sim-test >/dev/null
echo "simulator container exit code after SIGTERM: $("${PODMAN[@]}" wait ilb-sim-test)"
echo "PASS"
