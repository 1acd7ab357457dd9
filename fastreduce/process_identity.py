"""A process as its peers find it (:func:`identity`, read from /proc), and whether the
process a peer registered runs, or ran, where this one can see it: the heartbeat's
registration (:mod:`fastreduce.faults`) and a Membership's presence (:mod:`fastreduce.presence`)."""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

from .reach import base_store

__all__ = ["exited_here", "host_key", "identity", "proc_named_stat", "proc_stat", "running_here", "served_here", "who_of"]


def who_of(records: dict[int, str]) -> dict[int, str]:
    """``"pid P on host H"`` of each rank's registration (:func:`identity`), where it has one."""
    return {r: "pid {1} on host {0}".format(*rec.split()) for r, rec in records.items() if len(rec.split()) >= 2}


def identity() -> str:
    """This process as its peers find it: ``"<host> <pid> <network ns> <pid ns> <start>"``
    (the namespaces' inodes, the start time in clock ticks since boot; ``-`` where unknown)."""
    def read(what: Callable[[], Any]) -> str:
        try:
            return str(what())
        except (OSError, IndexError, ValueError):
            return "-"
    ns = [read(lambda k=k: os.stat(f"/proc/self/ns/{k}").st_ino) for k in ("net", "pid")]
    return " ".join([socket.gethostname(), str(os.getpid()), *ns, read(lambda: proc_stat(os.getpid())[19])])


def host_key() -> str:
    """This process's host as its peers tell hosts apart: the host name and the network
    namespace (the namespace's inode; ``-`` where unknown), so that processes in the network
    namespaces of one machine, each a host to the others, count as on hosts of their own."""
    try:
        net = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        net = "-"
    return f"{socket.gethostname()} {net}"


def proc_stat(pid: int | str) -> list[str]:
    """``/proc/<pid>/stat``'s fields from the state on (the name, which may hold spaces, cut off)."""
    return proc_named_stat(pid)[1]


def proc_named_stat(pid: int | str) -> tuple[str, list[str]]:
    """``/proc/<pid>/stat``'s name (a thread's too: ``/proc/<tid>`` serves a thread as it does a
    process) and its fields from the state on."""
    with open(f"/proc/{pid}/stat") as f:
        name, _, fields = f.read().partition("(")[2].rpartition(")")
    return name, fields.split()


def running_here(record: str, me: str | None = None) -> bool:
    """Whether the process ``record`` (:func:`identity`) names is one this process (``me``:
    its own registration, read here if not given) can see run: the same host, network and
    pid namespaces, that pid started then, and neither stopped nor a zombie."""
    fields, mine = record.split(), (me or identity()).split()
    if len(fields) != 5 or "-" in fields or [fields[0], *fields[2:4]] != [mine[0], *mine[2:4]]:
        return False
    try:
        now = proc_stat(fields[1])
    except (OSError, IndexError):
        return False
    return now[0] not in ("T", "t", "Z", "X") and now[19] == fields[4]


def exited_here(record: str, me: str) -> bool:
    """Whether the process ``record`` (:func:`identity`) names ran in
    this host's network and pid namespaces (``me``: this process's record) and has exited
    since: no such pid, another process under it, or a zombie. ``False`` where it cannot
    tell (another host, an unreadable record)."""
    fields, mine = record.split(), me.split()
    if len(fields) != 5 or "-" in fields or [fields[0], *fields[2:4]] != [mine[0], *mine[2:4]]:
        return False
    try:
        now = proc_stat(fields[1])
    except (OSError, IndexError):
        return True  # no such process
    return now[0] in ("Z", "X") or now[19] != fields[4]


def served_here(store: Any) -> bool:
    """Whether ``store`` (a ``TCPStore``, or a ``PrefixStore`` over one) is served at an
    address of this process's own network namespace: one this process could bind."""
    host = getattr(base_store(store), "host", None)
    if not host:
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address, 0))
            return True
        except OSError:
            continue
    return False
