"""A local S3-compatible server (moto's, on loopback) for the test suite, the benchmarks and
``keyedstate chaos --s3``: real S3 protocol through s3fs, no cloud account."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Mapping


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_moto_server(env: Mapping[str, str] | None = None, timeout_s: float = 30.0
                      ) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``python -m moto.server`` on a free loopback port (``env``: its environment,
    default this process's) and return ``(process, endpoint URL)`` once it accepts
    connections. Raises ``RuntimeError`` (the process killed) if it exits or does not
    listen within ``timeout_s``. Stop it with :func:`stop_moto_server`."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=None if env is None else dict(env),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the local S3 server (moto) did not start") from None
            time.sleep(0.2)


def stop_moto_server(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Terminate a server of :func:`start_moto_server` and wait for it."""
    proc.terminate()
    proc.wait(timeout=timeout_s)
