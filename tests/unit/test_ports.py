"""Port routing without a VM: which host names name a sandbox's port, and the ``domain``
setting's check (docs/ports.md). Through real VMs: tests/clients/agents/test_e2b_fidelity.py."""

from __future__ import annotations

import pytest

from kernelhost.api.ports import host_pattern
from kernelhost.config import ConfigError, Settings

pytestmark = pytest.mark.unit

SID = "sbx_0123456789abcdef"


@pytest.mark.parametrize(
    ("host", "port", "sandbox"),
    [
        (f"8000-{SID}.sandboxes.example.com", "8000", SID),
        (f"8000-{SID}.sandboxes.example.com:443", "8000", SID),
        ("3000-sbx-0123456789abcdef.sandboxes.example.com", "3000", "sbx-0123456789abcdef"),
    ],
)
def test_a_sandbox_port_host_names_the_port_and_the_sandbox(host: str, port: str, sandbox: str) -> None:
    found = host_pattern("sandboxes.example.com").fullmatch(host)
    assert found is not None and (found[1], found[2]) == (port, sandbox)


@pytest.mark.parametrize(
    "host",
    [
        "sandboxes.example.com",  # the service itself
        "127.0.0.1:8999",
        f"8000-{SID}.sandboxes.example.com.evil.example",
        f"8000-{SID}.othersandboxes.example.com",
        f"x-{SID}.sandboxes.example.com",
        f"8000-{SID}x.sandboxes.example.com",
        f"a.8000-{SID}.sandboxes.example.com",
    ],
)
def test_other_host_names_go_to_the_service(host: str) -> None:
    assert host_pattern("sandboxes.example.com").fullmatch(host) is None


@pytest.mark.parametrize(
    "domain", ["localhost", "Sandboxes.Example.com", "x.example.com:8443", "https://x.example"]
)
def test_a_domain_that_is_no_dns_name_is_refused_with_the_fix(domain: str) -> None:
    with pytest.raises(ConfigError, match="use a lower-case DNS name without scheme or port"):
        Settings(domain=domain).validate()
