"""A real etcd cluster on this host, for the tests and ``fastreduce bench``: ``n`` ``etcd``
processes (Debian's ``etcd-server``, or any ``etcd`` on ``PATH``) on loopback ports, each
with a data directory of its own, killed and restarted one at a time as a failure would.

    with EtcdCluster(3, root) as cluster:
        m = fastreduce.Membership(cluster.address("job"), world_size=4)
        cluster.kill(cluster.leader())          # SIGKILL, as a host's loss
        cluster.start(i)                        # back, from its data directory
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

__all__ = ["COMPACTION", "LAN", "EtcdCluster", "etcd_binary", "temporary_cluster"]

LAN = {"heartbeat_ms": 50, "election_ms": 500}
"""etcd tuned for a LAN (its tuning guide: a heartbeat near the round trip, an election 10 of
them); at its defaults (100 ms, 1 s) an election takes 1-2 s more."""


def etcd_binary() -> str | None:
    """The ``etcd`` server on ``PATH`` (``apt-get install etcd-server``), or ``None``."""
    return shutil.which("etcd")


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


COMPACTION = ("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m")
"""etcd's history compacted every 5 minutes, keeping 5 minutes: a job writes a revision per
heartbeat, pulse, vote and status (about 10 a second per member), which etcd keeps until it
compacts, and an etcd that never does reaches its space quota and refuses every write
(docs/faults.md)."""


class EtcdCluster:
    """``n`` etcd members on 127.0.0.1 under ``root`` (``root/e<i>``: data and log). Elections
    at etcd's defaults (100 ms heartbeat, 1 s election timeout), its history compacted
    (:data:`COMPACTION`); ``quota_bytes``: etcd's space quota (``--quota-backend-bytes``; its
    default, 2 GiB). :meth:`close` kills them all."""

    def __init__(self, n: int, root: str | Path, *, election_ms: int = 1000, heartbeat_ms: int = 100,
                 quota_bytes: int | None = None):
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd server on PATH: apt-get install etcd-server (Debian, Ubuntu)")
        self.binary, self.root, self.n = binary, Path(root), n
        self.election_ms, self.heartbeat_ms, self.quota_bytes = election_ms, heartbeat_ms, quota_bytes
        ports = _free_ports(2 * n)
        self.client_ports, self.peer_ports = ports[:n], ports[n:]
        self.procs: list[subprocess.Popen | None] = [None] * n
        self._cluster = ",".join(f"e{i}=http://127.0.0.1:{self.peer_ports[i]}" for i in range(n))

    def __enter__(self) -> EtcdCluster:
        for i in range(self.n):
            self.start(i, wait=False)
        self.wait_ready()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    def address(self, job: str = "default") -> str:
        """The coordinator address a :class:`~fastreduce.Membership` takes: every endpoint, and the job."""
        return f"etcd://{','.join(self.endpoints)}/{job}"

    def start(self, i: int, wait: bool = True) -> None:
        """Member ``i`` started (again: from its data directory, rejoining the cluster)."""
        folder = self.root / f"e{i}"
        folder.mkdir(parents=True, exist_ok=True)
        url, peer = f"http://127.0.0.1:{self.client_ports[i]}", f"http://127.0.0.1:{self.peer_ports[i]}"
        args = [self.binary, "--name", f"e{i}", "--data-dir", str(folder / "data"),
                "--listen-client-urls", url, "--advertise-client-urls", url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", self._cluster, "--initial-cluster-token", f"fastreduce-{os.getpid()}",
                "--initial-cluster-state", "new", "--heartbeat-interval", str(self.heartbeat_ms),
                "--election-timeout", str(self.election_ms), *COMPACTION, "--log-level", "warn", "--logger", "zap"]
        if self.quota_bytes is not None:
            args += ["--quota-backend-bytes", str(self.quota_bytes)]
        log = open(folder / "etcd.log", "ab")
        try:
            self.procs[i] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        if wait:
            self.wait_ready([i])

    def kill(self, i: int) -> None:
        """Member ``i`` SIGKILLed (no goodbye to its peers), and reaped."""
        proc = self.procs[i]
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            self.procs[i] = None

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]

    def status(self, i: int, timeout: float = 1.0) -> dict[str, Any] | None:
        """Member ``i``'s ``/v3/maintenance/status`` (its id and the leader's), or ``None``."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.client_ports[i]}/v3/maintenance/status",
                                     data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as answer:
                return json.loads(answer.read())
        except (OSError, ValueError):
            return None

    def leader(self, timeout: float = 30.0) -> int:
        """The index of the member that leads now (waiting for an election to end)."""
        deadline = time.monotonic() + timeout
        while True:
            for i in self.alive():
                st = self.status(i)
                if st and st.get("leader") and st["leader"] == st.get("header", {}).get("member_id"):
                    return i
            if time.monotonic() > deadline:
                raise TimeoutError(f"no etcd leader within {timeout:g} s (alive: {self.alive()})")
            time.sleep(0.05)

    def wait_ready(self, members: list[int] | None = None, timeout: float = 60.0) -> None:
        """Every member of ``members`` (default: all) answering, and a leader elected."""
        deadline = time.monotonic() + timeout
        for i in members if members is not None else range(self.n):
            while self.status(i) is None:
                proc = self.procs[i]
                if proc is None or proc.poll() is not None:
                    log = (self.root / f"e{i}" / "etcd.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"etcd member e{i} exited:\n{log}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd member e{i} did not answer within {timeout:g} s")
                time.sleep(0.05)
        self.leader(max(1.0, deadline - time.monotonic()))

    def close(self) -> None:
        for i in range(self.n):
            self.kill(i)


@contextlib.contextmanager
def temporary_cluster(n: int, prefix: str = "fastreduce-etcd-", **timings: int) -> Iterator[EtcdCluster]:
    """An :class:`EtcdCluster` of ``n`` members whose data lives in a temporary directory on
    tmpfs where the host has one (``/dev/shm``: etcd syncs every write to disk), killed and
    removed on exit; ``timings``: :class:`EtcdCluster`'s (e.g. :data:`LAN`)."""
    tmpfs = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix=prefix, dir=tmpfs) as root, EtcdCluster(n, root, **timings) as cluster:
        yield cluster
