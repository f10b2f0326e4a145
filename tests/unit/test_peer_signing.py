"""Issue 35, finding 12, the parts without a cluster: node-to-node signatures (``signing.py``)
and what a node checks in the rows of the store it shares (``sandboxes/trust.py``). The cluster
tier mounts the same attacks through real nodes (tests/cluster/test_between_nodes.py)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from kernelhost.api.cluster.signing import (
    BODY,
    DATE,
    NONCE,
    OWNER,
    SIGNATURE,
    TO,
    Refused,
    Verifier,
    body_binding,
    sign,
)
from kernelhost.config import ConfigError, Settings
from kernelhost.sandboxes.trust import inside, node_url_mac, registration_problem, url_problem

pytestmark = pytest.mark.unit

SECRET = secrets.token_hex(32)
PATH = "/v1/sandboxes/sbx_1/execute?x=%26y"


def _signed(**kw: object) -> dict[str, str]:
    args: dict[str, object] = {"owner": "key_a", "from_node": "node-a", "to_node": "node-b"}
    args.update(kw)
    return sign(SECRET, "POST", PATH, **args)  # type: ignore[arg-type]


def test_a_signed_call_passes_once_and_its_replay_is_refused() -> None:
    verifier = Verifier(SECRET, "node-b")
    headers = _signed(body=body_binding(None, streamed=True, length=12))
    verifier.verify("POST", PATH, headers)
    with pytest.raises(Refused, match="replayed"):
        verifier.verify("POST", PATH, headers)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({OWNER: "key_b"}, "signature"),
        ({BODY: "stream:13"}, "signature"),
        ({NONCE: "0" * 32}, "signature"),
        ({TO: "node-c"}, "signed for node 'node-c'"),
    ],
)
def test_an_altered_header_is_refused(change: dict[str, str], reason: str) -> None:
    headers = {**_signed(), **change}
    with pytest.raises(Refused, match=reason):
        Verifier(SECRET, "node-b").verify("POST", PATH, headers)


def test_an_altered_method_or_path_is_refused() -> None:
    headers = _signed()
    for method, path in [("DELETE", PATH), ("POST", "/v1/sandboxes/sbx_2/execute?x=%26y"), ("POST", "/v1/x")]:
        with pytest.raises(Refused, match="signature"):
            Verifier(SECRET, "node-b").verify(method, path, headers)


def test_a_stale_call_and_another_secret_are_refused() -> None:
    stale = _signed(now=1_000_000.0)
    with pytest.raises(Refused, match="off this node's clock"):
        Verifier(SECRET, "node-b").verify("POST", PATH, stale)
    with pytest.raises(Refused, match="signature"):
        Verifier(secrets.token_hex(32), "node-b").verify("POST", PATH, _signed())
    with pytest.raises(Refused, match="missing"):
        Verifier(SECRET, "node-b").verify("POST", PATH, {DATE: "1"})


def test_a_call_signed_before_the_node_started_is_refused() -> None:
    """The replay cache starts empty at each start: a call captured just before a restart must
    not pass after it."""
    headers = _signed()
    verifier = Verifier(SECRET, "node-b")
    verifier.started = float(headers[DATE]) + 0.01
    with pytest.raises(Refused, match="before this node started"):
        verifier.verify("POST", PATH, headers)


def test_the_secret_is_never_sent() -> None:
    headers = _signed(reservation="res_1")
    assert all(SECRET not in v for v in headers.values())
    assert len(headers[SIGNATURE]) == 64


def test_body_bindings() -> None:
    assert body_binding(b"{}", streamed=False, length=2).startswith("sha256:")
    assert body_binding(None, streamed=True, length=None) == "stream:chunked"
    assert body_binding(None, streamed=False, length=None) == "none"


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "http://user:pw@node-b:8999",
        "http://node-b:8999/steal",
        "http://node-b:8999?x=1",
        "http://:8999",
        "gopher://node-b",
        "http://node-b:99999",
    ],
)
def test_node_urls_of_bad_shape_are_refused(url: str) -> None:
    assert url_problem(url)
    assert registration_problem(SECRET, "node-b", url, node_url_mac(SECRET, "node-b", url))


@pytest.mark.parametrize("url", ["http://user:pw@10.0.0.2:8999", "http://10.0.0.2:8999/x", "ftp://10.0.0.2"])
def test_a_node_does_not_advertise_a_url_its_peers_would_refuse(tmp_path: Path, url: str) -> None:
    with pytest.raises(ConfigError, match="advertise_url"):
        Settings(state_dir=tmp_path, advertise_url=url).validate()
    Settings(state_dir=tmp_path, advertise_url="https://node-b.internal:8999").validate()


def test_a_node_row_counts_only_with_its_registration_mac() -> None:
    url = "http://10.0.0.2:8999"
    assert registration_problem(SECRET, "node-b", url, node_url_mac(SECRET, "node-b", url)) == ""
    mac = node_url_mac(SECRET, "node-b", url)
    assert "not registered" in registration_problem(SECRET, "node-b", "http://evil:8999", mac)
    assert "not registered" in registration_problem(SECRET, "node-x", url, mac)
    assert "not registered" in registration_problem(SECRET, "node-b", url, "")


def test_inside(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / "sbx_1").mkdir(parents=True)
    (tmp_path / "outside").write_text("x")
    (root / "sbx_1" / "link.zst").symlink_to(tmp_path / "outside")
    assert inside(root / "sbx_1" / "cp_1.zst", root) == root / "sbx_1" / "cp_1.zst"
    assert inside(root / ".." / "outside", root) is None
    assert inside(root / "sbx_1" / "link.zst", root) is None
    assert inside("/etc/passwd", root) is None
    assert inside(root, root) is None
    assert inside("", root) is None
