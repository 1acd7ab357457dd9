"""A rank of ``tests/test_lifecycle.py``'s exit cases: ``python exit_worker.py CASE USE``
with torch's rendezvous variables set (2 ranks). It ends as a script ends, with no teardown
of fastreduce's; its exit code (and, for ``destroy``, its last line) is the result.

``end``: the race behind an abort at exit ([Note: a backend's thread that takes the GIL as
Python finalizes] in fastreduce/exit_quiet.py), made certain. The script's last collective
is let go of at once, so Gloo's thread holds the work's last reference and takes the GIL to
let go of its tensor; a thread asking for the GIL gets it only once the main thread blocks
(``sys.setswitchinterval(100)``), and a finalizer that sleeps (a large program's exit takes
as long) is the first block unless the exit has one before. torch 2.13 alone: SIGABRT (on the
rank whose collective was still in flight) in every launch here.

``destroy``: the script destroys the process group itself, then ends; it prints whether the
default group is still alive (a FusedReducer alive in a global, as a user's is, must not
keep it; ``torch._dynamo`` is imported before the group exists, as otherwise torch itself
keeps the group, see fastreduce/exit_quiet.py).

USE ``reducer``: a FusedReducer is built and reduces first, and ``fastreduce.shutdown()`` is
called (as the trainers do at the end of ``train()``: nothing of fastreduce's runs at the
exit); ``plain``: torch alone.
"""

import gc
import os
import sys
import time
import weakref

import torch
import torch._dynamo  # noqa: F401 - before the group: see ``destroy`` above
import torch.distributed as dist

CASE, USE = sys.argv[1], sys.argv[2]
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, for every thread started from here on
dist.init_process_group("gloo")
if USE == "reducer":
    import fastreduce

    model = torch.nn.Linear(64, 64)
    model(torch.randn(4, 64)).sum().backward()
    REDUCER = fastreduce.gradient_reducer(model)
    REDUCER.reduce()
    fastreduce.shutdown()


class SlowExit:
    def __del__(self):
        time.sleep(1.5)


if CASE == "end":
    sys.setswitchinterval(100)
    T = torch.ones(1000)
    dist.all_reduce(T, async_op=True)  # its handle let go at once
elif CASE == "destroy":
    dist.all_reduce(torch.ones(1000))
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    print(f"default group alive after destroy_process_group: {world() is not None}", flush=True)
SLOW = SlowExit()
