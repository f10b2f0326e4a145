"""ipykernel's own message-spec tests (``ipykernel/tests/test_message_spec.py`` of the guest's
ipykernel, 6.17.0, from its wheel on the registry, unmodified) against a kernelhost kernel: every
reply and IOPub message validated field by field.

The suite starts its kernel with jupyter_client's ``start_new_kernel()`` under the default name,
``python3``; here that name is a kernelspec installed by ``kernelhost kernelspec install --name
python3``, alone first on ``JUPYTER_PATH``, so jupyter_client starts a VM through the kernelhost
provisioner. The suite was written for pytest 7, which still called a module's nose-style
``setup()`` (where it starts the kernel): suite_plugins/nose_setup.py calls it under today's
pytest. No case is left out; the docs (docs/jupyter.md) say the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..harness import REPO, Service
from .suite_support import run_pytest, unpacked_wheel

pytestmark = [pytest.mark.clients, pytest.mark.timeout(1200)]

#: the guest's ipykernel: Debian bookworm's python3-ipykernel (its manifest lists 6.17.0-1)
GUEST_IPYKERNEL = "6.17.0"
SUITE = "ipykernel/tests/test_message_spec.py"
CASES = 23  # the module's test functions: each one ran, none was lost to collection
#: node id -> why the case cannot apply to a kernel in a VM (none today)
DESELECTED: dict[str, str] = {}


def _python3_kernelspec(env: dict[str, str], home: Path) -> str:
    """A ``python3`` kernelspec of kernelhost's, alone on a JUPYTER_PATH of its own."""
    prefix = home / "prefix"
    install = ["kernelspec", "install", "--name", "python3", "--prefix", str(prefix)]
    subprocess.run(
        [sys.executable, "-m", "kernelhost.cli", *install],
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
    )
    spec = prefix / "share" / "jupyter" / "kernels" / "python3" / "kernel.json"
    assert "kernelhost-provisioner" in spec.read_text(), spec.read_text()
    return str(prefix / "share" / "jupyter")


def _guest_ipykernel(service: Service) -> str:
    """The python template's ipykernel, as its image's manifest lists the Debian package."""
    image_dir = Path(service.env.get("KERNELHOST_IMAGE_DIR", "/var/cache/kernelhost/images"))
    manifest = json.loads((image_dir / "python" / "manifest.json").read_text())
    (package,) = [p for p in manifest["packages"] if p.startswith("python3-ipykernel ")]
    return str(package.split()[1].split("-")[0])


def _sandboxes_created(service: Service) -> int:
    return len(service.log_events("sandbox.created"))


def test_ipykernel_message_spec_suite_passes_against_a_vm_kernel(
    jupyter_env: dict[str, str], jupyter_service: Service, tmp_path: Path
) -> None:
    # a new guest ipykernel needs its own suite (6.29's wheel has no tests: its sdist does)
    assert _guest_ipykernel(jupyter_service) == GUEST_IPYKERNEL, "the guest's ipykernel changed"
    suite = unpacked_wheel("ipykernel", GUEST_IPYKERNEL)
    path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**jupyter_env, "PYTHONPATH": os.pathsep.join(path)}
    env["JUPYTER_PATH"] = _python3_kernelspec(env, tmp_path)
    created = _sandboxes_created(jupyter_service)
    counts = run_pytest(
        sys.executable,
        ["-p", "tests.clients.suite_plugins.nose_setup", SUITE],
        cwd=suite,
        env=env,
        report=tmp_path / "ipykernel.xml",
        deselect=DESELECTED,
        timeout=900,  # under the test's own limit: a hung suite is killed and reported
    )
    counts.report(f"ipykernel {GUEST_IPYKERNEL} test_message_spec.py")
    assert _sandboxes_created(jupyter_service) == created + 1  # its kernel was a VM of the service
    assert not counts.problems, counts.problems
    assert counts.deselected == len(DESELECTED) and not counts.skips, counts.skips
    assert counts.passed + counts.deselected == CASES, counts.output[-3000:]
