"""Node-to-node calls, signed (docs/cluster.md, "Between nodes"; docs/security.md).

A node that forwards a client's call (or ``kernelhost node drain``) never sends the cluster
secret. It sends an HMAC-SHA256 signature, with a key derived from the secret, over:

    method, path and query (as sent, still percent-encoded), the owner it acts for (a key id; ''
    for the cluster itself), the node it comes from, the node it is for, the reservation it
    carries, a timestamp, a random nonce, and the body's binding:

- ``sha256:<hex>`` for a body the forwarder holds whole (a create's JSON): the peer reads it and
  compares before anything runs;
- ``stream:<length>`` (or ``stream:chunked``) for a body passed on as it comes (uploads, execute
  requests): bound by its length only, never buffered; its integrity in flight is TLS's
  (``advertise_url`` with https);
- ``none`` for no body.

The receiving node accepts a call only when it is for this node, its timestamp is within
``WINDOW`` seconds of this node's clock, the signature matches, and its nonce was not seen in
the window (a replay cache; a call signed before this node started is refused too, since the
cache starts empty). A captured request can thus be neither replayed nor altered.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping

from ...sandboxes import derive_key

OWNER = "X-Kernelhost-Owner"
FROM = "X-Kernelhost-From"
TO = "X-Kernelhost-To"
DATE = "X-Kernelhost-Date"
NONCE = "X-Kernelhost-Nonce"
RESERVATION = "X-Kernelhost-Reservation"
BODY = "X-Kernelhost-Body"
SIGNATURE = "X-Kernelhost-Signature"
SIGNED = (OWNER, FROM, TO, RESERVATION, DATE, NONCE, BODY)
WINDOW = 30.0  # seconds a signed call is valid either side of the receiver's clock
MAX_NONCES = 500_000  # nonces remembered at once (a call each: far beyond one node's rate)
VERSION = "kernelhost-peer-v1"


class Refused(Exception):
    """A node-to-node call that must not be served: unsigned, altered, stale or replayed."""


def body_binding(body: bytes | None, *, streamed: bool, length: int | None) -> str:
    if body is not None:
        return "sha256:" + hashlib.sha256(body).hexdigest()
    if streamed:
        return f"stream:{length if length is not None else 'chunked'}"
    return "none"


def _canonical(method: str, path_qs: str, fields: Mapping[str, str]) -> bytes:
    return "\n".join([VERSION, method.upper(), path_qs, *(fields.get(h, "") for h in SIGNED)]).encode()


def _mac(secret: str, method: str, path_qs: str, fields: Mapping[str, str]) -> str:
    key = derive_key(secret, "node-to-node calls")
    return hmac.new(key, _canonical(method, path_qs, fields), hashlib.sha256).hexdigest()


def sign(
    secret: str,
    method: str,
    path_qs: str,
    *,
    owner: str,
    from_node: str,
    to_node: str,
    body: str = "none",
    reservation: str = "",
    now: float | None = None,
) -> dict[str, str]:
    """The headers of one signed call (``path_qs``: as it goes on the wire, percent-encoded)."""
    fields = {
        OWNER: owner,
        FROM: from_node,
        TO: to_node,
        RESERVATION: reservation,
        DATE: f"{time.time() if now is None else now:.3f}",
        NONCE: secrets.token_hex(16),
        BODY: body,
    }
    fields[SIGNATURE] = _mac(secret, method, path_qs, fields)
    if not reservation:
        del fields[RESERVATION]
    return fields


class Verifier:
    """The receiving end: checks a call's signature, freshness and nonce."""

    def __init__(
        self, secret: str, node_id: str, window: float = WINDOW, max_nonces: int = MAX_NONCES
    ) -> None:
        self.secret, self.node_id, self.window, self.max_nonces = secret, node_id, window, max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it may be forgotten
        # the nonces seen before a restart are gone: calls signed before this start are refused
        self.started = time.time()
        self._lock = threading.Lock()

    def verify(self, method: str, path_qs: str, headers: Mapping[str, str], now: float | None = None) -> None:
        """Raise ``Refused`` unless the call is signed for this node, fresh and new."""
        if not self.secret:
            raise Refused("this node has no cluster_secret: it is not a cluster node")
        missing = [h for h in (SIGNATURE, DATE, NONCE, TO, BODY) if not headers.get(h)]
        if missing:
            raise Refused(f"unsigned node-to-node call: {', '.join(missing)} missing")
        if headers[TO] != self.node_id:
            raise Refused(f"this call was signed for node {headers[TO][:64]!r}, not for {self.node_id!r}")
        now = time.time() if now is None else now
        try:
            date = float(headers[DATE])
        except ValueError:
            raise Refused(f"{DATE} is not a timestamp") from None
        if not abs(now - date) <= self.window:
            raise Refused(
                f"{DATE} is {now - date:+.0f} s off this node's clock (allowed: {self.window:.0f} s): "
                "a stale or replayed call, or the nodes' clocks disagree (run NTP on every node)"
            )
        want = _mac(self.secret, method, path_qs, headers)
        if not hmac.compare_digest(headers[SIGNATURE].encode(), want.encode()):
            raise Refused(
                "bad node-to-node signature: the call was altered, or the nodes' cluster_secret differ"
            )
        if date < self.started - 0.001:  # the date is written to the millisecond
            raise Refused(
                "this call was signed before this node started (it cannot know whether it was seen); "
                "send it again"
            )
        self._remember(headers[NONCE], date + self.window, now)

    def _remember(self, nonce: str, forget_at: float, now: float) -> None:
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise Refused("replayed node-to-node call: its nonce was seen already")
            if len(self._seen) >= self.max_nonces:
                raise Refused("too many node-to-node calls in the window to remember; retry")
            self._seen[nonce] = forget_at
