"""The errors of a lost rank (:mod:`fastreduce.faults`): :class:`RankLostError`, which names
it, :class:`TransportError`, and which failures are a transport's (:func:`is_transport_failure`)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["RESTART", "RankLostError", "StoreUnreachable", "TransportError", "is_transport_failure"]

RESTART = ("Restart from the last checkpoint (fastreduce.checkpoint); under torchrun, "
           "--max-restarts=N restarts the job by itself.")
# Words of the transports' failures (Gloo raises plain RuntimeErrors; NCCL and the
# stores DistErrors): only such errors are diagnosed, a user error goes through at once.
_MARKERS = ("gloo", "nccl", "hccl", "connection", "closed by peer", "timed out", "broken pipe", "socket")


class TransportError(RuntimeError):
    """A collective of fastreduce's own transport (shared memory) failed; the guard
    diagnoses it like a process group's failure."""


class StoreUnreachable(RuntimeError):
    """A store that answers no request (an etcd cluster without its quorum: no endpoint
    answered within its bound): unlike a key waited for in vain, nothing will come."""


class RankLostError(RuntimeError):
    """A rank of the job was lost (its process died, or its host went away) while this
    rank waited on a collective with it.

    Attributes:
        ranks: the lost global ranks, sorted.
        where: the fastreduce call that failed (``"ZeroOptimizer.step()"``), or ``None``
            when raised below the modes.
        state: what that call left behind (gradients, parameters), in words.
        how: how the loss was seen (heartbeat, exited pid, the store).
        world: the job's world size.
        who: per lost rank, ``"pid P on host H"`` where known.
    """

    def __init__(self, ranks: list[int], where: str | None = None, state: str | None = None,
                 how: str = "", world: int | None = None, who: dict[int, str] | None = None):
        self.ranks, self.where, self.state, self.how = sorted(ranks), where, state, how
        self.world, self.who = world, dict(who or {})
        super().__init__(self._message())

    def __reduce__(self) -> tuple:
        return (type(self), (self.ranks, self.where, self.state, self.how, self.world, self.who))

    def _message(self) -> str:
        of = f" of {self.world}" if self.world else ""
        names = ", ".join(f"{r}" + (f" ({self.who[r]})" if self.who.get(r) else "") for r in self.ranks)
        head = (f"fastreduce: rank {names}{of} was lost" if len(self.ranks) == 1 else
                f"fastreduce: ranks {names}{of} were lost")
        head += f" during {self.where}" if self.where else ""
        head += f": {self.how}." if self.how else "."
        return " ".join(s for s in (head, self.state, RESTART) if s)

    def at(self, where: str, state: str) -> RankLostError:
        """The same loss, as seen by the call ``where`` that leaves ``state``."""
        return RankLostError(self.ranks, where, state, self.how, self.world, self.who)


# Named as users import them, and as tracebacks and pickles name them:
TransportError.__module__ = RankLostError.__module__ = "fastreduce.faults"


def is_transport_failure(err: BaseException) -> bool:
    """Whether ``err`` looks like a failed collective (worth a diagnosis)."""
    if isinstance(err, (TransportError, RankLostError)):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(err, dist_error):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _MARKERS)
