"""How the members of a :class:`~fastreduce.Membership` go from one epoch to the next: the
survivors (and joiners) agree on it through the coordinator, each enters it (a new default
process group on a fresh store prefix, the joiners healed from rank 0, the mode built again
with each member's own state, ZeRO's shards joined and resharded), and what each mode keeps
across it (:func:`_kind`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import fastreduce.faults as faults

from .coordinator import _P, CoordinatorClient, Epoch, MembershipError, _epoch_key
from .faults import RankLostError
from .heal import broadcast_state
from .modes import zero_mirror

__all__ = ["EpochChanges"]

log = logging.getLogger("fastreduce.membership")

POLLS_PER_S = 4000.0
"""How many times a second the members of an epoch poll the coordinator together while they
gather for the next one (:meth:`EpochChanges._gather`) or enter it (``_rendezvous``): a member
polls every ``max(5 ms, members / POLLS_PER_S)``. At a fixed 5 ms, 1,024 members made 400k
requests a second to the one-threaded store, and their client threads on this 2-core machine
could not finish one formation in 8 s (``fastreduce bench store --scenarios form``)."""


def _poll_s(members: int) -> float:
    """Seconds between two polls of one member of an epoch of ``members``."""
    return max(0.005, members / POLLS_PER_S)


class EpochChanges(CoordinatorClient):
    """The epoch half of :class:`~fastreduce.Membership` (a mixin).

    It reads what the membership holds: ``member``, ``epoch``, ``step``, ``mode``,
    ``counters``, ``_state``, ``_build``, ``_healed``, ``_kept_mode``, ``min_ranks``,
    ``wait_s``, ``backend``, ``timeout_s``; and calls its ``_fingerprint()``,
    ``_differs()`` and ``_ticket()`` (a joiner's checks).
    """

    def _next_epoch(self, lost: set[str], why: str, start: float) -> None:
        """With the other survivors: the next epoch, without ``lost`` and with the
        joiners waiting; then its group, the state for the joiners and the mode
        (``start``: when the step that ends the epoch began, for :attr:`counters`)."""
        old = self._epoch()
        n = old.number + 1
        self._stash_mode(after_loss=why == "loss")
        beats = faults._default_store()  # the old epoch's: its members' heartbeats stay readable
        self._leave_group(abandon=why == "loss")
        said = self._gather(old, lost, why, beats)
        present, mine, key = list(said), self._fingerprint(), _epoch_key(n)
        # The members holding the job's state at its latest step come first (rank 0 sends
        # it); the survivors one step behind (their reduction failed where these completed
        # it) and a joiner whose healing failed (its source lost) receive it. Only members
        # that held the state propose (a joiner's step count is not the job's yet).
        healed = [m for m in present if said[m]["healed"]]
        top = max((said[m]["step"] for m in healed), default=self.step)
        behind = tuple(m for m in healed if said[m]["step"] != top)
        healed = [m for m in healed if m not in behind]
        unhealed = behind + tuple(m for m in present if not said[m]["healed"])
        deadline = time.monotonic() + self.wait_s
        while not self._healed:
            if self._wait(key, 0.25):
                break
            if time.monotonic() > deadline:
                raise MembershipError(f"fastreduce: no member holding the job's state formed epoch {n} within "
                                      f"{self.wait_s:g} s (the members were lost while this process joined)")
        while self._healed:  # below min_ranks: wait for joiners (unless another survivor proposed already)
            tickets = int(self._call(self.store.add, _P + "tickets", 0))
            checked = [(t, self._ticket(t)) for t in range(old.admitted + 1, tickets + 1)
                       if not self._call(self.store.check, [_P + f"admit/{t}"])]  # not refused already
            refusals = {t: self._differs(j["print"], mine) for t, j in checked}
            joiners = tuple(j["member"] for t, j in checked if refusals[t] is None)
            proposal = Epoch(n, tuple(healed) + unhealed + joiners, top, tickets, unhealed + joiners)
            if proposal.world >= self.min_ranks or self._call(self.store.check, [key]):
                break
            if time.monotonic() > deadline:
                raise RankLostError(sorted(old.members.index(m) for m in set(old.members) - set(present)),
                                    "Membership", f"{len(present)} member(s) are left, below min_ranks="
                                    f"{self.min_ranks}, and no process joined within {self.wait_s:g} s",
                                    "members were lost", old.world)
            time.sleep(0.05)
        epoch = self._propose(proposal, refusals) if self._healed else \
            Epoch.from_json(self._call(self.store.get, key))
        if self.member not in epoch.members:
            raise MembershipError(f"fastreduce: this member ({self.member}) was left out of epoch {epoch.number} "
                                  "(it registered after the others had formed it); start it again to rejoin")
        if self._healed and self.member not in epoch.joined and epoch.step != self.step:
            raise MembershipError(f"fastreduce: epoch {epoch.number} begins at step {epoch.step} but this member "
                                  f"committed {self.step}: the members disagree on the committed steps (a bug: "
                                  "please report it)")
        self.counters.joins += sum(m not in old.members for m in epoch.joined)  # not a survivor healed forward
        self._enter(epoch)
        self.counters.stalls.append((why, time.perf_counter() - start))

    def _gather(self, old: Epoch, lost: set[str], why: str, beats: Any) -> dict[str, dict[str, Any]]:
        """Announce this member for the epoch after ``old`` and wait for the other
        survivors' announcements: those of the members of ``old`` present (its step and
        whether it holds the job's state), in ``old``'s order: every member not ``lost``;
        fewer where the epoch was formed by others meanwhile, or a survivor stayed silent
        past the window and ``wait_s``. ``beats``: the old epoch's store, whose heartbeats
        tell a slow survivor from a lost one."""
        n = old.number + 1
        announced, alive = _P + f"e{n}/alive", _P + f"e{n}/alive/"  # how many, and each one's word
        self._call(self.store.set, alive + self.member, json.dumps({"step": self.step, "healed": self._healed}))
        self._call(self.store.add, announced, 1)
        expected = [m for m in old.members if m not in lost]
        window = faults.lost_after() if why == "loss" else self.timeout_s
        deadline, last = time.monotonic() + window, time.monotonic() + self.wait_s
        counted: dict[str, int] = {}
        key = _epoch_key(n)
        # Each tick reads the count (and whether the epoch was formed), not every member's key:
        # two requests a member, where a check per member made N^2 a tick at N members.
        while True:
            if int(self._call(self.store.add, announced, 0)) >= len(expected) and \
                    self._call(self.store.check, [alive + m for m in expected]):
                present = [m for m in old.members if m not in lost or self._call(self.store.check, [alive + m])]
                break
            if self._call(self.store.check, [key]):
                # Formed already, by survivors that knew whom the failure lost (this one's
                # collective may fail without naming anyone): they waited for this member.
                present = self._present(old, alive)
                break
            if time.monotonic() > deadline:
                # A survivor still beating in the old epoch (slow to see the loss: a long
                # forward, a loaded host) is waited for, a window at a time, up to wait_s.
                present = self._present(old, alive)
                missing = [m for m in expected if m not in present]
                if beats is None or time.monotonic() > last or not self._beating(beats, old, missing, counted):
                    break
                deadline = time.monotonic() + window
            time.sleep(_poll_s(old.world))
        words = self._call(faults.read_all, self.store, [alive + m for m in present])  # one request (torch >= 2.5)
        return dict(zip(present, map(json.loads, words)))

    def _present(self, old: Epoch, alive: str) -> list[str]:
        """The members of ``old`` that announced themselves for the next epoch (a request each)."""
        return [m for m in old.members if self._call(self.store.check, [alive + m])]

    def _beating(self, beats: Any, old: Epoch, members: list[str], counted: dict[str, int]) -> bool:
        """Whether a heartbeat of ``members`` in epoch ``old`` moved since last counted
        (``True`` the first time: counted now, to compare a window later)."""
        first, moved = not counted, False
        for m in members:
            n = int(self._call(beats.add, f"{faults._KEY}heartbeat/{old.members.index(m)}", 0))
            moved |= m in counted and counted[m] != n
            counted[m] = n
        return first or moved

    def _propose(self, proposal: Epoch, refusals: dict[int, str | None]) -> Epoch:
        """Write ``proposal`` unless another member's for that epoch was first; then admit
        the joiners of the epoch written and refuse the tickets it handled with another
        layout (the rest wait for a later epoch). Returns the epoch written."""
        key = _epoch_key(proposal.number)
        epoch = Epoch.from_json(self._call(self.store.compare_set, key, "", proposal.to_json()))
        for t, bad in refusals.items():
            if t > epoch.admitted:
                continue
            joined = bad is None and self._ticket(t)["member"] in epoch.joined
            if joined or bad is not None:
                self._call(self.store.set, _P + f"admit/{t}", str(epoch.number) if joined else f"refused: {bad}")
        return epoch

    def _enter(self, epoch: Epoch) -> None:
        """This epoch's process group; the state from rank 0 where it has joiners; the mode.
        A member lost meanwhile (the joiners' source, say): the next epoch, without it."""
        self.epoch = epoch
        try:
            self._set_up(epoch)
        except (RuntimeError, _Missing) as err:
            lost = err.members if isinstance(err, _Missing) else self._lost_in(err) if dist.is_initialized() else None
            if lost is None:
                raise
            self.counters.losses += 1
            log.warning("fastreduce: entering epoch %d failed (lost: %s); forming the next one", epoch.number,
                        ", ".join(sorted(lost)) or "a silent member")
            self._next_epoch(lost, "loss", time.perf_counter())
            return
        self._healed = True
        self._kept_mode = (None, "")
        self._poll_at, self._last_commit = epoch.step, None  # every epoch polls at its first step

    def _set_up(self, epoch: Epoch) -> None:
        own, kind = self._kept_mode
        self._rendezvous(epoch)
        store = dist.PrefixStore(_P + f"e{epoch.number}/pg/", self.store)
        dist.init_process_group(self.backend, store=store, rank=epoch.members.index(self.member),
                                world_size=epoch.world, timeout=timedelta(seconds=self.timeout_s))
        faults.start_heartbeat()  # this epoch's: the vote watches it
        joining = self.member in epoch.joined
        fresh = joining and not self._healed  # a new process (a survivor one step behind keeps its mode's state)
        if epoch.joined:  # a per-rank mode's state too (a fused mode's is rank 0's own residuals: not sent)
            got, sent_kind = self._sync_state(joining, own if kind in ("local", "gossip") else None, kind)
            if fresh:  # rank 0's mode state came only if its mode keeps one per rank
                own, kind = got, sent_kind
        per_rank = kind in ("local", "gossip")
        pieces = None
        if kind == "zero":  # this member's pieces of the shards (a joiner's: none), resharded once built
            pieces, own = None if fresh else own, None
        if self._build is not None:
            with _quiet() if own is not None and per_rank else contextlib.nullcontext():
                self.mode = self._build()  # (it starts every rank from rank 0's: each loads its own next)
            _check_mode(self.mode)
            if own is not None and (per_rank or not fresh):
                self.mode.load_state_dict(own)  # a member's own state goes on; a joiner's: rank 0's
            if kind == "zero":  # every shard's state (parameters too, where stale) resharded onto this epoch
                try:
                    zero_mirror.reshard(self.mode, pieces)
                except zero_mirror.ShardsLost as err:
                    raise MembershipError(f"fastreduce: {err}: ZeroOptimizer(redundant=True) keeps each shard on two "
                                          "ranks, so the job cannot go on; restart it from the last checkpoint") \
                        from err
            if _kind(self.mode) == "gossip":  # the members' rounds may differ by one after a loss
                self.mode.set_round(epoch.step)

    def _rendezvous(self, epoch: Epoch) -> None:
        """Wait until every member of ``epoch`` is entering it, at most a few loss windows
        (they all read the epoch within milliseconds of each other): a member that died
        meanwhile is named here (:class:`_Missing`), not after the process group's own
        rendezvous waited its whole timeout for it."""
        key = _P + f"e{epoch.number}/ready"
        self._call(self.store.set, f"{key}/{self.member}", "1")
        self._call(self.store.add, key, 1)
        deadline = time.monotonic() + max(5.0, 4 * faults.lost_after())
        while int(self._call(self.store.add, key, 0)) < epoch.world:
            if time.monotonic() > deadline:
                raise _Missing({m for m in epoch.members if not self._call(self.store.check, [f"{key}/{m}"])})
            time.sleep(_poll_s(epoch.world))

    def _device(self) -> torch.device:
        """Where the state travels: the model's device (Gloo: the CPU)."""
        first = next((p for v in self._state.values() if isinstance(v, torch.nn.Module) for p in v.parameters()), None)
        return torch.device("cpu") if dist.get_backend() == "gloo" or first is None else first.device

    def _sync_state(self, joining: bool, mode_state: dict[str, Any] | None, kind: str) -> tuple[Any, str]:
        """Rank 0's whole state (and its mode's, ``mode_state``, and the mode's kind) to
        every rank, its tensors as one flat broadcast per dtype
        (:func:`~fastreduce.heal.broadcast_state`); a joiner loads it and gets the mode's
        state and kind back, to load once its mode is built."""
        mine = None
        if dist.get_rank() == 0:
            mine = {"step": self.step, "state": {k: v.state_dict() for k, v in self._state.items()},
                    "mode": mode_state, "kind": kind}
        got = broadcast_state(mine, self._device())
        if not joining or dist.get_rank() == 0:
            return None, kind
        for k, obj in self._state.items():
            obj.load_state_dict(got["state"][k])
        self.step = int(got["step"])
        return got["mode"], got["kind"]

    def _stash_mode(self, after_loss: bool) -> None:
        """Keep the mode's state until the next epoch is entered (a failed entry must not
        lose it), then take the mode off: after a loss without a collective (gossip's
        exchanges in flight are dropped), else as it saves it (they are completed)."""
        if self.mode is None:
            return
        kind = _kind(self.mode)
        if kind == "zero":  # its shard and its copy of the previous rank's (no collective)
            self._kept_mode = (zero_mirror.held(self.mode), kind)
        else:
            save = self.mode.local_state_dict if after_loss and kind == "gossip" else \
                getattr(self.mode, "state_dict", None)
            self._kept_mode = (_clone(save()) if save is not None else None, kind)
        self._close_mode(drain=not after_loss)

    def _close_mode(self, drain: bool = True) -> None:
        if _kind(self.mode) == "gossip":
            self.mode.close(drain=drain)
        elif _kind(self.mode) == "zero":
            self.mode.close(wait=drain)
        elif (close := getattr(self.mode, "close", None) or getattr(self.mode, "remove", None)) is not None:
            close()
        self.mode = None

    def _leave_group(self, abandon: bool) -> None:
        if dist.is_initialized():
            if abandon:  # a collective may still wait on a lost peer: never join its thread
                faults._abandon_groups()
            dist.destroy_process_group()



class _Missing(Exception):
    """Members of an epoch that never came to enter it (lost as it formed)."""

    def __init__(self, members: set[str]):
        super().__init__(", ".join(sorted(members)))
        self.members = members


def _kind(mode: Any) -> str:
    """How :meth:`Membership.commit` runs ``mode``: ``local`` (LocalSGD, DiLoCo: their
    collectives in the optimizer's step), ``zero`` (:class:`~fastreduce.ZeroOptimizer`: a vote
    before its shards step), ``gossip`` (steps and exchanges inside forward and
    backward), ``reduce`` (the fused and overlapped reducers), else ``other``."""
    if hasattr(mode, "communicates_at"):
        return "local"
    if hasattr(mode, "mirror"):
        return "zero"
    if hasattr(mode, "local_state_dict"):
        return "gossip"
    return "reduce" if hasattr(mode, "reduce") else "other"


def _check_mode(mode: Any) -> None:
    """Refuse, on every member alike, a mode Membership cannot keep training."""
    if _kind(mode) == "other":
        raise TypeError(f"fastreduce.Membership runs the fused, overlapped, ZeRO, gossip, LocalSGD and DiLoCo modes, "
                        f"not {type(mode).__name__}")
    if _kind(mode) == "zero" and not mode.redundant:
        raise ValueError("ZeroOptimizer under fastreduce.Membership needs redundant=True: each rank's optimizer shard "
                         "is then also kept on the next rank, so it is not lost with its rank (4P/N more memory "
                         "per rank with AdamW)")
    if getattr(mode, "fragment_delay", 0):
        raise ValueError("DiLoCo's fragment_delay > 0 (a sync in flight across inner steps) is not supported "
                         "under fastreduce.Membership yet: use fragment_delay=0")
    if _kind(mode) == "gossip" and getattr(mode, "_quant", None) is not None:
        raise ValueError("gossip with a quantized wire keeps a public copy of each neighbour's parameters, which a "
                         "new membership's topology would not match: under fastreduce.Membership use a float "
                         "wire_dtype (bfloat16 halves the bytes)")


def _clone(state: Any) -> Any:
    """A deep copy of a ``state_dict``'s tensors (torch's optimizers return their own)."""
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


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
