#!/usr/bin/env bash
# Install everything kernelhost needs on a Debian/Ubuntu host: the distribution's
# packages (QEMU, libvirt, image tools) and a Python virtualenv with the project and the extras
# named by EXTRAS (setup.cfg): `make serve` asks for `server`, `make test` for `server,jupyter,dev`.
# Idempotent: a second run installs nothing new.
set -eu -o pipefail

APT_PACKAGES=(
  qemu-system-x86 libvirt-daemon-system libvirt-daemon-driver-qemu libvirt-clients
  libvirt-dev pkg-config gcc python3-dev python3-venv
  mmdebstrap erofs-utils squashfs-tools busybox-static tini cpio zstd
  chromium  # the JupyterLab browser test (tests/clients/test_jupyter_lab.py)
  postgresql  # the cluster's store in the tests (tests/pg.py) and bench/bench_cluster.py
  strace  # lists what the host runs during a template build (tests/vm/test_template_security.py)
)
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-server,jupyter,dev}
PYTHON=${PYTHON:-python3}

need_apt() {
  local pkg
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || return 0
  done
  return 1
}

install_apt() {
  if need_apt; then
    echo "==> installing distribution packages: ${APT_PACKAGES[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      "${APT_PACKAGES[@]}" >/dev/null
  fi
}

# Node.js and npm, for the npm package in js/ (it needs node >= 20). A machine that already has
# node (e.g. from NodeSource) keeps it; only a missing one comes from the distribution.
install_node() {
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "==> installing nodejs and npm"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      nodejs npm >/dev/null
  fi
  local major
  major=$(node -p 'process.versions.node.split(".")[0]')
  if [ "$major" -lt 20 ]; then
    echo "warning: node $(node --version) is older than 20, which js/ needs; install Node.js 20" \
      "or newer (e.g. from NodeSource) before 'make test'" >&2
  fi
}

install_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating virtualenv $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  # one stamp per set of extras, each redone when the project's metadata changes
  local stamp="$VENV/.kernelhost-deps-${EXTRAS//,/-}"
  local want
  want=$(cat setup.cfg pyproject.toml VERSION | sha256sum | cut -c1-16)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "==> installing Python packages into $VENV: .[$EXTRAS]"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -e ".[$EXTRAS]"
    echo "$want" >"$stamp"
  fi
}

install_apt
install_node
install_venv
