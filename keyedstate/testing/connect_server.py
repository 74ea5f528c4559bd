"""A local Spark Connect server, started from pyspark's own distribution
(``sbin/start-connect-server.sh`` and ``jars/spark-connect_*.jar`` ship in the pip package), for
the tests of keyed jobs over Spark Connect (docs/spark.md, "Spark Connect").

The server runs in the foreground (``--wait``) in a session of its own, so that
:func:`stop_connect_server` ends it and every process it started (its JVM, the Python daemons
of its executors and the ``foreachBatch`` process, which take process groups of their own but
keep the session) and nothing else. Nothing here imports pyspark (the import contracts); it is
found by its location.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from keyedstate.testing.s3 import free_port

#: The script in pyspark's distribution that starts the server.
START_SCRIPT = os.path.join("sbin", "start-connect-server.sh")


@dataclass(frozen=True)
class ConnectServer:
    """A running server of :func:`start_connect_server`."""

    process: subprocess.Popen[bytes]
    #: what ``SparkSession.builder.remote`` takes: ``sc://127.0.0.1:<port>``
    url: str
    #: the server's output (Spark's log, and what the ``foreachBatch`` process prints)
    log_path: str


def spark_home() -> str | None:
    """pyspark's installed distribution (its package directory), None if pyspark is not
    installed."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(list(spec.submodule_search_locations)[0])


def missing_prerequisite() -> str | None:
    """Why no server can be started here (no Java, no pyspark, no start script), or None."""
    if shutil.which("java") is None:
        return "Java 17+ is not on PATH"
    home = spark_home()
    if home is None:
        return "pyspark is not installed"
    if not os.path.isfile(os.path.join(home, START_SCRIPT)):
        return f"pyspark's distribution at {home} has no {START_SCRIPT}"
    return None


def start_connect_server(work_dir: str, *, master: str = "local[2,4]",
                         python_path: list[str] | None = None,
                         conf: Mapping[str, str] | None = None,
                         timeout_s: float = 180.0) -> ConnectServer:
    """Start a Spark Connect server on a free loopback port with ``master``; its pid file and
    log go to ``work_dir`` (one per server: two servers never share a pid file). Its Python
    workers (executors' and ``foreachBatch``'s) run this interpreter with ``python_path``
    first on their path (the checkout under test: the classes a job pickles by reference
    must import there). Returns once the server accepts connections; raises
    ``RuntimeError`` (the server stopped) if it exits or does not listen within
    ``timeout_s``. Stop it with :func:`stop_connect_server`."""
    reason = missing_prerequisite()
    if reason is not None:
        raise RuntimeError(f"no Spark Connect server can be started: {reason}")
    home = spark_home()
    assert home is not None
    os.makedirs(work_dir, exist_ok=True)
    port = free_port()
    settings = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.ui.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.shuffle.partitions": "4",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        **(conf or {}),
    }
    env = dict(os.environ)
    env.update(SPARK_HOME=home, SPARK_PID_DIR=work_dir, SPARK_LOG_DIR=work_dir,
               PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([*(python_path or []),
                                           *filter(None, [env.get("PYTHONPATH")])]))
    command = ["bash", os.path.join(home, START_SCRIPT), "--wait", "--master", master]
    for key, value in settings.items():
        command += ["--conf", f"{key}={value}"]
    log_path = os.path.join(work_dir, "connect-server.log")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    server = ConnectServer(process, f"sc://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                stop_connect_server(server)
                with open(log_path, errors="replace") as f:
                    tail = f.read()[-2000:]
                raise RuntimeError(
                    f"the Spark Connect server did not start within {timeout_s:g} s; the end "
                    f"of its log ({log_path}):\n{tail}") from None
            time.sleep(0.5)


def _session_members(session_id: int) -> list[int]:
    """The processes of the session ``session_id`` (the server's: it leads its own)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the command may hold spaces and parentheses: fields follow the last ')'
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[3]) == session_id:
            members.append(int(entry))
    return members


def stop_connect_server(server: ConnectServer, timeout_s: float = 30.0) -> None:
    """End the server and every process of its session: SIGTERM (the JVM's shutdown hooks
    stop Spark), then SIGKILL for what is left after ``timeout_s``. Idempotent."""
    session = server.process.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _session_members(session):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if server.process.poll() is None:
                time.sleep(0.2)
                continue
            if not _session_members(session):
                return
            time.sleep(0.2)
    server.process.wait(timeout=timeout_s)
