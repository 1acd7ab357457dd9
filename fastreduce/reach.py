"""Whether a c10d store's server can be reached, found out before c10d is asked to connect.

A ``TCPStore`` client whose server is not there retries until its timeout (30 s for the
coordinator, the process group's 10 minutes for ``MASTER_ADDR``) and, on the way, its C++
side writes a warning and a C++ backtrace per try to the process's stderr, which no Python
setting of the call can silence (``TORCH_CPP_LOG_LEVEL`` is read once, for the whole
process). So fastreduce first opens a plain TCP connection to ``host:port`` itself,
again and again until a short deadline (a server started a second after its clients is
still found), and raises its own one-line error where nothing answers: c10d is only
handed an address where something listens. The probe's connection is closed unused; a
``TCPStore`` server takes that quietly.

The deadline: ``connect_timeout_s=`` where the caller takes one, else
``$FASTREDUCE_CONNECT_TIMEOUT_S``, else 5 s.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable

__all__ = ["CONNECT_TIMEOUT_ENV", "DEFAULT_CONNECT_TIMEOUT_S", "SecondConnection", "clone", "connect_timeout",
           "transport_problem", "wait_for_listener"]

CONNECT_TIMEOUT_ENV = "FASTREDUCE_CONNECT_TIMEOUT_S"
"""Seconds to keep trying to reach a store's server (the coordinator, ``MASTER_ADDR``)."""
DEFAULT_CONNECT_TIMEOUT_S = 5.0
_FIRST_PAUSE_S, _LONGEST_PAUSE_S = 0.05, 0.5  # between tries, doubling


def connect_timeout(seconds: float | None = None) -> float:
    """The seconds to keep trying: ``seconds``, else ``$FASTREDUCE_CONNECT_TIMEOUT_S``, else 5."""
    if seconds is None:
        text = os.environ.get(CONNECT_TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_CONNECT_TIMEOUT_S
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"${CONNECT_TIMEOUT_ENV} must be a number of seconds, got {text!r}") from None
        where = f"${CONNECT_TIMEOUT_ENV}"
    else:
        where = "connect_timeout_s"
    if not seconds > 0:
        raise ValueError(f"{where} must be > 0 seconds, got {seconds}")
    return float(seconds)


def _try_once(host: str, port: int, seconds: float) -> str | None:
    """``None`` where a TCP connection to ``host:port`` opens within ``seconds``; else why not."""
    try:
        with socket.create_connection((host, port), timeout=seconds):
            return None
    except socket.gaierror as err:
        return f"the host name {host!r} does not resolve: {err.strerror or err}"
    except ConnectionRefusedError:
        return "connection refused: nothing listens at that port"
    except TimeoutError:
        return "no answer (a firewall, or a host that is down)"
    except OSError as err:
        return err.strerror or str(err)


def wait_for_listener(host: str, port: int, seconds: float) -> str | None:
    """``None`` as soon as something accepts a TCP connection at ``host:port``, trying
    until ``seconds`` have passed (a refused try is tried again after a short pause);
    else why the last try failed, in words."""
    deadline = time.monotonic() + seconds
    pause = _FIRST_PAUSE_S
    while True:
        why = _try_once(host, port, max(deadline - time.monotonic(), 0.01))
        left = deadline - time.monotonic()
        if why is None or left <= 0:
            return why
        time.sleep(min(pause, left))
        pause = min(2 * pause, _LONGEST_PAUSE_S)


def transport_problem(backend: str) -> str | None:
    """Why this process cannot make its end of a ``backend`` group (``None``: it can, or
    ``backend`` is not one checked here), found before it waits on any other process.

    Where one member cannot, the group's creation fails on that member alone, and only
    after every member has come to it: the others wait at the store for the address it
    never writes, for the group's whole timeout (a Membership's ``timeout_s``). Gloo: its
    devices made as torch makes them for a group, and let go at once (one per interface
    named in ``$GLOO_SOCKET_IFNAME``, comma separated, where it is set; else one on the
    address this host's name resolves to). NCCL: built in, and a CUDA device visible."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        if not dist.is_nccl_available():
            return "this torch was built without NCCL"
        return None if torch.cuda.is_available() else "no CUDA device is visible to this process"
    if backend != "gloo":
        return None
    if not dist.is_gloo_available():
        return "this torch was built without Gloo"
    names = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        if names is not None:  # (torch's test too: set at all, each name an interface)
            for name in names.split(","):
                dist.ProcessGroupGloo.create_device(interface=name)
        else:
            dist.ProcessGroupGloo.create_default_device()
    except RuntimeError as err:
        here = ", ".join(name for _, name in socket.if_nameindex())
        what = str(err).strip().splitlines()[0].split("] ")[-1]  # (Gloo's text, without the source line)
        if names is not None:
            return (f"$GLOO_SOCKET_IFNAME={names!r} names no interface with an address here ({what}); this host's "
                    f"interfaces: {here}. Name the one that reaches the other members' hosts")
        return (f"no address of this host to listen on ({what}): set $GLOO_SOCKET_IFNAME to the interface, of "
                f"{here}, that reaches the other members' hosts")
    return None


def clone(store: Any) -> Any:
    """``store.clone()``: a client of its own to the same server. torch 2.6's ``TCPStore`` has
    no ``clone`` (2.7 added it): there, a second client to its host and port, which is what
    ``clone`` makes. ``TypeError`` where neither is possible (2.6's ``PrefixStore``)."""
    if hasattr(store, "clone"):
        return store.clone()
    import torch.distributed as dist

    if isinstance(store, dist.TCPStore):
        return dist.TCPStore(store.host, store.port, is_master=False, timeout=store.timeout)
    raise TypeError(f"a {type(store).__name__} cannot make a connection of its own on this torch")


class SecondConnection:
    """A connection of its own to a c10d ``store`` (:func:`clone`, each request bounded
    by ``timeout_s``), made on a thread of its own while its user goes on over ``store``.

    A new c10d connection can take 10 s: torch's client (and server) looks up the name of
    each address it connects to (``getnameinfo``, for its log lines), a reverse DNS query
    even for 127.0.0.1, which it reaches as an IPv4-mapped IPv6 address that /etc/hosts does
    not list; a resolver that drops the query is waited 5 s, twice ("The hostname of the
    client socket cannot be retrieved. err=-3"). Made where others wait on the process (a
    heartbeat as its group is set up, a pulse as an epoch forms, a vote), that stall named a
    live member lost. ``conn``: the connection, ``None`` until it is made or where it cannot
    be (a store that cannot clone); ``done``: set once it is made or not, after ``then(conn)``."""

    def __init__(self, store: Any, timeout_s: float, name: str, then: Callable[[Any], None] | None = None):
        self.conn: Any = None
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._kept: Any = None  # the store under conn, once closed (see close)
        self._thread = threading.Thread(target=self._make, args=(store, timeout_s, then), name=name, daemon=True)
        self._thread.start()

    def _make(self, store: Any, timeout_s: float, then: Callable[[Any], None] | None) -> None:
        try:
            conn = clone(store)
            conn.set_timeout(timedelta(seconds=timeout_s))
            with self._lock:
                if not self._closed:
                    self.conn = conn
            if self.conn is None:  # closed while it was being made
                self._release(conn)
        except Exception:  # noqa: BLE001 - an older torch, or a store that cannot clone
            pass
        try:
            if then is not None:
                then(self.conn)
        finally:
            self.done.set()

    def wait(self, timeout: float | None = None) -> Any:
        """The connection once it is made (``None``: it could not be, or not within ``timeout``)."""
        self.done.wait(timeout)
        return self.conn

    def close(self) -> None:
        """Let go of the connection, made or still being made: a store whose sockets are held in
        Python (:class:`~fastreduce.etcd_store.EtcdStore`) closes them now, not at the process's
        end (a heartbeat makes one per group: one per loss). torch's own stores close theirs with
        their last reference."""
        with self._lock:
            self._closed, conn = True, self.conn
        if conn is not None:
            self._release(conn)

    def _release(self, conn: Any) -> None:
        base = base_store(conn)
        if callable(getattr(base, "close", None)):
            base.close()
        self._kept = base  # a Python store lives while c10d's stores over it may still be asked


def base_store(store: Any) -> Any:
    """The store under ``store``'s ``PrefixStore`` layers (``store`` itself where it has none)."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store
