"""Hosts for real on one machine: network namespaces on a bridge, links rate-limited with ``tbf``.

Each host is a namespace with its own network stack, address and ``/dev/shm`` (so ranks
on two hosts never meet through shared memory); each is joined to a bridge in the root
namespace by a veth pair, and a ``tbf`` qdisc on both ends of each pair limits what the
host sends and what it receives to ``rate`` (this kernel has no ``netem``: no added
latency). Processes are started in a host with :meth:`Host.command`.

The hosts share this machine's cores, and so does the kernel's work of moving their
packets (veth, bridge, ``tbf``), which on real hosts each host's own cores do:
:func:`ring_traffic` measures what that takes.

Needs root and iproute2; :func:`can_make_hosts` says why not where they are missing.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

__all__ = ["Host", "can_make_hosts", "check_rate", "kill_all_in", "namespace_hosts", "ring_traffic"]


@dataclass(frozen=True)
class Host:
    ns: str
    ifname: str
    addr: str

    def command(self, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """``argv`` run in this host: its namespace, a private ``/dev/shm``, Gloo on its link."""
        extra = [f"{k}={v}" for k, v in {"GLOO_SOCKET_IFNAME": self.ifname, **(env or {})}.items()]
        return ["ip", "netns", "exec", self.ns, "unshare", "--mount", "sh", "-c",
                'mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$@"', "host", "env", *extra, *argv]

    def torchrun(self, hosts: list[Host], argv: list[str], rdzv_id: str, env: dict[str, str] | None = None,
                 port: int | None = None) -> list[str]:
        """:meth:`command` of ``torchrun`` for this host's node of a job on ``hosts``,
        one rank per host, the rendezvous served by the first host (the namespaces
        share the machine's hostname: which node hosts the store, and the address a
        node's workers are reached at, are said explicitly)."""
        endpoint = f"{hosts[0].addr}:{port or 29000 + os.getpid() % 1000}"
        run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
               "--rdzv-conf", f"is_host={int(self == hosts[0])},join_timeout=60", "--local-addr", self.addr, *argv]
        return self.command(run, env)

    def set_link(self, up: bool) -> None:
        """Take this host's link down (as a failed switch port or NIC: its processes stay
        alive, their connections stop answering) or back up."""
        _run("ip", "link", "set", f"{self.ifname}b", "up" if up else "down")


_calls = itertools.count()


def can_make_hosts() -> str | None:
    """``None`` where namespace hosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2, util-linux)"
    return None


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def _limit(ns: str | None, ifname: str, rate: str) -> None:
    """``tbf`` at ``rate`` (e.g. ``100mbit``) on what ``ifname`` sends; the bucket holds
    about 4 ms of traffic (at least 64 KB), the queue at most 100 ms of it."""
    bits = check_rate(rate)
    burst = max(64 * 1024, bits // 8 // 250)
    prefix = ["ip", "netns", "exec", ns] if ns else []
    _run(*prefix, "tc", "qdisc", "add", "dev", ifname, "root", "tbf", "rate", rate, "burst", str(burst),
         "latency", "100ms")


def kill_all_in(ns: str) -> None:
    """SIGKILL every process left in the namespace ``ns`` (torchrun starts its workers in
    sessions of their own: killing the launcher's process group does not reach them)."""
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in done.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def check_rate(rate: str) -> int:
    """``rate`` in bits per second; raises ValueError unless it reads like ``100mbit``."""
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            try:
                bits = float(rate[: -len(unit)])
            except ValueError:
                break
            if bits > 0:
                return int(bits * scale)
            break
    raise ValueError(f"rate must look like 100mbit or 1gbit, got {rate!r}")


@contextmanager
def namespace_hosts(n: int, rate: str | None = None, tag: str | None = None) -> Iterator[list[Host]]:
    """``n`` hosts on one bridge (addresses 10.23x.y.1 ...), each link limited to ``rate``
    both ways (none if ``None``); everything is removed on exit."""
    if n < 2:
        raise ValueError(f"n must be at least 2, got {n}")
    if rate is not None:
        check_rate(rate)
    why = can_make_hosts()
    if why:
        raise RuntimeError(f"cannot make network namespace hosts: {why}")
    # names of their own per call: a deleted namespace's devices go asynchronously
    tag = tag or str((os.getpid() * 16 + next(_calls)) % 100000)
    subnet = f"10.{232 + int(tag) % 20}.{int(tag) % 250}"
    bridge = f"frb{tag}"
    hosts = [Host(f"fr{tag}h{k}", f"fr{tag}h{k}", f"{subnet}.{k + 1}") for k in range(n)]
    made_ns: list[str] = []
    made_bridge = False
    try:
        _run("ip", "link", "add", bridge, "type", "bridge")
        made_bridge = True
        _run("ip", "link", "set", bridge, "up")
        for h in hosts:
            _run("ip", "netns", "add", h.ns)
            made_ns.append(h.ns)
            peer = f"{h.ifname}b"
            _run("ip", "link", "add", h.ifname, "type", "veth", "peer", "name", peer)
            _run("ip", "link", "set", h.ifname, "netns", h.ns)
            _run("ip", "link", "set", peer, "master", bridge)
            _run("ip", "link", "set", peer, "up")
            _run("ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _run("ip", "-n", h.ns, "link", "set", h.ifname, "up")
            _run("ip", "-n", h.ns, "link", "set", "lo", "up")
            if rate is not None:
                _limit(h.ns, h.ifname, rate)   # what the host sends
                _limit(None, peer, rate)       # what it receives
        yield hosts
    finally:
        for ns in made_ns:
            kill_all_in(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if made_bridge:
            subprocess.run(["ip", "link", "del", bridge], capture_output=True)


# ============================================================== the testbed's own cost

PORT = 5201


def _cpu_ticks() -> tuple[int, int]:
    """(busy, all) jiffies of this machine since boot (``/proc/stat``; idle and iowait are not busy)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def ring_traffic(hosts: list[Host], rate: str, seconds: float = 4.0) -> dict[str, object]:
    """Every host sends ``seconds`` of its link's ``rate`` to the next at once (a ring's
    pattern: each link busy both ways), one TCP stream each, nothing else running: each
    link's payload in Mbit/s and the share of this machine's CPU busy over the middle half
    of the streams. That CPU is the kernel moving the packets through veth, the bridge and
    ``tbf`` (the streams copy 1 MB at a time): on real hosts each host's own cores do it,
    for its own link only."""
    nbytes = int(check_rate(rate) / 8 * seconds)
    me = [sys.executable, __file__]  # the file alone: no torch to import in 2 x hosts processes
    recvs = [subprocess.Popen(h.command([*me, "recv", h.addr]), stdout=subprocess.PIPE, text=True) for h in hosts]
    sends = [subprocess.Popen(h.command([*me, "send", hosts[(i + 1) % len(hosts)].addr, str(nbytes)]))
             for i, h in enumerate(hosts)]
    try:
        time.sleep(seconds / 4)
        busy0, all0 = _cpu_ticks()
        time.sleep(seconds / 2)
        busy1, all1 = _cpu_ticks()
        for p in sends:
            if p.wait(timeout=60 + 4 * seconds):
                raise RuntimeError(f"ring_traffic: a sender exited with {p.returncode}")
        rates = [float(p.communicate(timeout=30)[0]) * 8 / 1e6 for p in recvs]
    finally:
        for p in sends + recvs:
            p.kill()
    return {"mbit_per_link": rates, "cpu_busy": (busy1 - busy0) / max(all1 - all0, 1)}


def _stream(role: str, addr: str, nbytes: int = 0) -> None:
    """One end of a :func:`ring_traffic` stream: ``recv`` prints the payload bytes per second
    it took in (from its first byte), ``send`` sends ``nbytes`` (once the receiver listens)."""
    import socket

    if role == "recv":
        with socket.create_server((addr, PORT)) as server:
            conn, _ = server.accept()
        view, got, first = memoryview(bytearray(1 << 20)), 0, 0.0
        with conn:
            while k := conn.recv_into(view):
                first = first or time.perf_counter()
                got += k
        print(got / (time.perf_counter() - first))
        return
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((addr, PORT), timeout=60)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    chunk = bytes(1 << 20)
    with conn:
        for _ in range(max(1, nbytes >> 20)):
            conn.sendall(chunk)


if __name__ == "__main__":
    _stream(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
