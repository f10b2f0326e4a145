#!/bin/sh
# A node's start (the container's entrypoint, and the Nomad task's command): libvirt's daemons,
# the guest images (built on first start into KERNELHOST_IMAGE_DIR, reused after), the service.
set -eu
cd /opt/kernelhost
scripts/start-libvirt.sh
python3 guest-image/build.py
exec .venv/bin/kernelhost serve "$@"
