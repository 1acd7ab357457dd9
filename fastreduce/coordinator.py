"""The coordinator of a :class:`~fastreduce.Membership`: a c10d ``TCPStore`` that no
member hosts, the epochs written in it, and every request a member makes to it, each
answered within a bound or :class:`MembershipError` (the job's one documented single point).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

import fastreduce.faults as faults
import fastreduce.faults_watchdog as faults_watchdog
import fastreduce.process_identity as process_identity
import fastreduce.reach as reach
import fastreduce.torch_internals as torch_internals
from fastreduce.etcd_store import ETCD_SCHEME, EtcdSpaceExceeded, EtcdStore, parse_address
from fastreduce.faults_errors import StoreUnreachable
from fastreduce.lifecycle import JOIN_S

__all__ = ["COORDINATOR_ENV", "TICKETS", "CoordinatorLink", "Epoch", "MembershipError", "connect", "default_poll_s",
           "group_prefix", "group_store", "serve", "ticket_key"]

COORDINATOR_ENV = "FASTREDUCE_COORDINATOR"
"""``host:port`` of the coordinator, where :class:`~fastreduce.Membership` is given none."""
MEMBERS_PREFIX = "fastreduce/members/"


def group_prefix(number: int) -> str:
    """The prefix of epoch ``number``'s process group's keys on the coordinator."""
    return MEMBERS_PREFIX + f"e{number}/pg/"


def group_store(number: int, store: Any) -> Any:
    """Epoch ``number``'s default group's store as its members see it, over ``store`` (a
    connection to the coordinator): for a reader outside the group, or a member's connection
    of its own."""
    return torch_internals.default_group_store(dist.PrefixStore(group_prefix(number), store))


def epoch_key(number: int) -> str:
    """The coordinator's key of epoch ``number`` (its :class:`Epoch` as JSON, once formed)."""
    return MEMBERS_PREFIX + f"epoch/{number}"


SILENT_STOP_S = 1.0
"""How long a member that closes waits for each of its threads where its coordinator stopped
answering (:meth:`CoordinatorLink.stop_s`): one inside a request to it never ends (c10d's own
timeout does not end a request on a silent link), the others end in milliseconds."""

TICKETS = MEMBERS_PREFIX + "tickets"
"""The coordinator's count of the tickets taken (the last one's number)."""


def ticket_key(t: int) -> str:
    """The coordinator's key of ticket ``t``'s record (its member, layout, start step, whether a spare)."""
    return MEMBERS_PREFIX + f"ticket/{t}"


class MembershipError(RuntimeError):
    """This process cannot be (or stay) a member: refused as a joiner, the job over before
    it was admitted, shards lost, or the coordinator is unreachable. The message says which
    and what to do."""


@dataclass(frozen=True)
class Epoch:
    """One membership: ``members`` in rank order, from committed step ``step`` on."""

    number: int
    members: tuple[str, ...]
    step: int
    tickets: int  # the tickets it handled: every ticket up to this one was admitted or refused, or is a spare's
    receivers: tuple[str, ...] = ()  # the members that receive the job's state as they enter it
    spares: tuple[int, ...] = ()  # the warm spares' tickets it handled and left waiting (the world was full)

    @property
    def world(self) -> int:
        return len(self.members)

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "members": list(self.members), "step": self.step,
                           "tickets": self.tickets, "receivers": list(self.receivers), "spares": list(self.spares)})

    @classmethod
    def from_json(cls, text: str | bytes) -> Epoch:
        d = json.loads(text)
        return cls(d["number"], tuple(d["members"]), d["step"], d["tickets"], tuple(d["receivers"]),
                   tuple(d.get("spares", ())))


def connect(coordinator: str, timeout_s: float = 30.0, *, connect_timeout_s: float | None = None) -> dist.Store:
    """A client connection to the coordinator at ``host:port``, each request bounded by
    ``timeout_s``. The coordinator is waited for up to ``connect_timeout_s`` (default
    ``$FASTREDUCE_CONNECT_TIMEOUT_S``, else 5 s; one started a moment after its members is
    found), then :class:`MembershipError` naming it, with nothing of c10d's on stderr.
    ``etcd://host:port[,host:port...][/job]``: an etcd cluster
    (:class:`~fastreduce.etcd_store.EtcdStore`; no single point of failure)."""
    if coordinator.startswith(ETCD_SCHEME):
        endpoints, job = parse_address(coordinator)
        store = EtcdStore(endpoints, job, timedelta(seconds=timeout_s))
        try:
            store.check(["fastreduce-connect"])  # one request: an answer from a quorum, or StoreUnreachable
        except StoreUnreachable as err:
            raise MembershipError(f"fastreduce: cannot reach the etcd cluster of {coordinator} ({err})") from err
        return store
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator must be 'host:port', got {coordinator!r}")
    waited = reach.connect_timeout(connect_timeout_s)
    why = reach.wait_for_listener(host.strip("[]"), int(port), waited)
    if why is not None:
        raise MembershipError(_not_reached(coordinator, port, f"{why}; tried for {waited:g} s"))
    # c10d's client, made on a thread of its own and waited for timeout_s: its handshake with
    # a listener that never answers (an etcd endpoint given without etcd://, another service)
    # blocks in C++ for good, past its own timeout. Where it does, the thread is left behind
    # (nothing can end a C++ call) and ends once c10d gives up or the listener closes; the
    # caller is closed now, so no shutdown() waits on it, and it holds only the address and
    # the store it may still make, dropped as its job ends (nothing the process needs).
    caller = faults.StoreCaller("fastreduce-connect")
    try:
        return caller.call(functools.partial(dist.TCPStore, host.strip("[]"), int(port), is_master=False,
                                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False),
                           seconds=timeout_s)
    except faults.TransportError:
        raise MembershipError(_not_a_coordinator(coordinator, port, f"no answer to a coordinator's handshake within "
                                                                    f"{timeout_s:g} s")) from None
    except Exception as err:  # noqa: BLE001 - torch raises several kinds
        raise MembershipError(_not_a_coordinator(coordinator, port, str(err).splitlines()[0])) from err
    finally:
        caller.close()


def default_poll_s(coordinator: str | dist.Store | None) -> float:
    """How often the members vote by default: every 0.2 s; every second on etcd, where each
    request is a quorum's write or read (a vote costs tens of milliseconds there)."""
    etcd = isinstance(coordinator, EtcdStore) or str(coordinator).startswith(ETCD_SCHEME)
    return 1.0 if etcd else 0.2


def _not_reached(coordinator: str, port: str, why: str) -> str:
    return (f"fastreduce: cannot reach the coordinator at {coordinator} ({why}); start it first: "
            f"`fastreduce coordinator --port {port}` on that host, and pass its address (a slow network: "
            f"${reach.CONNECT_TIMEOUT_ENV}=SECONDS waits longer)")


def _not_a_coordinator(coordinator: str, port: str, why: str) -> str:
    return (f"fastreduce: something listens at {coordinator} but is not a fastreduce coordinator ({why}): an etcd "
            f"endpoint? give it as etcd://{coordinator}[/job]; else the coordinator's port is another "
            f"(`fastreduce coordinator --port {port}` serves one there)")


def serve(port: int = 0, host: str = "0.0.0.0") -> dist.TCPStore:
    """The coordinator: a ``TCPStore`` server (``port`` 0: any free one, ``.port``)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))



class CoordinatorLink:
    """A member's connection to the coordinator (``coordinator``: ``"host:port"`` or a
    store): every request answered within a bound or :class:`MembershipError`, the
    requests made on a thread of their own (:class:`~fastreduce.faults.StoreCaller`), and a
    second connection for a vote's waiting get, with ``timeout_s`` (the epoch's)."""

    def __init__(self, coordinator: str | dist.Store, timeout_s: float):
        self.where = coordinator if isinstance(coordinator, str) else "the coordinator store"
        self.store = connect(coordinator) if isinstance(coordinator, str) else coordinator
        self.timeout_s = timeout_s
        self._caller = faults.StoreCaller("fastreduce-coordinator")  # every request bounded (a partition)
        self._waiter: Any = None
        self._here: bool | None = None  # whether the coordinator is served on this host
        self.silent = False  # a request found it not answering (unreachable): nothing waits on it again
        # the vote's connection made now, apart: one made inside a vote can take 10 s (reach.SecondConnection)
        self._second = reach.SecondConnection(self.store, timeout_s, "fastreduce-vote-connect")
        # and the epochs' heartbeats' (:meth:`beats_store`): an epoch change opens no connection
        self._beats = reach.SecondConnection(self.store, self.deadline(), "fastreduce-beats-connect")

    def deadline(self) -> float:
        """How long a request may take: twice the loss window, at least 5 s, and
        ``faults.LOCAL_GRACE`` times that where the coordinator is served at an address of
        this host's network namespace (no link between to cut: a slow answer is a starved
        server; 9 of 64 members joining at once on 2 cores waited past 5 s)."""
        if self._here is None:
            self._here = process_identity.served_here(self.store)
        return max(5.0, 2 * faults.lost_after()) * (faults.LOCAL_GRACE if self._here else 1)

    def stop_s(self) -> float:
        """How long the member's threads are each waited for as it closes: the usual
        :data:`~fastreduce.lifecycle.JOIN_S`, or :data:`SILENT_STOP_S` where a request found the
        coordinator silent (a thread still inside one is left to end with the process)."""
        return SILENT_STOP_S if self.silent else JOIN_S

    def call(self, fn: Callable[..., Any], *args: Any, seconds: float | None = None) -> Any:
        """A request to the coordinator, answered within ``seconds`` (default:
        :meth:`deadline`) or :class:`MembershipError` (a TCPStore request on a silent
        link would block for minutes)."""
        try:
            return self._caller.call(fn, *args, seconds=seconds or self.deadline())
        except Exception as err:  # noqa: BLE001 - the store raises several kinds
            raise self.unreachable(err) from err

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A request not waited for here: (an event set once answered, a box for the answer)."""
        return self._caller.submit(fn, *args)

    def wait(self, key: str, seconds: float) -> bool:
        """Whether ``key`` is set within ``seconds`` (``False``: not yet)."""
        try:
            self._caller.call(self.store.wait, [key], timedelta(seconds=seconds),
                              seconds=seconds + self.deadline())
            return True
        except Exception as err:  # noqa: BLE001 - the store's timeout (not yet), or it is gone
            if isinstance(err, (faults.TransportError, StoreUnreachable)) or "timeout" not in str(err).lower():
                raise self.unreachable(err) from err
            return False

    def vote_connection(self) -> Any:
        """A connection of its own for the vote's waiting get (the other requests go on
        the first while it waits), with the epoch's timeout."""
        if self._waiter is None:
            self._waiter = self._second.wait()  # (made at construction, on a thread of its own)
            if self._waiter is None:  # a store that can make no connection of its own (reach.clone): the member's
                self._waiter = self.store
                self._waiter.set_timeout(timedelta(seconds=self.timeout_s))
        return self._waiter

    def beats_store(self, number: int) -> Any:
        """Epoch ``number``'s default group's store on a connection this member made once, for
        the epoch's heartbeat (``None`` until it is made: the heartbeat then makes its own).
        The built-in coordinator's server (torch's ``TCPStore``) looks up the host name of each
        client that connects, on the one thread that answers every member: a resolver slow to
        answer stalls the whole job that long (a dropped query: 5 s). A heartbeat connection
        per epoch did that at every epoch change."""
        conn = self._beats.wait(0)
        return None if conn is None else group_store(number, conn)

    def await_key(self, key: str, timeout_s: float, what: str) -> str:
        if not self.wait(key, timeout_s):
            raise MembershipError(f"fastreduce: no {what} within {timeout_s:g} s: the members did not reach "
                                  "a step boundary, or the job is not running (wait_s= waits longer)")
        return self.call(self.store.get, key).decode()

    def unreachable(self, err: BaseException) -> MembershipError:
        faults_watchdog.abandon_groups()  # this member ends here: never join a thread stuck on a silent peer at exit
        self.silent = not isinstance(err, EtcdSpaceExceeded)
        if isinstance(err, EtcdSpaceExceeded):
            return MembershipError(f"fastreduce: the coordinator's etcd cluster ({self.where}) is out of space "
                                   f"({err}); this member cannot go on. Restart the job from the last checkpoint once "
                                   "etcd takes writes again")
        if self.where.startswith(ETCD_SCHEME) or isinstance(err, StoreUnreachable):
            return MembershipError(f"fastreduce: the coordinator's etcd cluster ({self.where}) stopped answering "
                                   f"({type(err).__name__}: {err}): it lost its quorum (a majority of its members) or "
                                   "this member its link to it; this member cannot go on. Bring a majority of etcd's "
                                   "members back, then restart the job from the last checkpoint")
        return MembershipError(f"fastreduce: the coordinator ({self.where}) stopped answering ({type(err).__name__}: "
                               f"{err}): it is the job's single point; this member cannot go on. Restart the "
                               "coordinator and the job from the last checkpoint, or run it on etcd "
                               "(coordinator='etcd://...': no single point)")
