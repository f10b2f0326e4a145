"""A TCP relay on the path between nodes: node B advertises the relay's address, so every call
another node forwards to B crosses it, byte for byte, and the relay keeps what the callers sent.
It is the attacker of issue 35 who can read the network between nodes; the tests take the
requests it saw and send them again, changed or not."""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field

KEEP_BYTES = 16 * 1024 * 1024  # what callers sent, the newest kept


@dataclass
class Captured:
    """One HTTP request as it crossed the relay: its request line and headers."""

    method: str
    target: str  # path and query, as sent
    headers: list[tuple[str, str]] = field(default_factory=list)

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


class Relay:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._seen: list[bytes] = []
        self._size = 0
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()

    def clear(self) -> None:
        with self._lock:
            self._seen, self._size = [], 0

    def sent(self) -> bytes:
        """What callers sent through the relay (the newest ``KEEP_BYTES``)."""
        with self._lock:
            return b"".join(self._seen)

    def requests(self) -> list[Captured]:
        """The heads of the requests callers sent (bodies skipped by searching for heads)."""
        out = []
        for block in self.sent().split(b"\r\n\r\n"):
            lines = block.split(b"\r\n")
            for start, line in enumerate(lines):  # a head may follow a body's tail in one block
                parts = line.split(b" ")
                if len(parts) == 3 and parts[2].startswith(b"HTTP/1.") and parts[1].startswith(b"/"):
                    req = Captured(parts[0].decode(errors="replace").split()[-1], parts[1].decode())
                    for raw in lines[start + 1 :]:
                        name, sep, value = raw.decode("latin-1").partition(":")
                        if sep:
                            req.headers.append((name.strip(), value.strip()))
                    out.append(req)
                    break
        return out

    def _keep(self, data: bytes) -> None:
        with self._lock:
            self._seen.append(data)
            self._size += len(data)
            while self._size > KEEP_BYTES and len(self._seen) > 1:
                self._size -= len(self._seen.pop(0))

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            threading.Thread(target=self._pair, args=(client, upstream), daemon=True).start()

    def _pair(self, client: socket.socket, upstream: socket.socket) -> None:
        back = threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True)
        back.start()
        try:
            self._pump(client, upstream, True)
            back.join(timeout=3600)
        finally:
            client.close()
            upstream.close()

    def _pump(self, source: socket.socket, sink: socket.socket, keep: bool) -> None:
        try:
            while True:
                data = source.recv(256 * 1024)
                if not data:
                    break
                if keep:
                    self._keep(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
            with contextlib.suppress(OSError):
                source.shutdown(socket.SHUT_RD)
