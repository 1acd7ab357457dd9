"""What a local-update mode (:class:`~fastreduce.modes.local.LocalUpdates`: LocalSGD,
DiLoCo) saves and restores per rank: its step and sync counts, the parameter blocks, the
anchor, the fragment on the wire, and the codecs' accumulators; a state saved at another
world size (a Membership's epoch) refitted to this layout.
"""

from __future__ import annotations

from typing import Any

import torch

from ..codecs.sparse import SparseState
from ..comm import complete
from ..faults import guarded

__all__ = ["RESEND", "LocalState"]

RESEND: tuple[None, Any] = (None, lambda: None)
"""A fragment in flight loaded as this rank's payload: averaged again over the mode's group
at its next advance or landing (:meth:`~fastreduce.modes.local.LocalUpdates.local_state_dict`);
told apart from an average already landed, ``(None, None)``, by identity."""


class LocalState:
    """The state half of :class:`~fastreduce.modes.local.LocalUpdates` (a mixin: it reads
    the mode's layout, blocks, anchor, codecs and in-flight fragment, and calls its
    ``_resend``): what it saves and loads, the fragment in flight waited for or kept as
    this rank's payload."""

    _sends_across_steps = False  # a fragment's sync in flight across inner steps (DiLoCo's fragment_delay > 0)

    def keep_sent(self) -> None:
        """Keep this rank's payload of each fragment on the wire until it lands, where one
        stays in flight across inner steps, so that it can be sent again over another group
        (:class:`~fastreduce.Membership` after a loss: :meth:`local_state_dict`). A float
        wire only."""
        if self._sends_across_steps and (self._sparse or self._quant_means):
            raise ValueError(f"{type(self).__name__} cannot send a compressed fragment again over another group: "
                             "use a float wire_dtype and no compression=")
        self._keeps_sent = self._sends_across_steps

    def local_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` without waiting on anything (a peer may be lost): the fragment
        in flight, if any, as this rank's own payload (:meth:`keep_sent`), averaged again
        over the group of the mode it is loaded into, at the step it was due."""
        return {**self._header(), **self._state(wait=False)}

    def _header(self) -> dict[str, Any]:
        raise NotImplementedError

    @guarded("the wait for {cls}'s sync in flight", "The sync in flight is lost; the parameters "
             "are this rank's own since the last sync that completed.")
    def _drain(self) -> None:
        """Wait for the fragment on the wire, if any (it stays due at its step)."""
        for k in list(self._in_flight):
            self._resend(k)
            with self.stats.waiting():
                complete(self._in_flight[k])
            self._in_flight[k] = (None, None)

    def _state(self, wait: bool = True) -> dict[str, Any]:
        """``wait``: the fragment in flight, waited for, as its average; else (a peer may be
        lost) nothing is waited for, and it is kept as this rank's own payload, to be
        averaged again over the group the state is loaded into (:meth:`local_state_dict`)."""
        if wait:
            self._drain()
        landed = {k for k, pending in self._in_flight.items() if pending == (None, None)}
        sending = [k for k in self._in_flight if k not in landed]
        if sending and self._sent is None:
            raise RuntimeError(f"{type(self).__name__}.local_state_dict() with a fragment in flight needs keep_sent() "
                               "before it was launched")
        out: dict[str, Any] = {
            "steps": self.steps, "syncs": self.syncs,
            "params": [f.detach().clone() for f in self._whole_flats()],
            "anchor": [a.clone() for a in self._anchor],
            "in_flight": {k: self._frag_wire[k].clone() for k in landed},
            "to_send": {k: self._sent.clone() for k in sending},
            "fragments": self.fragment_names,
            "segment_numels": [seg.numel for seg in self.layout.segments],  # padded: with the world size
        }
        if self._sparse:
            out["sparse"] = [s.state_dict() for s in self._sparse]
        if self._quant_means and self._quant_means[0].residual is not None:
            out["wire_residuals"] = [q.state_dict() for q in self._quant_means]
        return out

    def _load(self, state: dict[str, Any]) -> None:
        if state.get("fragments") != self.fragment_names:
            raise ValueError("this state_dict was saved for other parameters or fragments "
                             f"({state.get('fragments')!r}) than this mode's ({self.fragment_names!r}); "
                             "build the same model with the same fragments to resume")
        flats = self._whole_flats()
        params, anchor = state["params"], state["anchor"]
        wires = {"in_flight": state["in_flight"], "to_send": state.get("to_send", {})}
        if [tuple(t.shape) for t in params] != [tuple(f.shape) for f in flats] or len(anchor) != len(self._anchor):
            params, anchor, wires = _refit(self, state, wires)  # saved at another world size (Membership)
        if bool(self._sparse) != ("sparse" in state):
            raise ValueError("this state_dict was saved with" + ("out" if self._sparse else "") + " compression= "
                             "(SparseLoCo's accumulators); build the mode with the settings it was saved with")
        saved = list(state.get("sparse", ()))
        if len(saved) != len(self._sparse) or not all(map(SparseState.fits, self._sparse, saved)):
            raise ValueError("this state_dict's SparseLoCo accumulators do not fit this mode's fragments")
        quantized = self._quant_means and self._quant_means[0].residual is not None
        if bool(quantized) != ("wire_residuals" in state):
            raise ValueError("this state_dict was saved with" + ("out" if quantized else "") + " a quantized wire's "
                             "error-feedback residuals; build the mode with the wire_dtype and error_feedback it was "
                             "saved with")
        residuals = list(state.get("wire_residuals", ()))
        if quantized and len(residuals) != len(self._quant_means):
            raise ValueError("this state_dict's quantized wire residuals do not fit this mode's fragments")
        for q, t in zip(self._quant_means, residuals):
            q.check_state_dict(t)
        # Checked: from here on the mode changes. A fragment still in flight lands first, so
        # that what its completion writes (the wire, a quantized wire's mean residual) is
        # replaced by the state, not the other way round.
        with torch.no_grad():
            self._settle()
        for q, t in zip(self._quant_means, residuals):
            q.load_state_dict(t)
        for sparse, t in zip(self._sparse, saved):
            sparse.load_state_dict(t)
        with torch.no_grad():
            for f, t in zip(flats, params):
                f.copy_(t)
            for a, t in zip(self._anchor, anchor):
                a.copy_(t)
            for k, t in wires["in_flight"].items():
                self._frag_wire[int(k)].copy_(t)
                self._in_flight[int(k)] = (None, None)  # averaged already: applied at its step
            for k, t in wires["to_send"].items():
                self._sent = t.clone()
                self._in_flight[int(k)] = RESEND  # this rank's own payload: averaged again over this group
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        for undo in self._undo:  # (what a skipped sync puts back from now on)
            undo.keep()

    def _settle(self) -> None:
        """Nothing left in flight before a state is loaded: a collective still running is
        waited for (it writes into the wire), one that failed (a peer lost: the state
        loaded is what goes on) is let go of."""
        for pending in self._in_flight.values():
            if pending is RESEND:
                continue
            try:
                complete(pending)
            except RuntimeError:
                pass
        self._in_flight = {}


def _refit(self: Any, state: dict[str, Any], wires: dict[str, dict[int, torch.Tensor]]
           ) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, dict[int, torch.Tensor]]]:
    """The parameter blocks, anchors and fragments on the wire (``wires``) of a state saved
    at another world size (each segment padded to another multiple of it), laid out as
    this mode's: each segment's values at this layout's offsets, the padding zero.
    Anything else that differs (another model, dtype or wire setting) raises ``ValueError``."""
    segs, old = self.layout.segments, state.get("segment_numels")
    flats, used = self._whole_flats(), [seg.slots[-1].offset + seg.slots[-1].numel for seg in segs]
    dtypes = list(dict.fromkeys(seg.dtype for seg in segs))  # the blocks' order (params_as_views)
    if (old is None or len(old) != len(segs) or any(n < u for n, u in zip(old, used))
            or [t.dtype for t in state["params"]] != [f.dtype for f in flats]
            or len(state["anchor"]) not in (0, len(segs)) or len(state["anchor"]) != len(self._anchor)):
        raise ValueError("this state_dict's parameter blocks do not match this mode's "
                         "(another model, dtype or wire setting)")
    params = [torch.zeros_like(f) for f in flats]
    anchor = [torch.zeros_like(a) for a in self._anchor]
    src, dst = dict.fromkeys(dtypes, 0), dict.fromkeys(dtypes, 0)
    for j, (seg, n, u) in enumerate(zip(segs, old, used)):
        b = dtypes.index(seg.dtype)
        params[b][dst[seg.dtype]:dst[seg.dtype] + u].copy_(state["params"][b][src[seg.dtype]:src[seg.dtype] + u])
        if anchor:
            anchor[j][:u].copy_(state["anchor"][j][:u])
        src[seg.dtype] += n
        dst[seg.dtype] += seg.numel
    if [src[d] for d in dtypes] != [t.numel() for t in state["params"]]:
        raise ValueError("this state_dict's parameter blocks do not match this mode's "
                         "(another model, dtype or wire setting)")
    return params, anchor, {kind: {k: _refit_wire(self, int(k), t, old, used) for k, t in held.items()}
                            for kind, held in wires.items()}


def _refit_wire(self: Any, k: int, t: torch.Tensor, old: list[int], used: list[int]) -> torch.Tensor:
    """Fragment ``k``'s wire ``t``, saved with segments of ``old`` sizes, in this layout's."""
    out = torch.zeros_like(self._frag_wire[k])
    src = dst = 0
    for j in self._frag_segments[k]:
        out[dst:dst + used[j]].copy_(t[src:src + used[j]])
        src, dst = src + old[j], dst + self.layout.segments[j].numel
    if src != t.numel():
        raise ValueError("this state_dict's fragment on the wire does not match this mode's fragments")
    return out
