"""Who may enter a :class:`~fastreduce.Membership`'s job: each process takes a numbered
ticket at the coordinator with its layout (fastreduce version, ``tag``, the names, shapes
and dtypes of its state); a ticket whose layout differs from the members' is refused with
the difference in words, the others are admitted by the epoch that holds them (an epoch
records how many tickets it handled: ``Epoch.tickets``). A warm spare's ticket (``spare=True``)
is admitted only where a member is missing: the epochs with ``world_size`` members leave it
waiting (``Epoch.spares``), and the first epoch short of a member takes it, the one formed at
a loss too. A spare still waiting once every member of the job's newest epoch has closed
(:meth:`Admission.closed`: the job is over, nobody is left to take it in) is told so: its
``join()`` returns with :attr:`~fastreduce.Membership.left` set and no epoch entered (a
joiner's raises :class:`MembershipError`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from .coordinator import MEMBERS_PREFIX, TICKETS, CoordinatorLink, Epoch, MembershipError, epoch_key, ticket_key
from .member import Member
from .presence import Pulse
from .reruns import latest_epoch, start_clean
from .version import __version__

__all__ = ["Admission"]

log = logging.getLogger("fastreduce.membership")

_FOUNDERS = MEMBERS_PREFIX + "founders"  # the tickets that are not a spare's: the world_size-th forms epoch 0
_CLOSED = MEMBERS_PREFIX + "closed/e"  # + an epoch's number: how many of its members have closed


def _admit(t: int) -> str:
    return MEMBERS_PREFIX + f"admit/{t}"


def _starts_elsewhere(theirs: int, ours: int | None) -> str | None:
    if ours is None or theirs == ours:
        return None
    return (f"it starts the job at step {theirs} where the other first members start at step {ours}: "
            "resume every first member from the same checkpoint")


class Admission:
    """The tickets, as one member sees them; it owns the tickets it refused. ``pulse``: this
    member's, up from before its ticket is taken."""

    def __init__(self, me: Member, link: CoordinatorLink, pulse: Pulse):
        self.me, self.link, self.pulse = me, link, pulse
        self._refused: set[int] = set()
        self._tickets: dict[int, dict[str, Any]] = {}
        self._spares: set[int] = set()  # the spares' tickets found admissible, waiting while the job is whole
        self._print: dict[str, Any] | None = None

    def fingerprint(self) -> dict[str, Any]:
        """This member's layout, as a joiner's is compared with it: made once, at its first
        use after :meth:`~fastreduce.Membership.join` (names, shapes and dtypes do not change
        while it trains; an epoch change below ``min_ranks`` asks it every 50 ms)."""
        if self._print is None:
            self._print = self._layout()
        return self._print

    def _layout(self) -> dict[str, Any]:
        tensors = []
        for name, obj in sorted(self.me.state.items()):
            if isinstance(obj, torch.nn.Module):
                tensors += [[f"{name}.{k}", list(v.shape), str(v.dtype)] for k, v in obj.state_dict().items()]
            else:
                tensors.append([name, type(obj).__name__, ""])
        return {"version": __version__, "tag": self.me.settings.tag, "tensors": tensors}

    @staticmethod
    def differs(theirs: dict[str, Any], ours: dict[str, Any]) -> str | None:
        """Why a joiner (``theirs``) cannot join members like ``ours``, or ``None``."""
        if theirs["version"] != ours["version"]:
            return f"fastreduce {theirs['version']} joining members on fastreduce {ours['version']}: install the same"
        if theirs["tag"] != ours["tag"]:
            return f"tag {theirs['tag']!r} (mode and settings) joining members with tag {ours['tag']!r}"
        for a, b in zip(theirs["tensors"], ours["tensors"]):
            if a != b:
                return f"its state holds {' '.join(map(str, a))} where the members hold {' '.join(map(str, b))}"
        if len(theirs["tensors"]) != len(ours["tensors"]):
            return (f"its state holds {len(theirs['tensors'])} entries where the members hold "
                    f"{len(ours['tensors'])}: the same model and optimizer are needed")
        return None

    def admitted(self, start: int, resumed: bool) -> Epoch:
        """This process's ticket taken (:meth:`take_ticket`; the last of the first members to
        count itself lays out epoch 0, ``resumed``: each holding its own part of a checkpoint),
        and the epoch that admits it (:meth:`answer`)."""
        ticket, last_founder = self.take_ticket(start)
        if last_founder:
            members, spares, last, refusals = self.founding(start)
            self.propose(Epoch(0, members, start, last, () if resumed else members, spares), refusals)
        return self.answer(ticket)

    def take_ticket(self, start: int = 0, rejoining: bool = False) -> tuple[int, bool]:
        """This process's ticket, with its layout and the step it would start the job at
        (``start``: a first member's, resumed from a checkpoint); and whether it is the last of
        the first ``world_size`` members' (the one that lays out epoch 0; a spare's never is).
        An earlier run of the job whose keys the coordinator kept is cleared first, where every
        process of it is gone (:mod:`.reruns`; not for a member ``rejoining`` its own run), and
        this member's pulse is up before its ticket: admitted, it is watched before its group exists."""
        if not rejoining:
            start_clean(self.link)
        self.pulse.up()
        spare = self.me.settings.spare
        ticket = self.link.call(self.link.store.add, TICKETS, 1)
        self.pulse.said_again()  # (a clear of an earlier run between up() and the ticket took them)
        self.link.call(self.link.store.set, ticket_key(ticket),
                       json.dumps({"member": self.me.name, "print": self.fingerprint(), "start": start,
                                   "spare": spare}))
        last_founder = not spare and self.link.call(self.link.store.add, _FOUNDERS, 1) == self.me.settings.world_size
        return ticket, last_founder

    def founding(self, start: int) -> tuple[tuple[str, ...], tuple[int, ...], int, dict[int, str | None]]:
        """Epoch 0's members: the first ``world_size`` tickets that are not a spare's, in ticket
        order (which the last of them to count itself need not hold: the tickets and the count
        are two requests); the spares' tickets before them; the last ticket it handles; the refusals."""
        regular, t = 0, 0
        while regular < self.me.settings.world_size:
            t += 1
            regular += not self._ticket(t).get("spare")
        members, spares, refusals = self.candidates(1, t, answered=False, start=start)
        return members, tuple(k for k, _ in spares), t, refusals

    def tickets(self) -> int:
        """How many tickets were taken so far."""
        return int(self.link.call(self.link.store.add, TICKETS, 0))

    def _ticket(self, t: int) -> dict[str, Any]:
        """Ticket ``t``'s record (written once: read once; a spare's is looked at every poll)."""
        if t not in self._tickets:
            self._tickets[t] = json.loads(self.link.await_key(ticket_key(t), self.me.settings.wait_s,
                                                              f"joiner ticket {t}"))
        return self._tickets[t]

    def candidates(self, first: int, last: int, *, answered: bool = True, start: int | None = None,
                   spares: tuple[int, ...] = ()) -> tuple[tuple[str, ...], list[tuple[int, str]],
                                                         dict[int, str | None]]:
        """Tickets ``first`` .. ``last``, and the spares' tickets ``spares`` left waiting by the
        last epoch (those not answered yet, unless ``answered=False``: none can be): the
        members they would admit, in ticket order (the spares apart, as ``(ticket, member)``:
        admitted only where a member is missing), and per ticket why it is refused (``None``:
        it is not). ``start``: the first members' step (epoch 0's), which each of them must
        start at too."""
        mine = self.fingerprint()
        checked = [(t, self._ticket(t)) for t in (*spares, *range(first, last + 1))
                   if not answered or not self.link.call(self.link.store.check, [_admit(t)])]
        refusals = {t: self.differs(j["print"], mine) or  # (a spare joins later: its own start_step is not asked)
                    (None if j.get("spare") else _starts_elsewhere(j.get("start", 0), start)) for t, j in checked}
        ok = [(t, j) for t, j in checked if refusals[t] is None]
        return (tuple(j["member"] for t, j in ok if not j.get("spare")),
                sorted((t, j["member"]) for t, j in ok if j.get("spare")), refusals)

    def waiting(self) -> bool:
        """Whether a process waits to join with this layout (a spare: where a member is
        missing); one with another layout is refused here, so the members never leave their
        epoch for it."""
        epoch, waiting = self.me.current(), False
        short = epoch.world < self.me.settings.world_size
        for t in (*(epoch.spares if short else ()), *range(epoch.tickets + 1, self.tickets() + 1)):
            if t in self._refused or (not short and t in self._spares) or \
                    self.link.call(self.link.store.check, [_admit(t)]):
                continue  # (a spare checked once: no request at each poll while the job is whole)
            ticket = self._ticket(t)
            bad = self.differs(ticket["print"], self.fingerprint())
            if bad is None:
                if ticket.get("spare"):
                    self._spares.add(t)
                waiting = waiting or short or not ticket.get("spare")
            else:
                self._refused.add(t)
                self.link.call(self.link.store.set, _admit(t), f"refused: {bad}")
        return waiting

    def standing_by(self, store: Any, epoch: Epoch) -> tuple[str, ...]:
        """The processes waiting now to enter ``epoch``'s job with this member's layout, whom
        the next epoch would take (warm spares and joiners, those that registered after
        ``epoch`` formed too), read on ``store`` directly: for a request made on the
        coordinator's own thread (:class:`~fastreduce.status.Evictions`'s read). The layout
        is this member's as :meth:`fingerprint` made it (call it first, on the member's thread)."""
        mine, last = self.fingerprint(), int(store.add(TICKETS, 0))
        waiting = []
        for t in (*epoch.spares, *range(epoch.tickets + 1, last + 1)):
            if store.check([_admit(t)]) or not store.check([ticket_key(t)]):  # answered, or not written yet
                continue
            ticket = json.loads(store.get(ticket_key(t)))
            if self.differs(ticket["print"], mine) is None:
                waiting.append(ticket["member"])
        return tuple(waiting)

    def propose(self, proposal: Epoch, refusals: dict[int, str | None]) -> Epoch:
        """Write ``proposal`` unless another member's for that epoch was first; then admit
        the joiners of the epoch written and refuse the tickets it handled with another
        layout (the rest wait for a later epoch). Returns the epoch written."""
        key = epoch_key(proposal.number)
        epoch = Epoch.from_json(self.link.call(self.link.store.compare_set, key, "", proposal.to_json()))
        for t, bad in refusals.items():
            if t > epoch.tickets:
                continue
            joined = bad is None and self._ticket(t)["member"] in epoch.members  # (a resumed epoch 0 has no receivers)
            if joined or bad is not None:
                self.link.call(self.link.store.set, _admit(t), str(epoch.number) if joined else f"refused: {bad}")
        return epoch

    def answer(self, ticket: int, rejoining: bool = False) -> Epoch:
        """The epoch that admits ``ticket``, once one does (within ``wait_s``; a spare's, at
        the job's first loss, however long that takes), or :class:`MembershipError` where it
        was refused, or the job ended first (a spare's ``join()`` then returns, ``left`` set;
        a member ``rejoining`` after it was left out is out too: the job finished without it).
        The last member to close tells every process still waiting (:meth:`closed`); one whose
        ticket came after that close's count of the tickets looks itself, as its ticket is
        taken: that close counted itself first, so the look finds every member closed."""
        settings, key = self.me.settings, _admit(ticket)
        over = None if self.link.call(self.link.store.check, [key]) else self._over()
        while over is None and not self.link.wait(key, settings.wait_s):
            over = self._over()  # (a spare waits for a loss however long; it looks again every wait_s)
            if over is None and not settings.spare:
                raise MembershipError(self._not_admitted())
        if over is not None:  # (compare_set: an admission written meanwhile stands)
            self.link.call(self.link.store.compare_set, key, "", f"over {over.number}")
        answer = self.link.call(self.link.store.get, key).decode()
        if answer.startswith("refused"):
            raise MembershipError(f"fastreduce: this process was refused as a joiner: {answer[len('refused: '):]}")
        number = int(answer.split()[-1])
        epoch = Epoch.from_json(self.link.call(self.link.store.get, epoch_key(number)))
        if not answer.startswith("over"):
            return epoch
        if not (settings.spare or rejoining):
            raise MembershipError(f"fastreduce: the job ended before it admitted this process (every member of its "
                                  f"epoch {number} closed): nothing to join")
        why = "left out and back, it found the job over (its parameters are not the job's: the others' are)" \
            if rejoining else "a spare: the job ended without needing it"
        log.log(logging.WARNING if rejoining else logging.INFO, "fastreduce: member %s: %s (every member of epoch "
                "%d closed); left set", self.me.name, why, number)
        self.me.out(why)
        return epoch

    def closed(self) -> None:
        """This member closes (:meth:`fastreduce.Membership.close`): counted at its epoch,
        unless it left the job before (a spare that was never taken in, a member that left).
        The last of the epoch's members to close tells every process still waiting to join
        (spares, joiners) that the job is over, through its admission (where the coordinator
        answers: else nobody can be told, and the close goes on)."""
        epoch = self.me.epoch
        if epoch is None or self.me.left or self.link.silent:
            return
        try:
            if int(self.link.call(self.link.store.add, _CLOSED + str(epoch.number), 1)) >= epoch.world:
                for t in (*epoch.spares, *range(epoch.tickets + 1, self.tickets() + 1)):
                    self.link.call(self.link.store.compare_set, _admit(t), "", f"over {epoch.number}")
        except MembershipError:
            pass

    def _not_admitted(self) -> str:
        """Why no epoch admitted this process within ``wait_s``, in words: the job never formed
        (fewer than ``world_size`` first members came), or its members reached no step boundary."""
        settings = self.me.settings
        if not self.link.call(self.link.store.check, [epoch_key(0)]):
            came = int(self.link.call(self.link.store.add, _FOUNDERS, 0))
            return (f"fastreduce: the job did not form within wait_s={settings.wait_s:g} s: {came} of its "
                    f"world_size={settings.world_size} first members came, and it starts with all of them (start "
                    "the others, or give a lower world_size; one that raised at its start said why)")
        return (f"fastreduce: no admission within {settings.wait_s:g} s: the members did not reach a step boundary, "
                "or the job is not running (wait_s= waits longer; a job run again at an address that kept an "
                "earlier run: docs/faults.md)")

    def _over(self) -> Epoch | None:
        """The job's newest epoch where every one of its members has closed (the job is over:
        nobody is left to take a spare in), else ``None``."""
        epoch = latest_epoch(self.link)
        if epoch is None or int(self.link.call(self.link.store.add, _CLOSED + str(epoch.number), 0)) < epoch.world:
            return None
        return epoch
