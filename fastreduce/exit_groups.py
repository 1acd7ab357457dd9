"""The process groups at the interpreter's exit: quiet before Python finalizes.

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

So at exit, once every thread of fastreduce's stopped (:func:`.lifecycle.shutdown`) and the
groups fastreduce made itself are destroyed (:func:`.lifecycle.at_exit`), :func:`end_groups`
destroys the process groups the script left (``dist.destroy_process_group()``: what torch
asks of every program, and what Lightning does at exit for NCCL), which joins their threads
where nothing else holds them, and then releases the GIL until no thread of a backend's
runs: a thread that was to let go of a work does so then, while the interpreter is whole.
Both are bounded: a group whose collective still waits on a peer is given up on after
:data:`DESTROY_S` (that run failed already), the wait for quiet after
:data:`QUIET_S`. fastreduce holds no process group of its user's strongly (the modes keep the
default group by a weak reference), so a group its user destroys is not kept alive by it.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch.distributed as dist

__all__ = ["end_groups", "native_threads_running"]

log = logging.getLogger(__name__)

DESTROY_S = 10.0
"""At most how long :func:`end_groups` waits for the process groups to be destroyed."""

QUIET_S = 1.0
"""At most how long :func:`end_groups` waits for the backends' threads to stop running."""


def end_groups(timeout: float = DESTROY_S) -> bool:
    """Destroy every process group still registered with torch, within ``timeout`` seconds,
    then wait until no Gloo worker thread runs (at most :data:`QUIET_S`); whether both ended
    in time. Called at the interpreter's exit (see the module's note)."""
    ended = True
    if dist.is_available() and dist.is_initialized():
        ended = _destroy_within(timeout)
    return _quiet(QUIET_S) and ended


def _destroy_within(timeout: float) -> bool:
    """``dist.destroy_process_group()`` on a thread of its own: a group whose work still waits
    on a peer that never comes would hold the exit for the backend's timeout."""
    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001 - a group already broken: the exit goes on
            log.debug("fastreduce: destroying the process groups at exit: %s", err)

    thread = threading.Thread(target=destroy, name="fastreduce-exit", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        log.warning("fastreduce: the process groups did not end within %.0f s at exit (a collective "
                    "still waits on a peer); exiting without them", timeout)
        return False
    return True


def native_threads_running() -> int:
    """How many threads of this process that Python does not run (a backend's C++ threads:
    Gloo's workers, named ``pt_gloo_runloop`` from torch 2.13, unnamed before) are running now
    (state ``R``); 0 where ``/proc`` does not tell."""
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
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
        running += state == "R"
    return running


def _quiet(within: float) -> bool:
    """Release the GIL until no thread of a backend's runs, at two looks in a row: a thread
    waiting for the GIL to let go of a work gets it while this one sleeps, then sleeps itself."""
    deadline = time.monotonic() + within
    calm = 0
    while time.monotonic() < deadline:
        time.sleep(0.002)
        calm = calm + 1 if native_threads_running() == 0 else 0
        if calm == 2:
            return True
    return False
