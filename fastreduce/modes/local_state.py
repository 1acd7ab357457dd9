"""What a local-update mode (:class:`~fastreduce.modes.local.LocalUpdates`: LocalSGD,
DiLoCo) saves and restores per rank: its step and sync counts, the parameter blocks, the
anchor, the fragment on the wire, and the codecs' accumulators; a state saved at another
world size (a Membership's epoch) refitted to this layout.
"""

from __future__ import annotations

from typing import Any

import torch

from ..codecs.sparse import SparseState

__all__ = ["LocalState"]


class LocalState:
    """The state half of :class:`~fastreduce.modes.local.LocalUpdates` (a mixin: it reads
    the mode's layout, blocks, anchor, codecs and in-flight fragment)."""

    def _state(self) -> dict[str, Any]:
        self._drain()
        out: dict[str, Any] = {
            "steps": self.steps, "syncs": self.syncs,
            "params": [f.detach().clone() for f in self._whole_flats()],
            "anchor": [a.clone() for a in self._anchor],
            "in_flight": {k: self._frag_wire[k].clone() for k in self._in_flight},
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
        if [tuple(t.shape) for t in params] != [tuple(f.shape) for f in flats] or len(anchor) != len(self._anchor):
            params, anchor = _refit(self, state)  # saved at another world size (Membership)
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
        for q, t in zip(self._quant_means, state.get("wire_residuals", ())):
            q.load_state_dict(t)  # checked (sizes) before the rest is changed; a mismatch raises
        for sparse, t in zip(self._sparse, saved):
            sparse.load_state_dict(t)
        with torch.no_grad():
            for f, t in zip(flats, params):
                f.copy_(t)
            for a, t in zip(self._anchor, anchor):
                a.copy_(t)
            self._drain()
            self._in_flight = {}
            for k, t in state["in_flight"].items():
                self._frag_wire[int(k)].copy_(t)
                self._in_flight[int(k)] = (None, None)  # averaged already: applied at its step
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])


def _refit(self: Any, state: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameter blocks and anchors of a state saved at another world size (each
    segment padded to another multiple of it), laid out as this mode's: each segment's
    parameters at this layout's offsets, the padding zero. Anything else that differs
    (another model, dtype or wire setting, a fragment on the wire) raises ``ValueError``."""
    segs, old = self.layout.segments, state.get("segment_numels")
    flats, used = self._whole_flats(), [seg.slots[-1].offset + seg.slots[-1].numel for seg in segs]
    dtypes = list(dict.fromkeys(seg.dtype for seg in segs))  # the blocks' order (params_as_views)
    if (old is None or len(old) != len(segs) or any(n < u for n, u in zip(old, used)) or state["in_flight"]
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
    return params, anchor
