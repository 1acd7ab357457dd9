"""``fastreduce status`` and ``Membership.status()``: a job's slowest member named, and
evicted where the job asks for it.

Three real members (processes, a real coordinator, Gloo) train a small MLP in the fused
mode; from its step 30 on, member 2 sleeps in each step as long as its step's work took
before (a member slowed to about 2x: a throttled accelerator, a noisy neighbour). The
members see it named a straggler through ``Membership.status()`` within 10 s, and
``fastreduce status HOST:PORT`` (the command, in this process, against the same coordinator
while the job runs) prints the same. Before the slowdown, nobody is a straggler. With
``evict_slower_than=1.3, evict_for_s=2`` it is asked to leave and the other two go on
without it (with a warm spare waiting, the spare takes its place at that poll: the job is 3
again); without it (the default), nothing changes: it stays. (Each member's step times
are kept in its facts: the pace before, during and after, which ``fastreduce bench`` would
judge; a test asserts no timing.)
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fastreduce.cli import main as cli
from fastreduce.coordinator import serve
from fastreduce.launch import rank_context
from fastreduce.status import STRAGGLER_RATIO

SLOW_FROM = 30  # member 2's first slowed step (the pace before it: the median of steps 5-28)
AFTER = 60  # the steps every member takes after the straggler's eviction (its pace: the last 40)
LONGEST_S = 60.0  # each member trains until every member has seen the straggler named, at most this long


def _member(index: int, port: int, out: str, evict: bool, spare: bool = False) -> None:
    import os

    os.environ["FASTREDUCE_HEARTBEAT_S"] = "0.5"
    import fastreduce
    from fastreduce.membership import Membership

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    facts: dict[str, Any] = {"named": None, "before": [], "times": []}
    policy = {"evict_slower_than": 1.3, "evict_for_s": 2.0} if evict else {}  # (3 members on 2 cores blur the 2x)
    m = Membership(f"127.0.0.1:{port}", world_size=3, min_ranks=2, member=f"member{index}", wait_s=60, spare=spare,
                   **policy)
    m.join({"model": model, "optimizer": opt}, lambda: fastreduce.FusedReducer(model))
    store = m.link.store  # (the test's own keys, beside the job's)
    slowed_at, stop_at, deadline = None, None, time.monotonic() + LONGEST_S
    while not m.left and (stop_at is None or m.step < stop_at):
        t0 = time.perf_counter()
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(m.step * 10 + m.rank))
        torch.nn.functional.mse_loss(model(x).squeeze(-1), x.sum(1).tanh()).backward()
        if index == 2 and m.step >= SLOW_FROM:
            time.sleep(time.perf_counter() - t0)  # its work, twice
        m.commit(opt.step)
        opt.zero_grad()
        facts["times"].append((m.step, m.world, time.perf_counter() - t0))
        if m.step == SLOW_FROM:
            slowed_at = time.monotonic()
        status = m.status()
        if slowed_at is None:
            facts["before"].append(status["straggler"])
        elif facts["named"] is None and status["straggler"] is not None:
            facts["named"] = (status["straggler"], time.monotonic() - slowed_at)
        done = m.counters.leaves > 0 if evict else facts["named"] is not None  # (evicted: the others at their pace)
        done = done and store.check(["test/seen"])  # and the command named it too (the test's look)
        if index == 0 and stop_at is None and (done or time.monotonic() > deadline):
            store.compare_set("test/stop_at", "", str(m.step + (AFTER if evict else 10)))  # every member stops there
        if stop_at is None and store.check(["test/stop_at"]):
            stop_at = int(store.get("test/stop_at"))
    facts.update(step=m.step, left=m.left, world=m.world, leaves=m.counters.leaves)
    if m.left:  # a loop that goes on after it (while m.step < steps: ...) is told why and what to do
        try:
            m.commit(opt.step)
        except RuntimeError as err:
            facts["commit_after"] = str(err)
    m.close()
    torch.save(facts, Path(out) / f"member{index}.pt")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("evict, spare", [(False, False), (True, False), (True, True)],
                         ids=["policy-off", "evicted", "evicted-spare"])
def test_a_member_slowed_to_twice_its_step_is_named_by_fastreduce_status(tmp_path: Path, capfd, evict: bool,
                                                                        spare: bool) -> None:
    store = serve(0, "127.0.0.1")
    ctx = rank_context(__name__)  # forked from a server that imported torch and fastreduce once
    members = [ctx.Process(target=_member, args=(i, store.port, str(tmp_path), evict, i == 3))
               for i in range(3 + spare)]
    for p in members:
        p.start()
    seen: list[dict[str, Any]] = []
    while any(p.is_alive() for p in members) and not any(s.get("straggler") for s in seen):
        capfd.readouterr()
        assert cli(["status", f"127.0.0.1:{store.port}", "--json"]) == 0
        seen.append(json.loads(capfd.readouterr().out))
        time.sleep(0.5)
    tables = []  # the text form, while member 2 is slowed (a read can fall in a step the loaded machine blurred)
    for _ in range(20):
        assert cli(["status", f"127.0.0.1:{store.port}"]) == 0
        tables.append(capfd.readouterr().out)
        if "<- straggler" in tables[-1] or "member2" not in tables[-1]:
            break
        time.sleep(0.25)
    store.set("test/seen", "1")  # the members may stop (at the latest LONGEST_S after they started)
    table = tables[-1]
    for p in members:
        p.join(120)
        assert p.exitcode == 0, p.exitcode
    facts = [torch.load(tmp_path / f"member{i}.pt") for i in range(3)]
    for f in facts:
        assert f["named"] is not None and f["named"][0] == "member2", f["named"]
        assert f["named"][1] <= 10.0, f["named"]  # seconds from the slowdown to its name
        assert not any(f["before"]), f["before"]  # nobody before it
    assert seen[-1]["straggler"] == "member2", seen[-1]
    busy = {m: f["busy_s"] for m, f in seen[-1]["members"].items()}
    assert busy["member2"] >= STRAGGLER_RATIO * busy["member0"], seen[-1]
    if not evict:  # it stays: nothing changes
        assert "member2" in table and "<- straggler" in table.split("member2", 1)[1].split("\n", 1)[0], table
        assert all(f["world"] == 3 and not f["left"] and f["leaves"] == 0 for f in facts), facts
        return
    world = 3 if spare else 2  # (the spare in member 2's place)
    assert facts[2]["left"] and all(f["world"] == world and f["leaves"] == 1 for f in facts[:2]), facts
    said = facts[2]["commit_after"]  # (it said "leave()", which this member never called)
    assert "the straggler policy, evict_slower_than, asked it to leave" in said and "not m.left" in said, said
    assert facts[0]["step"] == facts[1]["step"] > facts[2]["step"], [f["step"] for f in facts]  # the two went on
    if spare:
        taken = torch.load(tmp_path / "member3.pt")
        assert taken["world"] == 3 and taken["step"] == facts[0]["step"] and not taken["left"], taken
        assert all(w == 3 for _, w, _ in facts[0]["times"]), "the job was ever short of a member"
        before = statistics.median(t for _, _, t in facts[0]["times"][5:SLOW_FROM - 1])
        after = statistics.median(t for _, _, t in facts[0]["times"][-(AFTER - 20):])  # the spare's first 20 apart
        print(f"evicted-spare: median step {1e3 * before:.1f} ms before the slowdown, {1e3 * after:.1f} ms after the "
              f"eviction ({after / before:.3f}x; a figure, not asserted)")


def test_no_straggler_is_named_where_no_member_is_busier_than_the_others() -> None:
    """read_status on a store the members published to: every member's wait as long as its
    step (each busy 0 s, the median 0) names no straggler (a ratio of a median of 0 named the
    first member, whom the eviction policy would ask to leave); one busy member among idle ones,
    and one 2x the others, are named."""
    from fastreduce.coordinator import Epoch, epoch_key
    from fastreduce.status import STATUS_PREFIX, read_status

    server = serve(0, "127.0.0.1")
    server.set(epoch_key(0), Epoch(0, ("a", "b", "c"), 0, 1, ()).to_json())

    def publish(busy: dict[str, float]) -> dict:
        for name, b in busy.items():
            server.set(STATUS_PREFIX + name, json.dumps({"at": time.time(), "step": 5, "step_s": 0.1 + b, "wait_s": 0.1}))
        return read_status(server)

    assert publish({"a": 0.0, "b": 0.0, "c": 0.0})["straggler"] is None
    assert publish({"a": 0.0, "b": 0.0, "c": 0.05})["straggler"] == "c"
    assert publish({"a": 0.05, "b": 0.1, "c": 0.05})["straggler"] == "b"
    assert publish({"a": 0.05, "b": 0.06, "c": 0.05})["straggler"] is None


def test_a_pulse_beats_at_its_pace_with_the_heartbeat_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """FASTREDUCE_HEARTBEAT_S <= 0 turns the epochs' heartbeat off; a waiting member's pulse
    (fastreduce.presence.Pulse) still beats every 0.25 s, not as fast as the store answers
    (-1 made 428k requests in half a second)."""
    from fastreduce.presence import Pulse, pulses

    server = serve(0, "127.0.0.1")
    for off in ("0", "-1"):
        monkeypatch.setenv("FASTREDUCE_HEARTBEAT_S", off)
        pulse = Pulse(server, f"m{off}", lambda fn, *args: fn(*args))
        pulse.up()
        time.sleep(0.6)
        assert pulse.stop(timeout=2.0)
        assert 2 <= pulses(server, lambda fn, *args: fn(*args), [f"m{off}"])[f"m{off}"] <= 5, off


@pytest.mark.timeout(120)
def test_status_watch_says_in_one_line_that_its_coordinator_went_away() -> None:
    """``fastreduce status --watch`` whose coordinator goes away mid-watch (its server closed):
    one line on stderr and exit 1, as when it cannot connect; it printed a Python traceback
    (after c10d's C++ backtrace) instead."""
    import gc
    import subprocess
    import sys

    from fastreduce.coordinator import Epoch, epoch_key

    server = serve(0, "127.0.0.1")
    port = server.port
    server.set(epoch_key(0), Epoch(0, ("a", "b"), 0, 2).to_json())
    watch = subprocess.Popen([sys.executable, "-m", "fastreduce", "status", f"127.0.0.1:{port}", "--watch", "0.2"],
                             cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert watch.stdout.readline().startswith("epoch 0 (from step 0): 2 members")
        del server  # the coordinator gone
        gc.collect()
        out, err = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.communicate()
    assert watch.returncode == 1, (watch.returncode, err[-3000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fastreduce status: the coordinator at 127.0.0.1:{port} stopped "
                                                   "answering ("), err[-3000:]


@pytest.mark.timeout(60)
def test_coordinator_on_a_taken_or_impossible_port_says_so_in_one_line(capsys) -> None:
    """``fastreduce coordinator --port P`` where another job's coordinator already serves P:
    one line and exit 1 (it was c10d's DistNetworkError, EADDRINUSE, in a Python traceback);
    a port out of range (70000, -1): argparse's error and exit 2 (it was pybind's TypeError)."""
    taken = serve(0, "127.0.0.1")
    assert cli(["coordinator", "--host", "127.0.0.1", "--port", str(taken.port)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    said = f"fastreduce coordinator: cannot listen on 127.0.0.1:{taken.port} "
    assert len(lines) == 1 and any(lines[0].startswith(said + kind) for kind in ("(DistNetworkError: ",
                                                                                 "(RuntimeError: ")), lines  # (2.6's)
    assert "in use" in lines[0], lines
    for port in ("70000", "-1"):
        with pytest.raises(SystemExit) as stop:
            cli(["coordinator", "--port", port])
        assert stop.value.code == 2
        assert f"argument --port: a port is 0 to 65535 (0: any free one), got '{port}'" in capsys.readouterr().err


class _Rank0:
    """Member a, rank 0 of epoch 0 (a, b) on a real coordinator, its eviction policy real (it
    reads the status there and asks there), on the test's clock (``at``); b, busy 5x a per
    step in the figures both published, is the straggler in every read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **settings: Any):
        from types import SimpleNamespace

        import fastreduce.status as status
        from fastreduce.coordinator import TICKETS, Epoch, epoch_key
        from fastreduce.membership import Membership
        from fastreduce.status import STATUS_PREFIX

        self.at = 100.0
        monkeypatch.setattr(status, "time", SimpleNamespace(monotonic=lambda: self.at, time=time.time))
        self.server = server = serve(0, "127.0.0.1")
        self.m = Membership(f"127.0.0.1:{server.port}", world_size=2, member="a", evict_slower_than=1.3, **settings)
        self.m.me.epoch = Epoch(0, ("a", "b"), 0, 2, ())
        server.set(epoch_key(0), self.m.me.epoch.to_json())
        server.add(TICKETS, 2)
        for name, busy in (("a", 0.01), ("b", 0.05)):
            server.set(STATUS_PREFIX + name, json.dumps({"at": time.time(), "step": 5, "step_s": 0.1 + busy,
                                                         "wait_s": 0.1}))

    def looks(self, n: int = 1, every_s: float = 1.0) -> None:
        """``n`` looks of the policy ``every_s`` apart, each look's read in the background
        awaited (the next look judges it)."""
        evictions = self.m.votes.evictions
        for _ in range(n):
            self.at += every_s
            evictions.look()
            if evictions._reading is not None:
                assert evictions._reading[0].wait(10), "the status read did not complete"

    def asked(self) -> bool:
        """Whether b was asked to leave."""
        from fastreduce.coordinator import MEMBERS_PREFIX

        return self.server.check([MEMBERS_PREFIX + "leaving/b"])


def test_a_straggler_stays_where_its_eviction_leaves_the_job_below_min_ranks_with_no_one_waiting(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """world_size=2, min_ranks=2: member b, the straggler in every read for longer than
    evict_for_s, stays (said once in the log) while no process waits to take its place; its
    eviction left a alone below min_ranks, who waited wait_s and raised RankLostError saying
    b was lost. A process with another layout waiting does not count; a warm spare registered
    after the epoch formed (not in its Epoch.spares) does: b is asked to leave then."""
    import logging

    from fastreduce.coordinator import TICKETS, ticket_key

    job = _Rank0(monkeypatch, min_ranks=2, evict_for_s=2.0)
    m, server = job.m, job.server

    def register(ticket: dict[str, Any]) -> None:
        t = server.add(TICKETS, 1)
        server.set(ticket_key(t), json.dumps({"member": f"p{t}", "start": 0, "spare": True, **ticket}))

    try:
        with caplog.at_level(logging.WARNING, logger="fastreduce.membership"):
            job.looks(7)  # named in every read for 6 s, evict_for_s=2
            assert not job.asked(), "b was asked to leave: the job would be below min_ranks, no one to take its place"
            register({"print": dict(m.admission.fingerprint(), tag="another mode")})
            job.looks(3)
            assert not job.asked(), "a process that would be refused was taken for one that takes b's place"
            register({"print": m.admission.fingerprint()})  # a warm spare, after the epoch formed
            job.looks(2)
            assert job.asked(), "b stayed though a warm spare waits to take its place"
        kept = [r.getMessage() for r in caplog.records if "it stays" in r.getMessage()]
        assert len(kept) == 1 and "below min_ranks=2" in kept[0] and "member b" in kept[0], kept
    finally:
        m.close()


def test_a_straggler_is_timed_by_its_reads_not_across_a_pause_or_an_epoch_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """evict_for_s=30: b named in two reads 1 s apart, then every member pauses 35 s (an
    evaluation between two steps: no step, no poll, no read): b stays; the read taken before
    the pause was judged after it, against that moment's clock, and b was asked to leave for
    36 s of being slow. Its time starts again after the pause and at a new epoch (in epoch 1:
    28 s, it stays; 30 s, it is asked)."""
    from fastreduce.coordinator import Epoch, epoch_key

    job = _Rank0(monkeypatch, evict_for_s=30.0)
    try:
        job.looks(1)  # read 1 taken
        job.looks(1, every_s=0.2)  # judged: b named
        job.looks(1, every_s=0.9)  # read 2 taken, 1.1 s after
        job.looks(1, every_s=35.0)  # the first poll after the pause judges read 2 (and takes read 3)
        assert not job.asked(), "b asked to leave on reads taken 1.1 s apart: the pause counted as time it was slow"
        job.looks(20)
        job.server.set(epoch_key(1), Epoch(1, ("a", "b"), 40, 2).to_json())  # (a joiner came and went, say)
        job.looks(30)  # (each read is judged at the next look: these, over 28 s of epoch 1)
        assert not job.asked(), "b asked to leave after 28 s of its reads in epoch 1: an earlier epoch's counted"
        job.looks(2)
        assert job.asked(), "b, named in every read of epoch 1 for 30 s, was not asked to leave"
    finally:
        job.m.close()
