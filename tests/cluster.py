"""Local clusters for the tf.distribute tests: processes on loopback, always torn down.

Each process is a ``python tests/cluster_jobs.py <job> ...`` with its own
``TF_CONFIG``; ``Cluster`` starts them, waits a bounded time, and kills any
survivor (its whole process group) on the way out, pass or fail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

JOBS = Path(__file__).with_name("cluster_jobs.py")
ROOT = Path(__file__).resolve().parents[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago (bound to 0, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("localhost", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_config(cluster: dict[str, list[str]], task_type: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


class Cluster:
    """Starts processes and guarantees none outlives the ``with`` block."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, args: list[str], tf_config_json: str | None = None) -> subprocess.Popen:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
        env.pop("TF_CONFIG", None)
        if tf_config_json is not None:
            env["TF_CONFIG"] = tf_config_json
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(
            [sys.executable, str(JOBS), *args],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so kill() takes its children too
        )
        self.procs.append((name, proc))
        return proc

    def wait(self, proc: subprocess.Popen, timeout: float) -> int:
        """The exit code, or raise with the process's log if it runs past ``timeout`` seconds."""
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            name = next(n for n, p in self.procs if p is proc)
            raise AssertionError(f"{name} ran past {timeout} s:\n{self.log(name)}") from None

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()[-4000:]

    def kill(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        for _, proc in self.procs:
            self.kill(proc)
        assert all(p.poll() is not None for _, p in self.procs)


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    """Waits until ``path`` exists, failing early if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before writing {path}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.2)
