"""Hosts for real on one machine: network namespaces on a bridge, links rate-limited with ``tbf``.

Each host is a namespace with its own network stack, address and ``/dev/shm`` (so ranks
on two hosts never meet through shared memory); each is joined to a bridge in the root
namespace by a veth pair, and a ``tbf`` qdisc on both ends of each pair limits what the
host sends and what it receives to ``rate`` (this kernel has no ``netem``: no added
latency). Processes are started in a host with :meth:`Host.command`.

Needs root and iproute2; :func:`can_make_hosts` says why not where they are missing.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

__all__ = ["Host", "can_make_hosts", "check_rate", "kill_all_in", "namespace_hosts"]


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
