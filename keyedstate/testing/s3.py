"""A local S3-compatible server (moto's, on loopback) for the test suite, the benchmarks and
``keyedstate chaos --s3``: real S3 protocol through s3fs, no cloud account."""

from __future__ import annotations

import os
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


def start_moto_server(env: Mapping[str, str] | None = None, timeout_s: float = 30.0,
                      idle: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``python -m moto.server`` on a free loopback port (``env``: its environment,
    default this process's) and return ``(process, endpoint URL)`` once it accepts
    connections. Raises ``RuntimeError`` (the process killed) if it exits or does not
    listen within ``timeout_s``. Stop it with :func:`stop_moto_server`.

    ``idle``: under Linux's ``SCHED_IDLE`` policy, set before the server starts a thread (the
    threads it starts per connection inherit it), so that it runs only on a core nothing else
    wants: a benchmark's stand-in for a remote store, whose CPU is not on the job's
    machines. Raises ``OSError`` where the policy does not exist."""
    if idle and not hasattr(os, "SCHED_IDLE"):
        raise OSError("SCHED_IDLE (idle priority) exists on Linux only")
    port = free_port()
    listen = ["-H", "127.0.0.1", "-p", str(port)]
    # SCHED_IDLE set in the child by a tiny wrapper, not by preexec_fn (unsafe with threads)
    command = ([sys.executable, "-c",
                "import os, runpy, sys; "
                "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
                "sys.argv = ['moto.server', *sys.argv[1:]]; "
                "runpy.run_module('moto.server', run_name='__main__', alter_sys=True)", *listen]
               if idle else [sys.executable, "-m", "moto.server", *listen])
    proc = subprocess.Popen(command, env=None if env is None else dict(env),
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
