"""Enterprise Gateway's integration tests (``enterprise_gateway/itests`` of the
jupyter_enterprise_gateway wheel, from the registry, unmodified) against the service's Kernel
Gateway API: hello, restart, interrupt, scope and hostname on VM kernels of the python3,
python-datasci and r kernelspecs, and a kernel started for a named user (python).

The itests are configured the way Enterprise Gateway's own CI configures them, through their
environment variables: ``GATEWAY_HOST``, the kernelspec names (``PYTHON_KERNEL_LOCAL_NAME`` is
left at its default, ``python3``: the service's alias of the python template), the expected
hostname. Their client sends no credentials (they run against a gateway without
``EG_AUTH_TOKEN``), so ``GATEWAY_HOST`` is token_proxy.py, which adds the key's
``Authorization`` header and relays everything else unchanged, as a deployment's proxy does.
The cases that cannot apply to a VM kernel (Spark on YARN, Apache Toree's Scala kernel, Enterprise
Gateway's own user lists) are deselected, each with its reason, printed (``DESELECTED``).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from ..harness import Service
from .suite_support import SUMMARY, run_pytest, unpacked_wheel
from .token_proxy import serve

pytestmark = [pytest.mark.clients, pytest.mark.timeout(900)]

VERSION = "3.3.0"  # the latest release; its wheel ships itests/
ITESTS = "enterprise_gateway/itests"
#: the guest image's hostname (guest-image/build.py): the hostname cases check the kernel runs there
GUEST_HOSTNAME = "sandbox"
ENV = {
    # "a kernel on another host than the gateway": every kernel of kernelhost is (a VM)
    "PYTHON_KERNEL_DISTRIBUTED_NAME": "python-datasci",
    "R_KERNEL_LOCAL_NAME": "r",
    "AUTHORIZATION_KERNEL_NAME": "python",
    "ITEST_HOSTNAME_PREFIX": GUEST_HOSTNAME,
}

_SPARK = (
    "needs a Spark kernelspec (Spark on YARN in client or cluster mode, Spark's context `sc`): "
    "kernelhost has no Spark template"
)
_TOREE = "needs Apache Toree's Scala kernel with Spark: kernelhost has no Scala template"
_BASE = ["test_get_hostname", "test_hello_world", "test_interrupt", "test_restart"]
_SPARK_CASES = [
    "test_get_application_id",
    "test_get_deploy_mode",
    "test_get_resource_manager",
    "test_get_spark_version",
]
_PY_SPARK = [*_BASE, "test_scope", *_SPARK_CASES, "test_run_pi_example"]  # the last is skipped there too
_R_INTERRUPT = f"{ITESTS}/test_r_kernel.py::TestRKernelLocal::test_interrupt"


def _cases(module: str, cls: str, names: list[str], why: str) -> dict[str, str]:
    return {f"{ITESTS}/{module}::{cls}::{name}": why for name in names}


#: node id -> why the case cannot apply to a kernel in a VM
DESELECTED: dict[str, str] = {
    **_cases("test_python_kernel.py", "TestPythonKernelClient", _PY_SPARK, _SPARK),
    **_cases("test_python_kernel.py", "TestPythonKernelCluster", _PY_SPARK, _SPARK),
    **_cases("test_r_kernel.py", "TestRKernelClient", [*_BASE, *_SPARK_CASES], _SPARK),
    **_cases("test_r_kernel.py", "TestRKernelCluster", [*_BASE, *_SPARK_CASES], _SPARK),
    **_cases("test_scala_kernel.py", "TestScalaKernelLocal", _BASE, _TOREE),
    **_cases("test_scala_kernel.py", "TestScalaKernelClient", [*_BASE, *_SPARK_CASES], _TOREE),
    **_cases("test_scala_kernel.py", "TestScalaKernelCluster", [*_BASE, *_SPARK_CASES], _TOREE),
    f"{ITESTS}/test_authorization.py::TestAuthorization::test_unauthorized_users": (
        "checks Enterprise Gateway's per-kernelspec unauthorized_users list, keyed by the "
        "KERNEL_USERNAME the client claims: kernelhost authorizes by API key, a user name is a label"
    ),
}
#: only where the service emulates its VMs (TCG, no usable KVM): the case interrupts 1 s after
#: sending its cell, and an emulated VM's IRkernel has not entered the cell by then; an R
#: interrupt outside a cell ends IRkernel's process (R halts), as on any host
TCG_DESELECTED = {
    _R_INTERRUPT: (
        "interrupts 1 s after sending its cell; under TCG (no usable KVM) IRkernel has not entered "
        "the cell by then, and an interrupt outside a cell ends IRkernel (R halts), on any host"
    )
}
#: the cases run: Python (python3, python-datasci) 5 + 5, R 4, the authorized user's 1
CASES = 15


def _deselected_lines(deselect: dict[str, str]) -> list[str]:
    """Every deselected case, one line per class and reason, for the session's closing summary."""
    groups: dict[tuple[str, str], list[str]] = {}
    for node, why in deselect.items():
        where, _, name = node.removeprefix(ITESTS + "/").rpartition("::")
        groups.setdefault((where, why), []).append(name)
    return [f"  deselected {where}: {', '.join(names)}: {why}" for (where, why), names in groups.items()]


def _accelerator(service: Service) -> str:
    (chosen, *_) = service.log_events("accel.chosen")
    return str(chosen["accel"])


def test_enterprise_gateway_itests_pass_against_the_gateway_api(
    jupyter_service: Service, tmp_path: Path
) -> None:
    # their pattern is the prefix then "*" ("sandbo", then any "x"s): this machine's must not match
    assert GUEST_HOSTNAME[:-1] not in socket.gethostname(), socket.gethostname()
    suite = unpacked_wheel("jupyter_enterprise_gateway", VERSION)
    deselect = DESELECTED | (TCG_DESELECTED if _accelerator(jupyter_service) == "tcg" else {})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    created = len(jupyter_service.log_events("gateway.kernel_started"))
    with serve(jupyter_service.url, jupyter_service.api_key) as host:
        counts = run_pytest(
            sys.executable,
            [ITESTS],
            cwd=suite,
            env={**env, **ENV, "GATEWAY_HOST": host},
            report=tmp_path / "enterprise-gateway.xml",
            deselect=deselect,
            timeout=600,  # under the test's own limit: a hung suite is killed and reported
        )
    counts.report(f"jupyter_enterprise_gateway {VERSION} itests")
    SUMMARY.extend(_deselected_lines(deselect))
    assert not counts.problems, "\n".join(f"{k}: {v}" for k, v in counts.problems.items())
    assert counts.deselected == len(deselect) and not counts.skips, counts.skips
    assert counts.passed + len(deselect) - len(DESELECTED) == CASES, counts.output[-3000:]
    # each class's kernel, and the authorized user's, was a VM of the service
    assert len(jupyter_service.log_events("gateway.kernel_started")) == created + 4
