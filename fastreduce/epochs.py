"""How the members of a :class:`~fastreduce.Membership` go from one epoch to the next: the
survivors (and joiners) agree on it through the coordinator, each enters it (a new default
process group on a fresh store prefix, the joiners healed from rank 0, the mode built again
with each member's own state, ZeRO's shards joined and resharded), and what each mode keeps
across it (by how its steps commit: :func:`.modes.contract.commit_style`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

import fastreduce.faults as faults
import fastreduce.faults_heartbeat as faults_heartbeat
import fastreduce.faults_watchdog as faults_watchdog
import fastreduce.torch_internals as torch_internals

from .admission import Admission
from .coordinator import MEMBERS_PREFIX, CoordinatorLink, Epoch, MembershipError, epoch_key, group_prefix
from .exit_quiet import quiet_backends
from .faults import RankLostError
from .gathering import Gathering, moved, poll_s
from .heal import sync_state
from .kept import kept_state, settled_step
from .modes import zero_mirror
from .modes.contract import check_membership, commit_style
from .member import Member
from .presence import Pulse, Watch, all_exited, pulses
from .votes import Votes, done_key

__all__ = ["EpochChanges", "LeftOut"]

log = logging.getLogger("fastreduce.membership")

class EpochChanges:
    """How one member goes from epoch to epoch (see the module doc). It changes ``me`` (the
    :class:`~fastreduce.member.Member`), asks ``admission`` who may join and ``votes`` what a
    failure lost, and owns ``pulse`` (this member's sign of life while it has no epoch
    heartbeat) and which epoch's first step every member has reached."""

    def __init__(self, me: Member, link: CoordinatorLink, admission: Admission, votes: Votes, pulse: Pulse):
        self.me, self.link, self.admission, self.votes, self.pulse = me, link, admission, votes, pulse
        self.settings, self.store, self.call = me.settings, link.store, link.call
        self._first_step_of: int | None = None  # the epoch whose members all reached its first step
        self._held: Any = None  # a closed ZeroOptimizer holding a step its all_arrived() ended (commits.py)
        self._built_in: int | None = None  # the epoch whose layout the mode was built in (ZeRO's shards' tag)
        self.gathering = Gathering(me, link)

    def next_epoch(self, lost: set[str], why: str, start: float) -> None:
        """With the other survivors: the next epoch, without ``lost`` and with the
        joiners waiting; then its group, the state for the joiners and the mode
        (``start``: when the step that ends the epoch began, for :attr:`counters`).
        ``why``: ``"loss"``, ``"join"``, ``"leave"``, or ``"end"`` (its last step done, another
        member's failed: :mod:`.ending`; as after a loss, the others waited for one window)."""
        old = self.me.current()
        n = old.number + 1
        self.pulse.up()  # alive to the others until this member has entered the next epoch
        self.me.put_away = self.me.mode  # (Membership.mode if this member is out at this change)
        self.stash_mode(after_loss=why == "loss")
        beats = torch_internals.default_store()  # the old epoch's: its members' heartbeats stay readable
        peers = [m for m in old.members if m != self.me.name]
        self.gathering.announce(old, held=self._held is not None)  # (before it leaves: one told below finds it)
        if why == "loss" and not lost:
            self.gathering.name_self_lost()
        self.leave_group(abandon=why == "loss", gone=all_exited(self.store, self.call, peers) if why == "loss" else None)
        said = self.gathering.gather(old, lost, why, beats, announced=True)
        present, key = list(said), epoch_key(n)
        # The members holding the job's state at its latest step come first (rank 0 sends
        # it); the survivors one step behind (their reduction failed where these completed
        # it) and a joiner whose healing failed (its source lost) receive it. Only members
        # that held the state propose (a joiner's step count is not the job's yet).
        healed = [m for m in present if said[m]["healed"]]
        # Nobody holds a committed state: epoch 0 failed as it formed (a first member lost in
        # its set-up), so the job is still at its start, which every first member holds: they
        # found it again, each taking the first one's state as at epoch 0.
        founding = not healed
        if founding:
            healed = [m for m in present if said[m].get("founder")]
        holds = self.me.name in healed
        top = max((said[m]["step"] for m in healed), default=self.me.step)
        self._step_held(top)
        behind = tuple(m for m in healed if settled_step(said[m], top) != top)
        healed = [m for m in healed if m not in behind]
        holders = set(healed) | set(behind)
        unhealed = behind + tuple(m for m in present if m not in holders)
        deadline = time.monotonic() + self.settings.wait_s
        while not holds:
            if self.link.wait(key, 0.25):
                break
            if time.monotonic() > deadline:
                raise MembershipError(f"fastreduce: no member holding the job's state formed epoch {n} within "
                                      f"{self.settings.wait_s:g} s (the members were lost while this process joined)")
        # A local-update mode's sync failed: the survivors run it again over this epoch, and a
        # joiner taking rank 0's parameters now (its own inner steps since the last sync) would
        # count them twice in it; it is admitted right after the sync instead, at its vote.
        redo = why == "loss" and self.me.kept_mode[1] == "local" and len(present) >= self.settings.min_ranks
        while holds:  # below min_ranks: wait for joiners (unless another survivor proposed already)
            tickets = old.tickets if redo else self.admission.tickets()
            joiners, spares, refusals = self.admission.candidates(  # (not refused already)
                old.tickets + 1, tickets, spares=() if redo else old.spares)
            # the warm spares where a member is missing; the rest wait on (a redone sync: all of them)
            room = max(0, self.settings.world_size - len(healed) - len(unhealed) - len(joiners))
            joiners += tuple(m for _, m in spares[:room])
            members = tuple(healed) + unhealed + joiners
            proposal = Epoch(n, members, top, tickets, members if founding else unhealed + joiners,
                             old.spares if redo else tuple(t for t, _ in spares[room:]))
            if proposal.world >= self.settings.min_ranks or self.call(self.store.check, [key]):
                break
            if time.monotonic() > deadline:
                self._below_min_ranks(old, present, lost if why == "leave" else set())
            time.sleep(0.05)
        epoch = self.admission.propose(proposal, refusals) if holds else \
            Epoch.from_json(self.call(self.store.get, key))
        if self.me.name not in epoch.members:
            self._rejoin(epoch)
        self.me.put_away = None  # (not kept while the next one is built)
        if self.me.healed and self.me.name not in epoch.receivers and epoch.step != self.me.step:
            raise MembershipError(f"fastreduce: epoch {epoch.number} begins at step {epoch.step} but this member "
                                  f"committed {self.me.step}: the members disagree on the committed steps (a bug: "
                                  "please report it)")
        self.me.counters.joins += sum(m not in old.members for m in epoch.receivers)  # not a survivor healed forward
        self.enter(epoch)
        self.me.counters.stalls.append((why, time.perf_counter() - start))

    def _rejoin(self, epoch: Epoch) -> None:
        """This member was left out of ``epoch``: the others found it silent (a process
        frozen, a host cut off from them past the loss window) and formed it without it.
        Alive and back, it joins the job again as a new process does (a ticket, admitted at
        the members' next poll, their state sent it: its own is stale); one that asked to
        leave (:meth:`~fastreduce.Membership.leave`) or was asked to (the straggler policy,
        ``evict_slower_than``) is out instead, :attr:`~fastreduce.Membership.left` set, as is
        one that finds the job over (every member closed while it was away). Either way it
        raises :class:`LeftOut`."""
        if self.votes.asked_to_leave():
            log.warning("fastreduce: member %s was left out of epoch %d; it is out: %s", self.me.name,
                        epoch.number, self._leave_why())
            self.votes.forget_leave_request()  # (no poll will serve it: this member is in no epoch)
            self.pulse.down()
            self.me.out(self._leave_why())
            raise LeftOut(self.me.name)
        log.warning("fastreduce: member %s was left out of epoch %d (the others found it silent: frozen, or cut off "
                    "from them); it joins the job again, taking the members' state", self.me.name, epoch.number)
        self.me.healed, self.me.kept_mode, self._held = False, (None, ""), None
        self.me.counters.rejoins += 1
        ticket, _ = self.admission.take_ticket(rejoining=True)
        epoch = self.admission.answer(ticket, rejoining=True)
        if not self.me.left:  # (left: the job ended while it was away; m.mode the one put away)
            self.me.put_away = None
            self.enter(epoch)
        raise LeftOut(self.me.name)

    def first_entry(self, epoch: Epoch) -> Epoch:
        """This process enters the job at ``epoch`` (:meth:`fastreduce.Membership.join`), the
        seconds it took counted (``"joined"``); returns the epoch it is in (a later one where
        it was left out of ``epoch`` as it entered and joined again)."""
        start = time.perf_counter()
        with self.me.telling(), contextlib.suppress(LeftOut):
            self.enter(epoch)
        self.me.counters.stalls.append(("joined", time.perf_counter() - start))
        return self.me.current()

    def _below_min_ranks(self, old: Epoch, present: list[str], left: set[str]) -> None:
        """No process joined within ``wait_s`` to bring the members ``present`` of the epoch
        after ``old`` up to ``min_ranks``: :class:`RankLostError` naming the members lost, or,
        where none was (only ``left``, the members that left at a poll), :class:`MembershipError`."""
        below = (f"{len(present)} member(s) are left, below min_ranks={self.settings.min_ranks}, and no process joined "
                 f"within {self.settings.wait_s:g} s")
        lost = set(old.members) - set(present) - left
        if lost:
            raise RankLostError(sorted(old.members.index(m) for m in lost), "Membership", below, "members were lost",
                                old.world)
        raise MembershipError(f"fastreduce: {', '.join(sorted(left))} left the job (leave(), or asked to by the "
                              f"straggler policy, evict_slower_than): {below}; start a joiner or a warm spare "
                              "(spare=True) within wait_s, or run with a lower min_ranks")

    def enter(self, epoch: Epoch) -> None:
        """This epoch's process group; the state from rank 0 where it has joiners; the mode.
        A member lost meanwhile (the joiners' source, say): the next epoch, without it."""
        self.me.passing("enter", epoch)
        self.me.epoch = epoch
        if not self.me.healed:  # this process enters the job: a leave request under its name is an earlier one's
            self.votes.forget_leave_request()
        try:
            self._set_up(epoch)
        except (RuntimeError, _Missing) as err:
            lost = err.members if isinstance(err, _Missing) else self.votes.lost_in(err) if dist.is_initialized() else \
                self._unmade(epoch, err)
            if lost is None:
                raise
            if self.me.mode is not None:  # built in this entry, its state half loaded (ZeRO: half resharded):
                self.close_mode(drain=False)  # dropped, so that the next epoch starts from the kept state
            lost = self._publish_lost(epoch, lost)  # the members that entered it stop waiting at its first step
            self.me.counters.lose(lost)
            log.warning("fastreduce: entering epoch %d failed (lost: %s); forming the next one", epoch.number,
                        ", ".join(sorted(lost)) or "a silent member")
            self.next_epoch(lost, "loss", time.perf_counter())
            return
        self.me.healed = True
        self.me.kept_mode = (None, "")
        self.votes.restart(epoch.step)

    def _set_up(self, epoch: Epoch) -> None:
        self.me.passing("set_up", epoch)
        own, kind = self.me.kept_mode
        self._rendezvous(epoch)
        self._init_group(epoch)
        faults.start_heartbeat(connection=self.link.beats_store(epoch.number))  # this epoch's: the vote watches it
        joining = self.me.name in epoch.receivers
        fresh = joining and not self.me.healed  # a new process (a survivor one step behind keeps its mode's state)
        if epoch.receivers:  # a per-rank mode's state too (a fused mode's is rank 0's own residuals: not sent)
            got, sent_kind = sync_state(self.me, epoch, own if kind in ("local", "gossip") else None, kind)
            if fresh:  # rank 0's mode state came only if its mode keeps one per rank
                own, kind = got, sent_kind
        lost = self._meet(epoch, "built")  # (the mode's construction runs collectives: every member alive and here)
        if lost is not None:
            raise _Missing(lost)
        per_rank = kind in ("local", "gossip")
        pieces = None
        if kind == "zero":  # this member's pieces of the shards (a joiner's: none), resharded once built
            pieces, own = None if fresh else own, None
        self.me.passing("build", epoch)
        if self.me.build is not None:
            with _quiet() if own is not None and per_rank else contextlib.nullcontext():
                self.me.mode = self.me.build()  # (it starts every rank from rank 0's: each loads its own next)
            self._built_in = epoch.number
            check_membership(self.me.mode)
            if own is not None and (per_rank or not fresh):
                self.me.mode.load_state_dict(own)  # a member's own state goes on; a joiner's: rank 0's
            if kind == "zero":  # every shard's state (parameters too, where stale) resharded onto this epoch
                self.me.passing("reshard", epoch)
                try:
                    zero_mirror.reshard(self.me.mode, pieces)
                except zero_mirror.ShardsLost as err:
                    raise MembershipError(f"fastreduce: {err}, so the job cannot go on: restart it from the last "
                                          "checkpoint (ZeroOptimizer(redundant=k) keeps k copies of each shard)") \
                        from err
            self._hold_launches(True)
            if commit_style(self.me.mode) == "local":  # a sync in flight across steps: each member's
                self.me.mode.keep_sent()  # payload kept, to be sent again over the survivors after a loss
            if commit_style(self.me.mode) == "gossip":  # the members' rounds may differ by one after a loss
                self.me.mode.set_round(epoch.step)

    def _unmade(self, epoch: Epoch, err: RuntimeError) -> set[str]:
        """The group of ``epoch`` could not be made (``err``: Gloo's connect failed): the members
        whose pulse stopped within two loss windows (lost as it formed), found here or published
        by their watchers (past :data:`~.faults_heartbeat.WATCHED_SUCCESSORS` + 1 members this one
        watches only its successors); where every one still lives, they reach the coordinator
        but not each other: :class:`MembershipError`."""
        watch, until, polls = self._watch(epoch), time.monotonic() + 2 * faults.lost_after(), 0
        while time.monotonic() < until:
            lost = watch.lost() or self._published_lost(epoch)
            if lost:
                return lost
            time.sleep(poll_s(epoch.world, polls))
            polls += 1
        raise MembershipError(f"fastreduce: epoch {epoch.number}'s process group could not be made ({err}), and every "
                              "member still lives at the coordinator: they reach it but not each other (the members' "
                              "network split with the coordinator on both sides, or a firewall on the ports of their "
                              "group: GLOO_SOCKET_IFNAME names its interface). Restart the job from its last "
                              "checkpoint on members that reach each other") from err

    def _entry_bound(self) -> float:
        """How long the members of a new epoch wait for each other to enter it: they all read
        it within milliseconds of each other, so a few loss windows."""
        return max(5.0, 4 * faults.lost_after())

    def _init_group(self, epoch: Epoch) -> None:
        """The epoch's default group (its own store prefix). Its timeout stays ``timeout_s``
        from the start: Gloo's point-to-point waits keep the timeout the group was made with
        (``ProcessGroup.set_timeout`` reaches only its collectives), so a group made with a
        short one and raised after failed the state's transfer to a joiner on a loaded host."""
        store = dist.PrefixStore(group_prefix(epoch.number), self.store)
        dist.init_process_group(self.settings.backend, store=store, rank=epoch.members.index(self.me.name),
                                world_size=epoch.world, timeout=timedelta(seconds=self.settings.timeout_s))

    def _watch(self, epoch: Epoch) -> Watch:
        """A view of the pulses of the members of ``epoch`` this member watches: every other
        member, or in a world past ``faults_heartbeat.WATCHED_SUCCESSORS`` + 1 its next successors in
        rank order (a loss found by its own watchers is published: :meth:`_publish_lost`)."""
        me, k = epoch.members.index(self.me.name), faults_heartbeat.WATCHED_SUCCESSORS
        if epoch.world <= k + 1:
            members = [m for m in epoch.members if m != self.me.name]
        else:
            members = [epoch.members[(me + i) % epoch.world] for i in range(1, k + 1)]
        return Watch(self.store, self.call, members)

    def _publish_lost(self, epoch: Epoch, lost: set[str]) -> set[str]:
        """Tell the members of ``epoch`` still entering it (or waiting at its first step)
        whom this member found lost, and abort its first step. Not through the epoch's
        heartbeat: a member still in its first backward would raise there, out of the
        mode's hooks and the commit (ZeRO's buckets launch in backward); it learns of the
        loss at its own first step. Returns the members lost as the first to publish found
        them, which every member goes on with: a member whose entry failed only because
        another had given it up first (their exchanges cut as that one left the group, in a
        ZeRO reshard) finds that one silent on the epoch's heartbeat, alive, and would leave
        it out of the next epoch (6 members, one lost as the others resharded: two live ones
        left out, and their shards with them)."""
        key = MEMBERS_PREFIX + f"e{epoch.number}/lost"
        if lost:
            lost = set(json.loads(self.call(self.store.compare_set, key, "", json.dumps(sorted(lost)))))
        else:
            lost = self._published_lost(epoch) or lost
        self.call(self.store.compare_set, done_key(epoch.number, epoch.step), "", "abort")
        return lost

    def _published_lost(self, epoch: Epoch) -> set[str] | None:
        """The members another member of ``epoch`` found lost as it was entered, if one did."""
        key = MEMBERS_PREFIX + f"e{epoch.number}/lost"
        if not self.call(self.store.check, [key]):
            return None
        return set(json.loads(self.call(self.store.get, key)))

    def _meet(self, epoch: Epoch, point: str) -> set[str] | None:
        """Wait until every member of ``epoch`` has come to ``point`` too, watching their
        pulses: the members lost meanwhile (published for the others), or ``None`` once all
        are there.

        Why: the collectives a mode runs as it is built and at its first use of a group (the
        layout check of every mode, the shared-memory transport's set-up, ZeRO's resharding;
        the fused reducers' at their first ``reduce()``) are plain ones, which Gloo cannot
        interrupt and fails only on the members exchanging with the lost one directly: a
        member waiting in one on a live peer that gave up (in a ring all-gather, the
        neighbour whose receive from a dead joiner failed) would wait for the group's
        timeout, its heartbeat beating, and be left out of the next epoch. So the members
        meet before each: once all are here, they run them within milliseconds of each
        other."""
        if epoch.world == 1:
            return None
        key, aborted = MEMBERS_PREFIX + f"e{epoch.number}/{point}", done_key(epoch.number, epoch.step)
        here = int(self.call(self.store.add, key, 1))
        watch, polls = self._watch(epoch), 0
        while True:
            # Another member found a loss first; also where every member came: this one, stopped
            # whole meanwhile, after the others had given it up and left (not into the epoch alone).
            if self.call(self.store.check, [aborted]):
                return self._published_lost(epoch) or watch.exited()
            if here >= epoch.world:
                return None
            lost = watch.lost()
            if lost:
                return self._publish_lost(epoch, lost)
            time.sleep(poll_s(epoch.world, polls))
            polls += 1
            here = int(self.call(self.store.add, key, 0))

    def reach_first_step(self) -> set[str] | None:
        """Before the mode's first collective in this epoch (:meth:`_meet`): the members lost
        before every member came to its first step (a joiner that died in its first forward
        or backward), or ``None``; from then on the epoch's heartbeat watches them
        (:func:`fastreduce.faults.wait_watched`), and this member's pulse stops."""
        epoch = self.me.current()
        if self._first_step_of == epoch.number:
            return None
        self._first_step_of = epoch.number
        lost = self._meet(epoch, "first")
        if lost is None:
            self.pulse.down()
            self._hold_launches(False)
        return lost

    def _hold_launches(self, hold: bool) -> None:
        """ZeRO launches its buckets' reduce-scatters from backward hooks, before the commit:
        in an epoch's first step they wait for :meth:`step` (``hold``), so that the members
        meet first (:meth:`_reach_first_step`). A launch to a member already dead fails at
        once, inside the user's backward, out of the commit's reach (a joiner that died
        after its own first backward, the others still in theirs)."""
        if commit_style(self.me.mode) == "zero":
            self.me.mode.hold_launches(hold)

    def _rendezvous(self, epoch: Epoch) -> None:
        """Wait until every member of ``epoch`` is entering it, watching their pulses: a
        member that died meanwhile (a joiner as it was admitted) is named here within the
        loss window (:class:`_Missing`), not after the process group's own rendezvous waited
        its whole timeout for it. One that is alive but has not come within
        :meth:`_entry_bound` (they all read the epoch within milliseconds of each other on
        an idle host) is waited for while its pulse moves, up to ``wait_s``.

        The members agree on the outcome: the first to decide writes it (every member here,
        or whom it found lost) and all follow that word. A member that gave up alone would
        leave the others waiting in the group's rendezvous for it, up to the group's timeout."""
        key, word = MEMBERS_PREFIX + f"e{epoch.number}/ready", MEMBERS_PREFIX + f"e{epoch.number}/entry"
        self.call(self.store.set, f"{key}/{self.me.name}", "1")
        self.call(self.store.add, key, 1)
        bound, start = self._entry_bound(), time.monotonic()
        deadline, last = start + bound, start + self.settings.wait_s
        watch, counted, lost = self._watch(epoch), {}, set()
        while not lost and int(self.call(self.store.add, key, 0)) < epoch.world:
            lost = watch.lost() or self._published_lost(epoch) or set()
            if not lost and time.monotonic() > deadline:
                lost = {m for m in epoch.members if not self.call(self.store.check, [f"{key}/{m}"])}
                if lost and time.monotonic() < last and \
                        moved(pulses(self.store, self.call, sorted(lost)), counted):
                    log.warning("fastreduce: %s not in epoch %d after %.1f s, alive (its pulse moves): waiting for "
                                "it, up to wait_s", ", ".join(sorted(lost)), epoch.number, time.monotonic() - start)
                    lost, deadline = set(), time.monotonic() + bound  # alive, slow to come: a loaded host
                elif not lost:
                    break  # every member came meanwhile
            if not lost:
                time.sleep(poll_s(epoch.world))
        said = self.call(self.store.compare_set, word, "", json.dumps(sorted(lost)) if lost else "go")
        if said not in (b"go", "go"):  # (bytes from a TCPStore)
            raise _Missing(set(json.loads(said)))

    def stash_mode(self, after_loss: bool) -> None:
        """Keep the mode's state until the next epoch is entered (a failed entry must not
        lose it), then take the mode off: after a loss without a collective (gossip's
        exchanges in flight are dropped), else as it saves it (they are completed)."""
        if self.me.mode is None:
            return
        self._keep(self.me.mode, after_loss)
        self._held = self.me.mode if after_loss and commit_style(self.me.mode) == "zero" and \
            self.me.mode.holds_step else None
        self.close_mode(drain=not after_loss)

    def _keep(self, mode: Any, after_loss: bool) -> None:
        """Keep ``mode``'s state (:func:`~.kept.kept_state`); ZeRO's shards tagged with the
        epoch they were laid out in: where a member is lost as the others take their shards,
        some may have taken theirs (the new layout) and others not (the old), and the next
        epoch's :func:`~.modes.zero_mirror.reshard` takes each range from one layout."""
        self.me.kept_mode = kept_state(mode, after_loss)
        if self.me.kept_mode[1] == "zero":
            self.me.kept_mode[0]["layout"] = self._built_in

    def _step_held(self, top: int) -> None:
        """ZeRO: this member's step whose ``all_arrived()`` failed here but completed on
        another survivor (one that stands at ``top``, a step more: every member had arrived,
        so every shard's averaged gradients were complete) is stepped now, from the
        gradients it holds, and kept; otherwise it is dropped with the others' (discarded)."""
        held, self._held = self._held, None
        if held is None or top != self.me.step + 1:
            return
        held.step_held()
        self._keep(held, after_loss=True)
        self.me.step += 1
        log.info("fastreduce: member %s stepped its shards at step %d, which another survivor committed",
                 self.me.name, self.me.step - 1)

    def depart(self) -> None:
        """This member leaves the job at a poll: its mode put away as the others' are at an
        epoch change (gossip completes its exchanges with them), its group ended."""
        self.me.put_away = self.me.mode
        self.stash_mode(after_loss=False)
        self.leave_group(abandon=False)
        self.pulse.down()
        self.me.kept_mode = (None, "")
        self.me.out(self._leave_why())

    def _leave_why(self) -> str:
        """Why this member, asked to leave, is out (:meth:`~.member.Member.out`)."""
        return "it called leave()" if self.me.leaving else \
            "the straggler policy, evict_slower_than, asked it to leave: it worked slower than the others"

    def close_mode(self, drain: bool = True) -> None:
        self.me.mode.close(drain=drain)  # every mode's (``drain=False``: a peer was lost, nothing waited for)
        self.me.mode = None

    def leave_group(self, abandon: bool, gone: Callable[[], bool] | None = None) -> None:
        if dist.is_initialized():
            if abandon:  # a collective may still wait on a lost peer: never join its thread
                faults_watchdog.abandon_groups(gone)
            quiet_backends()  # (lifecycle.shutdown's note: a Gloo thread still letting go of a work)
            dist.destroy_process_group()
        torch_internals.release_abandoned()  # the groups abandoned a timeout ago: their sockets closed


class LeftOut(Exception):
    """This member was left out of an epoch (:meth:`EpochChanges._rejoin`) and joined the job
    again, or is out (it had asked to leave): the step it was committing is not the job's;
    :meth:`fastreduce.Membership.commit` returns ``False``."""


class _Missing(Exception):
    """Members of an epoch that never came to enter it (lost as it formed)."""

    def __init__(self, members: set[str]):
        super().__init__(", ".join(sorted(members)))
        self.members = members


@contextlib.contextmanager
def _quiet() -> Any:
    """Without the modes' warning that the ranks' parameters differed (they do, in a
    per-rank mode rebuilt mid-run: each rank loads its own right after)."""
    logger = logging.getLogger("fastreduce")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        logger.setLevel(level)
