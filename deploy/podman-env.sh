# Sourced by the deploy/*.sh scripts: run podman the way this sandbox allows (see the
# project's notes on containers): runc, no default ulimits, host network; and make the base
# image the Dockerfile names from Debian's archive when it cannot be pulled.
set -euo pipefail
command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null
}
export CONTAINERS_CONF="${CONTAINERS_CONF:-/tmp/inferlb-containers.conf}"
[ -f "$CONTAINERS_CONF" ] || printf '[containers]\ndefault_ulimits = []\n' > "$CONTAINERS_CONF"
PODMAN=(podman --runtime runc)
BASE_IMAGE=docker.io/library/debian:trixie-slim

# The Dockerfile's base image: pulled where a registry is reachable, else made with
# debootstrap from Debian's archive and imported under the same name.
ensure_base_image() {
    if "${PODMAN[@]}" image exists "$BASE_IMAGE"; then return; fi
    if timeout 60 "${PODMAN[@]}" pull -q "$BASE_IMAGE" >/dev/null 2>&1; then return; fi
    local root; root=$(mktemp -d /tmp/trixie-root.XXXX)
    echo "making $BASE_IMAGE locally with debootstrap (no image registry reachable)"
    debootstrap --variant=minbase trixie "$root" http://deb.debian.org/debian >/dev/null
    tar -C "$root" -c . | "${PODMAN[@]}" import - "$BASE_IMAGE" >/dev/null
    rm -rf "$root"
}
