"""A throwaway PostgreSQL server from the distribution's packages, for the tests of the cluster's
store (tests/unit/test_store_backends.py) and bench/bench_cluster.py.

The server lives in a fresh temporary directory (data, log and its unix socket), trusts every
local connection, listens on 127.0.0.1 on a free port and runs with ``fsync=off``: nothing it holds
outlives it. initdb refuses to run as root, so as root the server runs as the ``postgres`` user the
package creates. ``stop()`` (also registered with atexit) kills it and removes the directory.

    with running_postgres() as pg:
        db = PostgreSQL(pg.url)                       # the database "kernelhost"
        other = PostgreSQL(pg.new_database("t_1"))    # an empty one, for an isolated test
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

PG_ROOT = Path("/usr/lib/postgresql")
OS_USER = "postgres"
DATABASE = "kernelhost"
TIMEOUT = 60  # seconds: every wait below has this deadline
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def pg_bin() -> Path:
    """The bin directory of the newest PostgreSQL version installed."""
    versions = []
    if PG_ROOT.is_dir():
        for d in PG_ROOT.iterdir():
            if (d / "bin" / "initdb").is_file() and (d / "bin" / "pg_ctl").is_file():
                with contextlib.suppress(ValueError):
                    versions.append((float(d.name), d / "bin"))
    if not versions:
        raise RuntimeError(
            f"no PostgreSQL server binaries under {PG_ROOT}/<version>/bin; install the "
            "distribution's postgresql package (scripts/install-deps.sh does)"
        )
    return max(versions)[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class PostgresServer:
    def __init__(self) -> None:
        self.bin = pg_bin()
        self.as_root = os.geteuid() == 0
        self.dir = Path(tempfile.mkdtemp(prefix="kh-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.port = 0
        self._running = False
        atexit.register(self.stop)
        try:
            if self.as_root:
                shutil.chown(self.dir, OS_USER, OS_USER)
            self.dir.chmod(0o700)
            self._start()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return self.url_of(DATABASE)

    def url_of(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A server binary, as the ``postgres`` user when we are root; a failure says why."""
        prefix = ["runuser", "-u", OS_USER, "--"] if self.as_root else []
        cmd = [*prefix, str(self.bin / args[0]), *args[1:]]
        try:
            done = subprocess.run(
                cmd, cwd=self.dir, capture_output=True, text=True, timeout=TIMEOUT + 30, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{args[0]} did not finish within {TIMEOUT + 30} s{self._log_tail()}") from exc
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} exited {done.returncode}: {(done.stderr or done.stdout).strip()[-2000:]}"
                f"{self._log_tail()}"
            )
        return done

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return "\nserver log:\n" + self.log.read_text(errors="replace")[-2000:]
        return ""

    def _start(self) -> None:
        self._run(
            "initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust",
            "-E", "UTF8", "--locale=C", "--no-sync",
        )  # fmt: skip
        options = " ".join(
            [
                "-c listen_addresses=127.0.0.1",
                f"-c unix_socket_directories={self.dir}",
                "-c fsync=off",
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
                "-c max_connections=300",
            ]
        )
        for attempt in range(3):  # the free port may be taken between choosing and binding it
            self.port = free_port()
            try:
                self._run(
                    "pg_ctl", "start", "-D", str(self.data), "-l", str(self.log), "-w", "-t", str(TIMEOUT),
                    "-o", f"{options} -p {self.port}",
                )  # fmt: skip
                break
            except RuntimeError:
                if attempt == 2 or "already in use" not in self._log_tail():
                    raise
        self._running = True
        self._sql("postgres", f'CREATE DATABASE "{DATABASE}"')

    def _sql(self, database: str, statement: str) -> None:
        import psycopg

        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                with psycopg.connect(self.url_of(database), autocommit=True, connect_timeout=10) as conn:
                    conn.execute(statement.encode())
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def new_database(self, name: str) -> str:
        """Create the empty database ``name`` (lower-case letters, digits, ``_``); its URL."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"database name {name!r}: use lower-case letters, digits and _ (at most 63)")
        self._sql("postgres", f'CREATE DATABASE "{name}"')
        return self.url_of(name)

    def stop(self) -> None:
        """Kill the server (no shutdown checkpoint: nothing is kept) and remove its directory."""
        if self._running:
            self._running = False
            with contextlib.suppress(RuntimeError):
                self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w", "-t", str(TIMEOUT))
        if self.dir.exists():
            shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.stop)


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        yield server
    finally:
        server.stop()


if __name__ == "__main__":  # a server to try things against by hand: Ctrl-C stops it
    with running_postgres() as pg:
        print(pg.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
