"""A `specserve serve` subprocess on a free loopback port: started in its own process group with its output
in a log file, ready once /health answers 200, and stopped with SIGTERM, then SIGKILL of the whole group.

`specserve compare` runs each configuration in one; tests use it too.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

import httpx

POLL_INTERVAL_S = 0.2


class ServerStartError(RuntimeError):
    """The server exited, or did not become ready in time; the message ends with its log's tail."""


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m specserve.cli serve --port PORT *args`, with stdout and stderr in `log_path`."""

    def __init__(self, args: Sequence[str], log_path: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = str(log_path)
        self._stop_rc: Optional[int] = None
        cmd = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(self.port), *args]
        self._log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        except BaseException:
            self._log.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 300) -> None:
        """Return once /health is 200; raise ServerStartError if the server exits or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise self._start_error(f"the server exited with code {self.proc.returncode} before it was ready")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise self._start_error(f"the server was not ready after {timeout:g} s")
            time.sleep(POLL_INTERVAL_S)

    def _start_error(self, what: str) -> ServerStartError:
        """`what`, the log's last line, then the log's tail."""
        tail = self.tail()
        last = tail.strip().splitlines()[-1] if tail.strip() else "(empty log)"
        return ServerStartError(f"{what}: {last}\nthe end of its log ({self.log_path}):\n{tail}")

    def stop(self, timeout: float = 40) -> Optional[int]:
        """SIGTERM (the server drains), wait up to `timeout` s, then SIGKILL whatever is left of its process
        group. The server's exit code, or None if it had to be killed."""
        if self._log.closed:  # stopped already
            return self._stop_rc
        rc = self.proc.poll()
        if rc is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                rc = None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group outlives its leader while any member lives
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._log.close()
        self._stop_rc = rc
        return rc

    def tail(self, lines: int = 30) -> str:
        """The last lines of the server's log."""
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
