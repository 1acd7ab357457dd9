"""The c10d store's load from the heartbeat and the membership vote, at 64 ranks and at 1,024.

fastreduce's failure detector and its membership talk to one c10d ``TCPStore`` (the job's,
or a :class:`~fastreduce.Membership`'s coordinator). This suite measures what that store
sees, replaying the library's own code, never a copy of its request pattern:

* **real** (:func:`run_real`): ``real_ranks`` (64) Gloo ranks on this host
  (:func:`fastreduce.launch.run_ranks`), each running the real heartbeat
  (:func:`fastreduce.faults.start_heartbeat`); all but rank 0 then wait in one
  ``all_reduce`` through :func:`fastreduce.faults.wait_watched` while rank 0 sleeps
  ``real_seconds``, so each runs the real watchdog (every heartbeat it reads every rank's
  counter). The heartbeat's connection is swapped for a :class:`Counted` one after it
  started: every request on it (the beats and the watchdog's reads) is counted and timed.
* **synthetic** (:func:`run_synthetic`): one ``TCPStore`` server in a process of its own,
  ``n`` clients (64, 256, 1,024) spread over ``procs`` processes, one ``TCPStore`` client
  (connection) per simulated rank, as each rank's heartbeat has. Each client runs the real
  ``Heartbeat._run`` loop (:mod:`fastreduce.faults`) on a :class:`Counted` connection, and
  per scenario (:data:`SCENARIOS`) also the real watchdog loop (``faults_watchdog.watch_heartbeats``: the
  reads of every counter and of the published verdict, with the real loss decision) or
  the real per-step vote (``Votes.vote``: the step's counter, the decision written
  by the voter that completes it, the others' waiting get), or the real gathering of the
  survivors for a next epoch (``Gathering.gather``).

Counting: a request is one call of a store method on a :class:`Counted` connection (one
round trip of c10d's protocol; ``check`` and ``multi_get`` carry ``n`` keys each, counted
apart as keys). Latency is that call's time on the client. A **false loss** is the real
watchdog naming a live rank (a counter unchanged for the loss window as it read them), or
the store not answering within the watchdog's deadline; in the synthetic runs the verdict
is recorded and not published, so one false loss does not stop the other clients' load.
``beat_gap_max_s``: the longest time between two of a client's beats landing, against
the loss window (a gap of the window is a false loss for any reader).

Limits: every client, the server and the watchdogs share this host's cores (2 on the
reference machine), so Python's client threads compete with the server for CPU: latencies
are an upper bound on the server's share, and the server's CPU seconds per second
(``server_cpu``) say how near one core it runs.

Run it (the CLI does not carry it yet)::

    python -m fastreduce.bench.store            # the full run, a few minutes
    python -c "from fastreduce.bench.store import *; print(format_text(run_store_bench(StoreConfig(clients=(64,)))))"
"""

from __future__ import annotations

import os
import random
import resource
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import fastreduce.faults as faults
import fastreduce.faults_heartbeat as faults_heartbeat
import fastreduce.faults_watchdog as faults_watchdog
import fastreduce.reach as reach
from fastreduce import membership
from fastreduce.coordinator import Epoch
from fastreduce.launch import rank_context, run_ranks

from .common import machine_info, percentile

__all__ = ["SCENARIOS", "Counted", "StoreConfig", "format_text", "run_real", "run_store_bench", "run_synthetic",
           "scenario_settings"]

SCENARIOS = ("beat", "watch", "member_watch", "vote", "form")
"""``beat``: the heartbeat alone at the default period (a job whose collectives finish within
a heartbeat: its steady state). ``watch``: the heartbeat and every rank's watchdog (every
rank waiting in a collective longer than a heartbeat: a slow step, or a loss being found).
``member_watch``: the same at a Membership's heartbeat period (its vote's wait reads the
counters at this cadence too). ``vote``: a Membership's heartbeat and its per-step vote at
``step_rate`` steps per second. ``form``: a Membership's heartbeat and, over and over, the
real gathering of the survivors for its next epoch after a loss (``Gathering.gather``:
each member announces itself, polls until every survivor has, and reads their
announcements), each member starting
within 0.1 s of the others (as they see a loss); a formation's time: per member, from the
last survivor's announcement until it knew every survivor had announced."""
REQUESTS = frozenset({"add", "set", "get", "check", "multi_get", "multi_set", "compare_set", "delete_key",
                      "wait", "num_keys"})
"""The store methods that are requests to the server (the rest are local: ``clone``, ``set_timeout``)."""
_LOST_KEY = faults_heartbeat.STORE_PREFIX + "lost"
_BEAT_KEY = faults_heartbeat.STORE_PREFIX + "heartbeat/"


@dataclass(kw_only=True)
class StoreConfig:
    """One run of the suite."""

    clients: tuple[int, ...] = (64, 256, 1024)
    """Synthetic clients (simulated ranks) per run."""
    scenarios: tuple[str, ...] = SCENARIOS
    """Which synthetic scenarios to run at each size (:data:`SCENARIOS`)."""
    seconds: float = 8.0
    """Measured seconds per synthetic run (after every client connected)."""
    procs: int = 8
    """Processes the synthetic clients are spread over (threads within each)."""
    step_rate: float = 5.0
    """The ``vote`` scenario's steps per second (one vote per step at a poll_s of 0.2 s)."""
    real_ranks: int = 64
    """Ranks of the real run (0: none)."""
    real_seconds: float = 20.0
    """How long the real run's ranks watch (rank 0's sleep)."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown:
            raise ValueError(f"scenarios must be among {', '.join(SCENARIOS)}, got {unknown}")
        if any(n < 2 for n in self.clients) or self.procs < 1 or not self.seconds > 0 or not self.step_rate > 0:
            raise ValueError("clients at least 2 each, procs at least 1, seconds and step_rate positive")
        if self.real_ranks == 1 or self.real_ranks < 0:
            raise ValueError(f"real_ranks must be 0 (none) or at least 2, got {self.real_ranks}")


def scenario_settings(scenario: str) -> dict[str, float]:
    """The heartbeat period and loss window of ``scenario``, as the library derives them:
    its defaults (:func:`fastreduce.faults.heartbeat_interval`, :func:`~fastreduce.faults.lost_after`
    with no environment setting) or a Membership's (its settings' ``heartbeat_s``)."""
    saved = {k: os.environ.pop(k, None) for k in (faults.HEARTBEAT_ENV, faults.LOST_AFTER_ENV)}
    try:
        if scenario in ("member_watch", "vote", "form"):
            os.environ[faults.HEARTBEAT_ENV] = str(membership.MembershipSettings(world_size=1).heartbeat_s)
        return {"heartbeat_s": faults.heartbeat_interval(), "window_s": faults.lost_after()}
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


# ---------------------------------------------------------------- counting a connection

class Counted:
    """A store connection whose requests are timed into ``log`` as ``(method, keys, start,
    seconds)``; a verdict published on ``fastreduce/lost`` is recorded in ``verdicts``
    and, with ``publish=False``, not sent (so a false loss does not stop the others)."""

    def __init__(self, store: Any, log: list[tuple[str, int, float, float]], publish: bool = True):
        self._store, self.log, self.publish, self.verdicts = store, log, publish, []
        self.beats: list[float] = []  # when each heartbeat (an add of 1 to a heartbeat key) landed

    def clone(self) -> Counted:
        return Counted(reach.clone(self._store), self.log, self.publish)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._store, name)
        if name not in REQUESTS:
            return fn

        def request(*args: Any) -> Any:
            if name in ("set", "compare_set") and args[0] == _LOST_KEY:  # set: (key, value); compare_set: (key,
                self.verdicts.append((time.monotonic(), args[-1]))     # expected, value), the value on success
                if not self.publish:
                    return args[-1] if name == "compare_set" else None
            keys = len(args[0]) if name in ("check", "multi_get", "wait") else 1
            t0 = time.monotonic()
            try:
                return fn(*args)
            finally:
                t1 = time.monotonic()
                self.log.append((name, keys, t0, t1 - t0))
                if name == "add" and args[1] == 1 and args[0].startswith(_BEAT_KEY):
                    self.beats.append(t1)
        return request


# ---------------------------------------------------------------- one simulated rank

def _heartbeat(store: Any, rank: int, world: int, interval: float) -> Any:
    """A heartbeat of ``rank`` of ``world`` over ``store`` (its thread not started: the
    caller runs its real ``_run`` loop, which beats until the store raises). Its identity
    names no process (never seen running: ``process_identity.running_here``)."""
    return faults_heartbeat.Heartbeat.simulated(store, rank, world, interval, f"bench {os.getpid()}")


def _member(store: Any, rank: int, world: int, poll_s: float, step_s: float) -> Any:
    """A ``Membership`` of epoch 0 of ``world`` members (``rank``'s), between its steps:
    enough of one for its real ``_vote``."""
    m = membership.Membership(store, world_size=world, member=str(rank), poll_s=poll_s,
                              timeout_s=600.0, wait_s=600.0)  # built as a member is: nothing of it left out
    m.me.epoch = Epoch(0, tuple(str(r) for r in range(world)), 0, world, ())  # then as after join()
    m.votes.step_s, m.me.healed = step_s, True  # the step time the vote's deadlines scale with; the state held
    return m


def _former(m: Any, world: int, beats: Any, start: float, done: threading.Event, out: dict[str, list]) -> None:
    """Epoch after epoch, the real gathering of the survivors (``Gathering.gather``) of
    an epoch of ``world`` + 1 members whose last was lost; every survivor must be found."""
    lost, k = {str(world)}, 0
    members = tuple(str(r) for r in range(world + 1))
    time.sleep(max(0.0, start - time.monotonic()))
    while not done.is_set():
        time.sleep(random.uniform(0.0, 0.1))  # the survivors see the loss within a spread
        t0 = time.monotonic()  # (one clock for every process of this host)
        try:
            present = m.epochs.gathering.gather(Epoch(k, members, 0, world, ()), lost, "loss", beats)  # announcements
        except Exception as err:  # noqa: BLE001 - the store raised (the bench ended, or a real failure)
            if not done.is_set():
                out["membership_errors"].append(f"{type(err).__name__}: {str(err)[:160]}")
            return
        out["forms"].append((k, t0, time.monotonic()))
        if len(present) != world:
            out["membership_errors"].append(f"epoch {k + 1}: {len(present)} of {world} survivors found")
        k += 1


class _Stopped(RuntimeError):
    pass


class _Stoppable(Counted):
    """A :class:`Counted` connection that raises once ``stop`` is set (ends the real
    heartbeat loop, which stops when its store raises)."""

    def __init__(self, store: Any, log: list, stop: threading.Event, publish: bool):
        super().__init__(store, log, publish)
        self.stop = stop

    def clone(self) -> _Stoppable:
        return _Stoppable(reach.clone(self._store), self.log, self.stop, self.publish)

    def __getattr__(self, name: str) -> Any:
        if self.stop.is_set() and name in REQUESTS:
            raise _Stopped("the bench ended")
        return super().__getattr__(name)


def _watcher(beat: Any, done: threading.Event, out: dict[str, list]) -> None:
    """The real watchdog (``faults_watchdog.watch_heartbeats``) until ``done``; a loss it names or a store it
    finds silent is recorded, forgotten, and the watch starts again."""
    while not done.is_set():
        try:
            faults_watchdog.watch_heartbeats(beat, done)
        except faults.TransportError as err:
            out["false_losses"].append((time.monotonic(), beat.rank, str(err)[:160]))
            beat.lost.clear()
        except _Stopped:
            return


def _voter(m: Any, start: float, rate: float, done: threading.Event, out: dict[str, list]) -> None:
    s = 0
    while not done.is_set():
        wake = start + s / rate
        time.sleep(max(0.0, wake - time.monotonic()))
        if s >= m.votes.poll_at:  # the library's own rule for a poll
            t0 = time.perf_counter()
            try:
                decision, _ = m.votes.vote(s)
            except Exception as err:  # noqa: BLE001 - the store raised (the bench ended, or a real failure)
                if not done.is_set():
                    out["membership_errors"].append(f"{type(err).__name__}: {str(err)[:160]}")
                return
            out["votes"].append(time.perf_counter() - t0)
            if decision != "go":
                out["membership_errors"].append(f"decision {decision!r} at step {s}")
        s += 1


def _client_proc(scenario: str, ranks: list[int], world: int, port: int, settings: dict[str, float],
                 step_rate: float, seconds: float, connecting: Any, ready: Any, go: Any, results: Any) -> None:
    """One process of simulated ranks: a connection and the real heartbeat each, plus the
    scenario's watchdog or vote; returns its log through ``results``."""
    try:
        _raise_fd_limit()
        os.environ[faults.HEARTBEAT_ENV] = str(settings["heartbeat_s"])
        os.environ[faults.LOST_AFTER_ENV] = str(settings["window_s"])
        log: list[tuple[str, int, float, float]] = []
        out: dict[str, list] = {"false_losses": [], "votes": [], "membership_errors": [], "forms": []}
        stop, done = threading.Event(), threading.Event()
        timeout = timedelta(seconds=max(5.0, 2 * settings["window_s"]))  # the heartbeat's own connection's
        with connecting:  # one process at a time: see [Note: concurrent connects]
            conns = [_Stoppable(_connect(port, timeout), log, stop, publish=False) for _ in ranks]
            beats = [_heartbeat(c, r, world, settings["heartbeat_s"]) for c, r in zip(conns, ranks)]
            members = [_member(c, r, world, 0.2, 1.0 / step_rate) for c, r in zip(conns, ranks)] \
                if scenario in ("vote", "form") else []
            for m in members if scenario == "vote" else ():
                m.link.vote_connection()  # its second connection, made before the clock starts
        ready.put(len(ranks))
        start = go.get()
        del log[:]
        threads = []
        for b in beats:  # the heartbeats start at random phases, as ranks do
            threads.append(threading.Timer(random.uniform(0, b.interval), b._run))
        if scenario in ("watch", "member_watch"):
            threads += [threading.Thread(target=_watcher, args=(b, done, out)) for b in beats]
        for m, c in zip(members, conns):
            threads.append(threading.Thread(target=_voter, args=(m, start, step_rate, done, out))
                           if scenario == "vote" else
                           threading.Thread(target=_former, args=(m, world, c, start, done, out)))
        for t in threads:
            t.daemon = True
            t.start()
        time.sleep(max(0.0, start + seconds - time.monotonic()))
        done.set()
        time.sleep(settings["heartbeat_s"] + 0.1)
        stop.set()
        end = go.get()
        results.put(("ok", {"log": [e for e in log if start <= e[2] < end], **out,
                            "beat_gaps": [_max_gap(c.beats, start, end) for c in conns]}))
    except BaseException as err:  # noqa: BLE001 - back to the parent
        import traceback
        ready.put(0)  # the parent waits for every process's word before anything else
        results.put(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        results.close()
        results.join_thread()


# [Note: concurrent connects] On the reference machine (torch 2.13, both of the store's
# backends) about one connect in 25 to a TCPStore stalls 5 s: c10d looks up the name of
# the peer's address (``::ffff:127.0.0.1``, not in /etc/hosts) and the sandbox's DNS
# server never answers ("The hostname of the client socket cannot be retrieved. err=-3");
# several processes connecting at once then time out. Not the steady state measured here,
# so the clients connect one process at a time, before the clock starts (1,024 clients:
# minutes of setup, no CPU).

def _connect(port: int, timeout: timedelta, tries: int = 5) -> Any:
    """A client of the server at ``port`` on this host, tried again where a connect stalls."""
    for attempt in range(tries):
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                                  wait_for_workers=False)
            store.set_timeout(timeout)
            return store
        except dist.DistNetworkError:
            if attempt == tries - 1:
                raise


def _server_proc(ready: Any, go: Any, results: Any) -> None:
    """The store's server, alone in its process: its CPU seconds over the measured window."""
    try:
        _raise_fd_limit()
        server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=60))
        ready.put(server.port)
        go.get()
        cpu0 = _cpu()
        go.get()
        results.put(_cpu() - cpu0)
        go.get()  # the clients are done
    finally:
        results.close()
        results.join_thread()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ---------------------------------------------------------------- the runs

def run_synthetic(scenario: str, n: int, seconds: float, procs: int = 8, step_rate: float = 5.0) -> dict[str, Any]:
    """``n`` simulated ranks on one ``TCPStore`` for ``seconds``: the figures of :func:`summarize`."""
    ctx = rank_context(__name__)  # the clients import this module once, in the fork server
    settings = scenario_settings(scenario)
    sq, sgo, sres = ctx.Queue(), ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_server_proc, args=(sq, sgo, sres), daemon=True)
    server.start()
    port = sq.get(timeout=60)
    ready, results, connecting = ctx.Queue(), ctx.Queue(), ctx.Lock()
    parts = [list(range(n))[i::procs] for i in range(min(procs, n))]
    gos = [ctx.Queue() for _ in parts]
    clients = [ctx.Process(target=_client_proc, daemon=True, args=(scenario, part, n, port, settings, step_rate,
                                                                   seconds, connecting, ready, gos[i], results))
               for i, part in enumerate(parts)]
    try:
        for p in clients:
            p.start()
        for _ in clients:
            ready.get(timeout=600)
        start = time.monotonic() + 0.5
        for q in gos:
            q.put(start)
        sgo.put(None)
        time.sleep(max(0.0, start + seconds - time.monotonic()))
        sgo.put(None)
        for q in gos:
            q.put(start + seconds)
        got = [results.get(timeout=60 + 2 * seconds) for _ in clients]
        cpu = sres.get(timeout=30)
        sgo.put(None)
    finally:
        for p in [*clients, server]:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [g for kind, g in got if kind == "error"]
    if errors:
        raise RuntimeError("a client process failed:\n" + errors[0])
    merged: dict[str, Any] = {"log": [], "false_losses": [], "votes": [], "membership_errors": [], "beat_gaps": [],
                              "forms": []}
    for _, g in got:
        for k in merged:
            merged[k] += g[k]
    return {"scenario": scenario, "clients": n, **settings, **summarize(merged, seconds, n),
            "server_cpu": round(cpu / seconds, 3)}


def summarize(got: dict[str, Any], seconds: float, n: int) -> dict[str, Any]:
    """Requests and keys per second, latency by method, the longest gap between a client's
    beats, false losses and (``vote``, ``form``) the vote's or a formation's time, from the
    clients' records."""
    log = got["log"]
    by: dict[str, list[float]] = {}
    for name, _, _, dt in log:
        by.setdefault(name, []).append(dt)
    gaps = [g for g in got["beat_gaps"] if g is not None]
    out = {
        "requests": len(log), "requests_per_s": round(len(log) / seconds, 1),
        "keys_per_s": round(sum(k for _, k, _, _ in log) / seconds, 1),
        "latency_ms": {m: _dist(ts) for m, ts in sorted(by.items())},
        "all_ms": _dist([dt for *_, dt in log]),
        "false_losses": len(got["false_losses"]),
        "false_loss_examples": sorted({e for *_, e in got["false_losses"]})[:3],
        "membership_errors": got["membership_errors"][:3],
    }
    if gaps:
        out["beat_gap_max_s"] = round(max(gaps), 3)
    if got["votes"]:
        out["vote_ms"] = _dist(got["votes"])
        out["votes_per_client_s"] = round(len(got["votes"]) / n / seconds, 2)
    if got.get("forms"):  # per member, from the last survivor's announcement until it knew (whole epochs)
        epochs: dict[int, list[tuple[float, float]]] = {}
        for k, t0, t1 in got["forms"]:
            epochs.setdefault(k, []).append((t0, t1))
        whole = [e for e in epochs.values() if len(e) == n]
        out["form_ms"] = _dist([t1 - max(t0 for t0, _ in e) for e in whole for _, t1 in e])
        out["formations"] = len(whole)
    return out


def _max_gap(beats: list[float], start: float, end: float) -> float | None:
    """The longest time without a beat landing within ``[start, end]`` (its edges count)."""
    inside = [t for t in beats if start <= t <= end]
    if not inside:
        return end - start
    edges = [start, *inside, end]
    return max(b - a for a, b in zip(edges, edges[1:]))


def _dist(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {}
    return {"p50": round(percentile(seconds, 0.5) * 1e3, 3), "p99": round(percentile(seconds, 0.99) * 1e3, 3),
            "max": round(max(seconds) * 1e3, 3), "n": len(seconds)}


def _real_rank(rank: int, world: int, seconds: float) -> dict[str, Any]:
    """A real rank: its heartbeat, on a :class:`Counted` connection; rank 0 sleeps
    ``seconds`` before it enters the ``all_reduce`` the others wait in, watched."""
    import torch

    faults.start_heartbeat()
    beat = faults_heartbeat.heartbeat_now()
    log: list[tuple[str, int, float, float]] = []
    beat.store = Counted(beat.store, log)  # its loop and its reads look it up at every request
    dist.barrier()
    t0, lost = time.monotonic(), []
    t = torch.ones(1)
    if rank == 0:
        time.sleep(seconds)
        dist.all_reduce(t)
    else:
        try:
            faults.wait_watched(dist.all_reduce(t, async_op=True))
        except faults.TransportError as err:
            lost.append((time.monotonic(), rank, str(err)[:160]))
    end = time.monotonic()
    return {"log": [e for e in log if t0 <= e[2] < end], "beat_gaps": [_max_gap(beat.store.beats, t0, end)],
            "false_losses": lost, "votes": [], "membership_errors": [], "seconds": end - t0}


def run_real(ranks: int, seconds: float) -> dict[str, Any]:
    """``ranks`` real Gloo ranks on this host: the heartbeat and the watchdog for ``seconds``."""
    settings = scenario_settings("watch")
    t0 = time.monotonic()
    got = run_ranks(_real_rank, ranks, seconds, timeout=seconds + 180.0, threads=1)
    took = time.monotonic() - t0
    merged: dict[str, Any] = {k: [x for g in got for x in g[k]]
                              for k in ("log", "beat_gaps", "false_losses", "votes", "membership_errors")}
    span = min(g["seconds"] for g in got)
    return {"scenario": "real watch", "clients": ranks, **settings, **summarize(merged, span, ranks),
            "wall_s": round(took, 1)}


def run_store_bench(cfg: StoreConfig) -> dict[str, Any]:
    """The real run (``cfg.real_ranks``), then every synthetic scenario at every size."""
    runs = []
    if cfg.real_ranks:
        runs.append(run_real(cfg.real_ranks, cfg.real_seconds))
    for scenario in cfg.scenarios:
        for n in cfg.clients:
            runs.append(run_synthetic(scenario, n, cfg.seconds, cfg.procs, cfg.step_rate))
    return {"config": asdict(cfg), "machine": machine_info(), "runs": runs}


def format_text(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"store suite: one c10d TCPStore; the real heartbeat and watchdog at {c['real_ranks']} ranks for "
             f"{c['real_seconds']:g} s; synthetic clients {', '.join(map(str, c['clients']))} over {c['procs']} "
             f"processes for {c['seconds']:g} s each; vote at {c['step_rate']:g} steps/s",
             "",
             f"{'scenario':<14}{'n':>6}{'beat s':>7}{'win s':>6}{'req/s':>9}{'keys/s':>10}{'all p50/p99/max ms':>22}"
             f"{'read p50/p99/max ms':>22}{'gap s':>7}{'lost':>6}{'srv cpu':>8}{'vote/form p50/p99 ms':>22}"]
    for r in result["runs"]:
        lat = r["latency_ms"]
        read = lat.get("multi_get", {})
        vote = r.get("vote_ms") or r.get("form_ms", {})
        lines.append(f"{r['scenario']:<14}{r['clients']:>6}{r['heartbeat_s']:>7g}{r['window_s']:>6g}"
                     f"{r['requests_per_s']:>9.0f}{r['keys_per_s']:>10.0f}{_three(r['all_ms']):>22}"
                     f"{_three(read):>22}{r.get('beat_gap_max_s', float('nan')):>7.2f}{r['false_losses']:>6}"
                     f"{_cell(r.get('server_cpu')):>8}"
                     f"{_two(vote):>22}")
    lines += ["", "(req/s: requests reaching the store, counted on each client connection; keys/s: keys they carry; "
              "read: the watchdog's multi_get of every counter; gap s: the longest time between two beats of one "
              "client landing; lost: false losses (the real watchdog naming a live rank, or the store silent for "
              "its window); srv cpu: the server process's CPU seconds per second; form: one member's gathering "
              "of the survivors for a next epoch, from its announcement)"]
    for r in result["runs"]:
        for e in r["false_loss_examples"] + r["membership_errors"]:
            lines.append(f"{r['scenario']} {r['clients']}: {e}")
    return "\n".join(lines)


def _two(d: dict[str, float]) -> str:
    return f"{d['p50']:.0f}/{d['p99']:.0f}" if d else "-"


def _three(d: dict[str, float]) -> str:
    return f"{d['p50']:.2f}/{d['p99']:.1f}/{d['max']:.0f}" if d else "-"


def _cell(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    import json
    import sys

    res = run_store_bench(StoreConfig())
    print(format_text(res))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)
