"""Lost ranks: a heartbeat per process, a diagnosis when a collective fails, :class:`RankLostError`.

When a rank's process dies mid-step, the survivors' collectives fail: Gloo at once
("Connection closed by peer") or at the process group's timeout, the shared-memory
transport within about a second (it watches the ranks' pids, :mod:`.comm.shm`). Such an
error names no rank, or the wrong one (whichever peer a survivor happened to read
from). fastreduce turns it into a :class:`RankLostError` that names the lost ranks and
says what the failed call left behind:

* **heartbeat**: from the first :class:`~fastreduce.comm.Comm` on, a daemon thread of
  every process adds 1 to ``fastreduce/heartbeat/<global rank>`` in the job's c10d store
  (the one ``init_process_group`` rendezvoused through; a connection of its own, cloned
  from it) every ``$FASTREDUCE_HEARTBEAT_S`` seconds (default 1; ``0`` turns it off),
  and registers ``"<host> <pid> <namespaces> <start>"`` once. One small store request per second per rank;
  it stops by itself when the process group is destroyed or the store is gone.
* **diagnosis** (:func:`diagnose`), only after a collective failed: read the counters
  this rank watches (:data:`WATCHED_SUCCESSORS`: every rank's in a world of up to 33), wait
  until each has moved again or ``$FASTREDUCE_LOST_AFTER_S`` (default 3 heartbeats) has
  passed; the ranks whose counter did not move are lost, and published on
  ``fastreduce/lost`` for the ranks that do not watch them. A silent rank whose process
  this one can see running (the same host and namespaces) is given :data:`LOCAL_GRACE`
  windows: many ranks on few cores are slow to beat, not lost. If the store
  itself stops answering and it lives in rank 0's process (``init_process_group``
  through ``MASTER_ADDR``, not torchrun's agent store), rank 0 is the lost one. A lost
  rank stays known: a later failing call raises at once.
* **watchdog** (:func:`wait_watched`): a partition (a host's link down, its process
  alive) fails no Gloo collective before the group's timeout; so the modes' waits on
  Gloo collectives read the watched counters (and ``fastreduce/lost``) while they last,
  and name a rank silent for ``$FASTREDUCE_LOST_AFTER_S`` at once.
* **guard** (:func:`guard`, :func:`guarded`): wraps each mode's calls that wait on
  collectives; a transport failure whose diagnosis finds a lost rank is re-raised as a
  :class:`RankLostError` with the mode's statement of what its state now is; any other
  error goes through unchanged.

So a survivor raises within the transport's detection time (Gloo: at once for a dead
peer, at most the process group's timeout) plus ``$FASTREDUCE_LOST_AFTER_S``.

The pieces live in modules of their own, this one names them all: the errors
(:mod:`.faults_errors`), the heartbeat and its settings (:mod:`.faults_heartbeat`), the
diagnosis (:mod:`.faults_diagnosis`), the watchdog (:mod:`.faults_watchdog`), the guard
(:mod:`.faults_guard`), a process's identity (:mod:`.process_identity`) and torch's
internals they need (:mod:`.torch_internals`).
"""

from __future__ import annotations

from .faults_diagnosis import diagnose
from .faults_errors import RankLostError, TransportError, is_transport_failure
from .faults_guard import guard, guarded
from .faults_heartbeat import (HEARTBEAT_ENV, LOCAL_GRACE, LOST_AFTER_ENV, WATCHED_SUCCESSORS, StoreCaller, group_token,
                               heartbeat_interval, lost_after, note_lost, start_heartbeat)
from .faults_watchdog import all_gather_object_watched, all_reduce_watched, broadcast_object_watched, wait_watched
from .process_identity import exited_here
from .torch_internals import group_timeout

__all__ = ["HEARTBEAT_ENV", "LOCAL_GRACE", "LOST_AFTER_ENV", "WATCHED_SUCCESSORS", "RankLostError", "StoreCaller",
           "TransportError", "all_gather_object_watched", "all_reduce_watched", "broadcast_object_watched",
           "diagnose", "exited_here",
           "group_timeout", "group_token", "guard", "guarded", "heartbeat_interval", "is_transport_failure",
           "lost_after", "note_lost", "start_heartbeat", "wait_watched"]
