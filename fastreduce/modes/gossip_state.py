"""What a :class:`~fastreduce.DecentralizedDataParallel` saves and restores, per rank: its
model, every bucket's optimizer and scheduler, the round, the bucket order, and the
exchange in flight (its mixed result, applied at the next step as it would have been).
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Pending

__all__ = ["GossipState"]

DONE: Pending = (None, None)  # an exchange whose result is already in the mixed block


class GossipState:
    """The checkpoint half of :class:`~fastreduce.DecentralizedDataParallel` (a mixin: it
    reads the mode's module, buckets, optimizers, schedulers and blocks)."""

    @property
    def trained_module(self) -> Any:
        """The module the mode wraps (modes/contract.py)."""
        return self.module

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """Everything to resume (collective): the model, every bucket's optimizer and
        scheduler, the round, the bucket order, and the exchange in flight (drained:
        its mixed result is saved and applied at the next step, as it would have been)."""
        self._drain()
        return self._saved(in_flight=True)

    def local_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` without a collective, for when a peer is gone: the exchanges
        in flight are dropped (each bucket keeps this rank's parameters, unmixed for that
        round)."""
        return self._saved(in_flight=False)

    def _saved(self, in_flight: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.module.state_dict(), "round": self._round, "built": self._built}
        if self._built:
            out["buckets"] = self._saved_buckets()
            out["optimizers"] = [o.state_dict() for o in self._optims]
            out["schedulers"] = [s.state_dict() if s is not None else None for s in self._scheds]
            out["mixed"] = [m.clone() for m in self._mixed]
            out["pending"] = [in_flight and self._exchanges[b] is not None for b in range(len(self._buckets))]
            if self._qmix is not None:
                out["public_copies"] = [q.state_dict() for q in self._qmix]
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def _saved_buckets(self) -> list[list[str]]:
        """The parameters' names, bucket by bucket."""
        return [[self._names[i] for i in b.slots] for b in self._buckets]

    def set_round(self, round_: int) -> None:
        """The round of the next exchange (its mixing matrix): every rank must hold the
        same one. A new membership (:class:`fastreduce.Membership`) sets it on every
        member, whose own rounds may differ by one after a loss."""
        self._round = int(round_)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:  # type: ignore[override]
        """Resume from :meth:`state_dict` (same world size, model and wire). Mid-run it first
        finishes the step in progress and waits for the exchanges in flight, as
        :meth:`state_dict` does (collective then: every rank loads at the same point): an
        exchange still reading this rank's parameter block, or writing its mix, would
        otherwise mix the loaded state with the old one."""
        if not state_dict.get("built") and self._built:
            raise ValueError("this state was saved before the mode's first step, and this mode has stepped since: "
                             "its pending mixes, per-bucket optimizers and schedulers cannot go back to their start; "
                             "load it into a new mode; nothing was loaded")
        if state_dict.get("built") and ("public_copies" in state_dict) != (self._quant is not None):
            raise ValueError("this state was saved with a quantized wire's public copies and this mode has no "
                             "quantized wire, or the other way round: resume with the same wire_dtype; nothing "
                             "was loaded")
        self._drain()
        self.module.load_state_dict(state_dict["model"], strict=strict)
        self._round = int(state_dict["round"])
        if state_dict.get("built"):
            index = {n: k for k, (n, _) in enumerate(self._named)}
            order = [index[n] for names in state_dict["buckets"] for n in names]
            if not (self._built and self._saved_buckets() == state_dict["buckets"]):  # else its blocks serve
                if self._built:  # laid out otherwise: its gradient hooks off first (they would fire twice)
                    self._schedule.remove()
                self._build(order, [len(names) for names in state_dict["buckets"]])
            for o, s in zip(self._optims, state_dict["optimizers"]):
                o.load_state_dict(s)
            for sch, s in zip(self._scheds, state_dict["schedulers"]):
                if sch is not None and s is not None:
                    sch.load_state_dict(s)
            with torch.no_grad():
                for b, (m, pending) in enumerate(zip(state_dict["mixed"], state_dict["pending"])):
                    self._mixed[b].copy_(m)
                    self._exchanges[b] = DONE if pending else None
            for q, c in zip(self._qmix or (), state_dict.get("public_copies") or ()):
                q.load_state_dict(c)
        if self.scaler is not None and "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])
