"""``fastreduce bench chaos --freeze S`` (:mod:`fastreduce.bench.chaos_freeze`): a member
stopped whole by the launcher, left out by the others, back in the job in its process.

The rejoin itself is :mod:`tests.test_membership`'s (real members, every mode); here: the
plan (seeded, clear of the other failures), the launcher's stop and thaw of a real process,
and the accounting (the freeze is a loss the others saw, not one the frozen member saw; its
parameters after the rejoin checked as a heal; a spare taken in at it counted)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastreduce.bench import chaos as chaos_suite
from fastreduce.bench.chaos_events import events_for
from fastreduce.bench.chaos_freeze import (FREEZE_MIN_S, Freezer, freeze_figures, mark_freeze_loss, note_freeze,
                                           thaw_by, without_stop)
from fastreduce.cli import main


def test_the_freeze_is_seeded_in_the_first_half_clear_of_every_other_failure() -> None:
    """The frozen member is a first member neither a kill nor the straggler takes; its step in
    the first half of the run, clear of each kill, join, straggler window and leader kill
    where there is room; a spare for it with ``--spares``, numbered after the straggler's."""
    for seed in range(10):
        for spares in (False, True):
            cfg = chaos_suite.ChaosConfig(seed=seed, spares=spares, straggler=2.0, evict=True, freeze=4.0, members=5)
            kills = chaos_suite.schedule(cfg, "overlap")
            plain = chaos_suite.ChaosConfig(seed=seed, spares=spares, members=5)
            assert kills == chaos_suite.schedule(plain, "overlap")
            events = events_for(cfg, kills)
            assert events == events_for(cfg, kills) and events_for(cfg, [], chaos=False)["freeze"] is None
            f, s = events["freeze"], events["straggler"]
            assert f["index"] not in {k["victim"] for k in kills} | {s["index"]} and f["index"] < cfg.members
            assert cfg.steps // 20 <= f["step"] < cfg.steps // 2 and f["seconds"] == 4.0
            assert not any(k["step"] - 3 <= f["step"] <= k["step"] + 5 for k in kills)
            assert not s["from"] - 3 <= f["step"] <= s["to"] + 3
            assert f["spare"] == (cfg.members + len(kills) + 1 if spares else None)
    assert thaw_by(300) == 240 and thaw_by(30) == 20
    with pytest.raises(ValueError, match="no first member of 4 is left to freeze"):  # 3 kills, the straggler
        chaos_suite.ChaosConfig(spares=True, straggler=2.0, freeze=4.0)


@pytest.mark.parametrize("argv", [["--freeze", "1"], ["--freeze", "-3"], ["--freeze", "nan"],
                                  ["--freeze", "3", "--joiner-runs", "1"]])
def test_a_bad_freeze_exits_2_before_spawning(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "chaos", *argv]) == 2
    err = capsys.readouterr().err
    assert "freeze" in err, err


TICKING = "import time\nwhile True:\n    print(repr(time.time()), flush=True)\n    time.sleep(0.001)"


def test_the_launcher_stops_a_process_whole_and_lets_it_go_at_the_plan_s_step_and_seconds(tmp_path: Path) -> None:
    """A real process (a shell counting time): stopped (``T`` in /proc) once the committed
    steps reach the plan's, thawed after its seconds, or at once where the steps reach the
    thaw bound first; one already ended is an error in the result, not a crash. Its thaw's
    time is taken before it goes on: nothing it does once going on is timed before it (the
    accounting finds the step it was stopped in as the first to end after the thaw)."""
    class Progress:
        value = 0

    ticks = tmp_path / "ticks"
    with ticks.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", TICKING], stdout=out)
    try:
        progress = Progress()
        freezer = Freezer(proc.pid, {"step": 5, "seconds": FREEZE_MIN_S}, progress, last=100)
        freezer.start()
        time.sleep(0.1)
        assert _state(proc.pid) != "T" and freezer.result is None  # (not at its step yet)
        progress.value = 5
        assert _becomes(proc.pid, "T")
        stopped = time.time()
        time.sleep(0.05)
        progress.value = 100  # the thaw bound: let go now, not its 2 s later
        result = freezer.stop()
        assert _becomes(proc.pid, "S") and result["step"] == 5, result
        assert result["thawed"] - result["at"] < FREEZE_MIN_S, result
        _ticked_after(ticks, result["thawed"])  # (a loaded host schedules it late: waited for, within a limit)
    finally:
        proc.kill()
        proc.wait()
    times = [float(t) for t in ticks.read_text().split()]
    assert any(t > result["thawed"] for t in times)  # (it went on)
    assert not [t for t in times if stopped < t < result["thawed"]], result
    gone = Freezer(proc.pid, {"step": 0, "seconds": 2.0}, Progress(), last=100)
    gone.start()
    assert "ended before its freeze" in gone.stop()["error"]


def _ticked_after(ticks: Path, when: float, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not any(float(t) > when for t in ticks.read_text().split()[:-1]):
        time.sleep(0.01)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _becomes(pid: int, state: str, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while _state(pid) != state and time.monotonic() < deadline:
        time.sleep(0.01)
    return _state(pid) == state


def _rec(steps: list[tuple], **more: object) -> dict:
    """A record: per step (end time, committed, world, epoch[, begin]), 0.01 s long unless begun earlier."""
    n = 0
    at = []
    for _, ok, *_ in steps:
        at.append((n, n + ok))
        n += ok
    return {"iters": [(s[4] if len(s) > 4 else s[0] - 0.01, s[0], s[1], s[2]) for s in steps],
            "epochs": [s[3] for s in steps], "at": at,
            "why": [[] for _ in steps], "counters": {"stalls": [], "rejoins": 0}, "killed": "", "left_at": -1,
            "digests": {}, "entered": {}, "final_digest": "f", "final_step": n, "joined_step": 0, "joined_epoch": 0,
            "rejoined_step": -1, "rejoined_epoch": -1, **more}


def test_the_freeze_is_a_loss_the_others_saw_and_its_rejoin_a_heal() -> None:
    """Members 0 and 1 lose member 2 (stopped at 2.0 s, in its step begun with 2 committed)
    and discard that step; member 2, thawed at 4.0 s, finds itself left out, its step
    discarded too, and rejoins at step 5 (epoch 2). One loss (its own discarded step no
    second one), the others' stall at it, its rejoin timed from its thaw, its digest after
    the rejoin compared with the members' at that step as a heal."""
    from fastreduce.bench.chaos import _digests, _losses

    member = [(1.0, True, 3, 0), (2.0, True, 3, 0), (3.5, False, 2, 1, 2.01), (3.6, True, 2, 1), (3.7, True, 2, 1),
              (3.8, True, 2, 1), (4.2, True, 3, 2, 3.8), (4.3, True, 3, 2)]
    others = {i: _rec(member, digests={"5": "p5", "6": "p6"}) for i in (0, 1)}
    frozen = _rec([(1.0, True, 3, 0), (2.0, True, 3, 0), (4.1, False, 3, 2, 2.01), (4.3, True, 3, 2)],
                  rejoined_step=5, rejoined_epoch=2, digests={"5": "p5", "6": "p6"})
    frozen["counters"]["rejoins"], frozen["final_step"] = 1, 6
    for o in others.values():
        o["final_step"] = 6
    records = {**others, 2: frozen}
    plan = {"index": 2, "step": 2, "seconds": 4.0, "spare": None}
    note_freeze(records, plan, {"at": 2.05, "thawed": 4.0, "step": 2})
    assert frozen["frozen_s"] == [2.05, 4.0] and frozen["frozen_at"] == 2
    assert frozen["left_out_at"] == 2  # (its step stopped in was the one discarded)
    losses = _losses(records, 0.01)
    assert [(e["epoch"], e["discarded"], e["at_step"]) for e in losses] == [(1, 1, 2)]
    kill = {"epoch": 0, "at_s": 1.5, "stall_s": 0.3}  # (a kill's loss before it: not the freeze's)
    mark_freeze_loss([kill, *losses], records, plan, 0.01)
    assert losses[0]["freeze"] and not kill["freeze"]
    assert len(without_stop(frozen)["iters"]) == 3 and without_stop(others[0]) is others[0]
    later = {"epoch": 2, "at_s": 3.9, "stall_s": 0.2, "freeze": False}  # a kill whose epoch took it back in
    f = freeze_figures(plan, records, records, 0.0, 0.01, [*losses, later])
    assert f["kills_after"] == 1
    assert f["frozen_at"] == 2 and f["rejoins"] == 1 and (f["rejoined_step"], f["rejoined_epoch"]) == (5, 2)
    assert f["loss_stall_s"] == losses[0]["stall_s"] == pytest.approx(3.6 - 2.0 - 0.01)  # (the others' at the loss)
    assert f["rejoin_s"] == pytest.approx(0.3) and f["final_step"] == 6
    assert f["members_stall_s"] == pytest.approx(0.39)  # (their step 4.2 s took 0.4 s)
    assert _digests(records, [{"rejoined": 2}])["equal"]
    late = _rec([(1.0, True, 3, 0), (4.05, True, 3, 0, 1.5), (4.1, False, 3, 2), (4.3, True, 3, 2)])
    note_freeze({2: late}, plan, {"at": 2.05, "thawed": 4.0, "step": 2})  # stopped as its commit was done
    assert (late["frozen_index"], late["frozen_at"], late["left_out_at"]) == (1, 1, 2)
    between = _rec([(1.0, True, 3, 0), (2.0, True, 3, 0), (4.1, False, 3, 2, 4.01), (4.3, True, 3, 2)])
    note_freeze({2: between}, plan, {"at": 2.05, "thawed": 4.0, "step": 2})  # stopped between two steps
    again = [{**kill, "freeze": None}, {**losses[0], "freeze": None}]
    mark_freeze_loss(again, {2: between}, plan, 0.01)  # (its next step began at the thaw: the stop counts)
    assert [e["freeze"] for e in again] == [False, True]
    frozen["digests"]["5"] = "stale"
    got = _digests(records, [{"rejoined": 2}])
    assert not got["equal"] and got["heals"] == [{"replacement": 2, "step": 5, "compared": 3, "equal": False}]


def test_a_freeze_the_job_outlived_fails_the_judge() -> None:
    """Where the frozen member never came back in (the job over first, or the others never
    lost it) the run's ``rejoined`` check fails, and its loss is not expected; unless it was
    thawed so near the end that the job was over before its rejoin could be admitted (it
    found the job over: ``found_over``, from :func:`freeze_figures`)."""
    from fastreduce.bench.chaos_events import event_checks

    back = {"rejoins": 1, "rejoined_step": 250, "final_step": 300}
    [(name, value, op, limit, _)] = event_checks(None, None, back, 300)
    assert (name, value, op, limit) == ("rejoined", 1, "in", [1, 1])
    for f in ({**back, "rejoins": 0, "rejoined_step": None, "final_step": 120}, {**back, "final_step": 250}):
        [(_, value, _, limit, _)] = event_checks(None, None, f, 300)
        assert value == 0 and limit == [1, 1]
    over = {**back, "rejoined_step": None, "final_step": 27, "found_over": True}
    assert event_checks(None, None, over, 300)[0][1:4] == (0, "in", [0, 1])
    assert event_checks(None, None, None, 300) == []

    # found_over: thawed, out (m.left) with no rejoin, and the others ended under the grace after the thaw
    plan = {"index": 2, "step": 2, "seconds": 4.0, "spare": None}
    others = {i: _rec([(1.0, True, 3, 0), (2.0, True, 3, 0), (3.5, True, 2, 1), (5.0, True, 2, 1)]) for i in (0, 1)}
    stopped = _rec([(1.0, True, 3, 0), (2.0, True, 3, 0), (4.2, False, 3, 0, 2.01)], left_at=2)
    stopped["counters"]["rejoins"] = 1
    note_freeze({2: stopped}, plan, {"at": 2.05, "thawed": 4.0, "step": 2})
    records = {**others, 2: stopped}
    for grace, found in ((3.0, True), (0.5, False)):  # (the others ended 1.0 s after its thaw)
        f = freeze_figures(plan, records, records, 0.0, 0.01, [], grace)
        assert f["thaw_to_end_s"] == pytest.approx(1.0) and f["found_over"] is found and f["rejoined_step"] is None


def test_a_frozen_member_that_found_the_job_over_is_recorded_as_never_back() -> None:
    """Its ticket to rejoin taken (``counters.rejoins`` 1) but the job over before the members
    admitted it (``m.left``): no rejoin is recorded, so its stale parameters are no heal to
    check; one admitted is recorded once, at the step and epoch it came back in."""
    from types import SimpleNamespace

    from fastreduce.bench.chaos import ChaosRecord as Record
    from fastreduce.bench.chaos_freeze import Freeze

    freeze = Freeze({"freeze": {"index": 1}}, 1)

    def member(left: bool) -> SimpleNamespace:
        return SimpleNamespace(counters=SimpleNamespace(rejoins=1), left=left, step=27,
                               epoch=SimpleNamespace(number=None if left else 4))

    over = Record(1, 0.0)
    freeze.after(member(left=True), over, lambda: "stale")
    assert over.rejoined_step == -1 and not over.digests and not over.entered
    back = Record(1, 0.0)
    freeze.after(member(left=False), back, lambda: "members'")
    assert (back.rejoined_step, back.rejoined_epoch, back.digests, back.entered) == (27, 4, {"27": "members'"},
                                                                                       {"4": "members'"})
    assert Freeze({"freeze": {"index": 2}}, 1).plan is None  # another process's freeze: nothing here


def test_a_leader_killed_while_a_member_is_stopped_costs_the_others_stall_not_the_stop() -> None:
    """The stall an event cost (the etcd leader's kill, an eviction) is the longest gap between
    two commits around it of the members that ran: the frozen member's runs from its stop to
    its first commit back, which a kill in those seconds read as its stall (4.0 s at
    ``--freeze 4``, over the 2 s bound, where the others never stopped)."""
    from fastreduce.bench.chaos_events import gap_stall
    from fastreduce.bench.chaos_freeze import but_frozen

    steady = _rec([(round(0.1 * k, 1), True, 3, 0) for k in range(1, 61)])
    frozen = _rec([(1.0, True, 3, 0), (2.0, True, 3, 0), (6.05, False, 3, 2, 2.01), (6.3, True, 3, 2)])
    final, plan = {0: steady, 1: steady, 2: frozen}, {"index": 2}
    assert gap_stall(final, 3.0, 0.1)[1] == pytest.approx(4.2)  # (the stop, 2.0 to 6.3 s)
    assert gap_stall(but_frozen(final, plan), 3.0, 0.1)[1] == pytest.approx(0.0, abs=1e-9)
    assert but_frozen(final, None) == final
