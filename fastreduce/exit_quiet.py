"""The backends' threads at the interpreter's exit: quiet before Python finalizes.

[Note: a backend's thread that takes the GIL as Python finalizes]
A Gloo process group runs its collectives on C++ worker threads. Such a thread lets go of a
finished work a moment after the rank's ``wait()`` returned; where it holds the last
reference, the work's tensors go with it, and letting go of a tensor that Python knows takes
the GIL. If the process reaches the end of its script in that moment (the last collective
just before the end, on a loaded host where that thread is descheduled), the thread asks for
the GIL only once Python has begun to finalize; Python then ends the thread inside a C++
destructor and the C++ runtime aborts the process ("terminate called without an active
exception", SIGABRT, exit -6): a job that trained and saved is a failed one to torchrun,
Slurm and Kubernetes. (Seen in core dumps of such aborts, torch 2.13: the worker in
``~AsyncWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``.) A plain
Gloo script of 20 all-reduces, two ranks, no teardown, exited -6 in 3 of 6 launches on this
2-core machine while it was loaded. torch joins those threads only when the last reference
to the group goes, and that is rarely at ``dist.destroy_process_group()``: importing
``torch._dynamo`` after the group exists (``torch.compile``, or any check of whether
compiling) imports ``torch.distributed.nn.functional``, whose functions take the default
group as a default argument, so it lives as long as the interpreter.

So at exit, once every thread of fastreduce's stopped (:func:`.lifecycle.shutdown`),
:func:`quiet_backends` releases the GIL until no thread of a backend's runs: a thread that was
to let go of a work does so then, while the interpreter is whole, and goes back to waiting
for work, which needs no GIL. It waits at most :data:`QUIET_S` and never on a peer. (It
does not destroy the groups: their destruction waits for any collective still pending, which
a peer that hangs or a partition can hold for the group's timeout, at the exit of a run that
failed already; with a bounded destroy at exit, a CI rehearsal's two-host bench launch did
not end within torchrun's 300 s exit barrier.) fastreduce holds no process group of its user's strongly (the
modes keep the default group by a weak reference), so a group its user destroys goes.

The same thread can hold up a group's end inside a run: the last reference to a group let go
of on the main thread (a DDP's reducer going with its function's end, after
``destroy_process_group()``) joins the group's threads with the GIL held, while a Gloo thread
waits for the GIL to let go of the last work: a deadlock (a CI rehearsal's network bench,
py-spy: the main thread in ``~ProcessGroupGloo`` -> ``thread::join``, the worker in
``~AsyncAllgatherWork`` -> ``gil_scoped_acquire``). So :func:`.lifecycle.shutdown` ends with
:func:`quiet_backends` too, and a Membership calls it before it ends an epoch's group.
"""

from __future__ import annotations

import os
import threading
import time

from .process_identity import proc_named_stat

__all__ = ["native_threads_running", "quiet_backends"]

QUIET_S = 1.0
"""At most how long :func:`quiet_backends` waits for the backends' threads to stop running."""
EXIT_CALM_S = 0.1
"""At the interpreter's exit, how long no backend's thread must have run: a collective still
waiting for a late peer (a thread asleep until its data comes) finishes within it, where the
peer is a moment behind (a full suite on 2 cores aborted one such exit in 3,400 tests with the
2 ms used inside a run); a peer later than that is not waited for."""


TRANSPORT_LOOPS = ("gloo_tcp_loop",)
"""Backend threads that hold no work and never take the GIL, so never waited for: Gloo's TCP
event loop. Once a peer of its group has died it can spin (state ``R`` in 20-33 of 50 samples
over a second, torch 2.13, with or without ``abort()``) until the group is let go, which under
a Membership is the abandoned group's timeout: every epoch change after such a loss waited
:data:`QUIET_S` for it (1 in 4-6 runs of ``bench faults`` on Gloo, a 1.1 s stall at the join)."""


def native_threads_running() -> int:
    """How many threads of this process that Python does not run (a backend's C++ threads:
    Gloo's workers, named ``pt_gloo_runloop`` from torch 2.13, unnamed before) are running now
    (state ``R``), :data:`TRANSPORT_LOOPS` apart; 0 where ``/proc`` does not tell."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    pythons = {t.native_id for t in threading.enumerate()}
    running = 0
    for tid in tasks:
        if int(tid) in pythons:
            continue
        try:
            name, fields = proc_named_stat(tid)
            running += name not in TRANSPORT_LOOPS and fields[0] == "R"
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
    return running


def quiet_backends(within: float = QUIET_S, calm_s: float = 0.002) -> bool:
    """Release the GIL until no thread of a backend's has run for ``calm_s`` seconds (looked
    at every 2 ms; at most ``within`` seconds; whether it came to that): a thread waiting for
    the GIL to let go of a work gets it while this one sleeps, then sleeps itself. Called by
    :func:`.lifecycle.shutdown` (at the end of the trainers' runs, before a group is destroyed),
    before a Membership ends an epoch's group, and at the interpreter's exit with
    :data:`EXIT_CALM_S`."""
    deadline = time.monotonic() + within
    calm_since = None
    while True:  # (looked at first too: calm then and still calm 2 ms on is 2 ms, not 4, of an epoch change)
        now = time.monotonic()
        if native_threads_running():
            calm_since = None
        elif calm_since is None:
            calm_since = now
        elif now - calm_since >= calm_s:
            return True
        if now >= deadline:
            return False
        time.sleep(0.002)
