"""The mode contract: what every mode declares, so that the code that runs a mode
(:class:`~fastreduce.Membership`, the trainers, checkpoints) asks it instead of guessing
from which attributes the mode happens to have.

What every mode declares today:

* **its name** (``mode_name``: ``fused``, ``overlap``, ``zero``, ``gossip``, ``local``,
  ``diloco``; what a checkpoint records) and **the module it trains** (``trained_module``);
* **how a step commits** under a Membership: the class attribute ``commit_style``, one of
  :data:`COMMIT_STYLES` (read through :func:`commit_style`);
* **where its state lives** (``state_scope``, one of :data:`STATE_SCOPES`) and **whose
  optimizer it steps** (``optimizer_role``, one of :data:`OPTIMIZER_ROLES`): what a
  checkpoint saves, once or per rank, and onto which world sizes it loads;
* **the settings a Membership needs of it** (``membership_settings``, e.g. ZeRO's
  ``redundant=True``: a shard must outlive its rank, and ``membership_why``), and **what
  of its own settings a Membership cannot keep training** (``membership_refusal``: a
  reason, or ``None``; ``membership_refusal_for(settings)`` where the class can tell before
  it is built), asked by :func:`check_membership` and :func:`settings_refusal`;
* **who may leave at once** (a ``sharded`` mode): ``kept_without(ranks)``, whether every
  shard keeps a holder (its rank or a copy's) when ``ranks`` leave, asked by
  :func:`leaving_now`;
* **how a mode closes**: ``close(drain=True)``, its hooks off the model, what is in flight
  waited for (``drain=False``: dropped, a peer was lost);
* **its state after a loss** (the styles ``gossip`` and ``local``): ``local_state_dict()``,
  its ``state_dict`` without waiting on anything in flight (gossip's exchanges dropped; a
  DiLoCo fragment on the wire kept as this rank's payload, sent again over the group it is
  loaded into), and, for ``local``, ``keep_sent()``, called once it is built under a
  Membership, so that such a payload is kept.

The rest of what the consumers need (its figures, its settings) is still read in several
places; docs/design.md, "The modes and what they share".
"""

from __future__ import annotations

from typing import Any

__all__ = ["COMMIT_STYLES", "OPTIMIZER_ROLES", "PER_RANK_ONLY_AT_ITS_WORLD", "STATE_SCOPES", "check_membership",
           "commit_style", "leaving_now", "meets", "membership_settings", "mode_name", "optimizer_role",
           "settings_refusal", "state_scope", "wait_seconds"]

COMMIT_STYLES: dict[str, str] = {
    "reduce": "the fused and overlapped reducers: commit() runs the reduction, the members vote, "
              "then the optimizer steps",
    "zero": "ZeroOptimizer: the members meet inside its step() (all_arrived()), between the last gradient "
            "collective and the shards' step (its commit_point()), and vote at the polls",
    "gossip": "DecentralizedDataParallel: its steps and exchanges run inside forward and backward; "
              "commit(fn) runs them, then the members vote",
    "local": "LocalSGD and DiLoCo: the collectives run inside the optimizer's step; the members vote "
             "only before a step that syncs",
}
"""Every way a mode's step commits, with what it means."""


def _class(mode: Any) -> type:
    return mode if isinstance(mode, type) else type(mode)


def commit_style(mode: Any) -> str:
    """How a step of ``mode`` (a mode, or its class) commits (a key of :data:`COMMIT_STYLES`),
    as its class declares it (``commit_style``); ``""`` for one that declares none: not a mode."""
    style = getattr(_class(mode), "commit_style", "")
    return style if style in COMMIT_STYLES else ""


STATE_SCOPES: dict[str, str] = {
    "replicated": "the same on every rank after each step (the fused and overlapped reducers): saved once, "
                  "loads onto any world size",
    "sharded": "each rank holds a shard (ZeroOptimizer): saved as each rank's ranges, loads onto any world size",
    "per_rank": "each rank's own, the models differing between syncs (gossip, LocalSGD, DiLoCo): saved per "
                "rank, loads onto the world size it was saved at",
}
"""Where a mode's state lives."""

PER_RANK_ONLY_AT_ITS_WORLD = ("each rank's own state (its parameters differ from the others') loads onto the world size "
                              "it was saved at")
"""Why a ``per_rank`` mode's saved state does not load onto another world size (in the words
every refusal of it uses)."""

OPTIMIZER_ROLES: dict[str, str] = {
    "user": "it steps nothing itself: the user's torch optimizer, given beside it, steps (the reducers)",
    "self": "it is the optimizer (ZeroOptimizer)",
    "inner": "it wraps the torch optimizer it was built with, its .optimizer (LocalSGD, DiLoCo)",
    "own": "it steps optimizers of its own, kept in its state with the model's (gossip)",
}
"""Whose optimizer a mode steps."""


def _declared(mode: Any, what: str, allowed: dict[str, str]) -> str:
    value = getattr(_class(mode), what, "") if commit_style(mode) else ""
    if value not in allowed:
        raise TypeError(f"{type(mode).__name__} is not a fastreduce mode (it declares no {what}: one of "
                        f"{sorted(allowed)})")
    return value


def state_scope(mode: Any) -> str:
    """Where ``mode``'s state (a mode's, or its class's) lives: a key of :data:`STATE_SCOPES`
    (``TypeError``: not a mode)."""
    return _declared(mode, "state_scope", STATE_SCOPES)


def optimizer_role(mode: Any) -> str:
    """Whose optimizer ``mode`` (a mode, or its class) steps: a key of :data:`OPTIMIZER_ROLES`
    (``TypeError``: not a mode)."""
    return _declared(mode, "optimizer_role", OPTIMIZER_ROLES)


def mode_name(mode: Any) -> str:
    """``mode``'s name, as checkpoints record it (``TypeError``: not a mode)."""
    if not commit_style(mode):
        raise TypeError(f"{type(mode).__name__} is not a fastreduce mode")
    return str(mode.mode_name)


def wait_seconds(mode: Any) -> float | None:
    """Seconds ``mode``'s rank has waited on its collectives since it was built (its figures,
    ``stats.wait_seconds``), or ``None`` where it keeps none."""
    stats = getattr(mode, "stats", None)
    return None if stats is None else float(stats.wait_seconds)


def leaving_now(mode: Any, asked: list[int], world: int) -> list[int]:
    """Of the ranks of ``world`` that asked to leave at one poll (``asked``, in rank order), those
    that leave at it: all of them, unless ``mode``'s state is ``sharded`` (or none stays: the job
    ends); then each one in turn whose going, with the ones taken before it, leaves every shard
    a holder among the ranks that stay (the mode's ``kept_without``). The others stay asked and
    leave at a later poll, once the next epoch has placed the copies again (a ZeRO shard and
    its only copy, asked away together, go one poll apart)."""
    if mode is None or state_scope(mode) != "sharded" or len(set(asked)) >= world:
        return list(asked)
    out: list[int] = []
    for r in asked:
        if mode.kept_without({*out, r}):
            out.append(r)
    return out


def membership_settings(mode: Any) -> dict[str, Any]:
    """The settings ``mode`` (a mode, or its class) must have under a Membership, as its class
    declares them (``membership_settings``; none declared: none needed)."""
    if not commit_style(mode):
        raise TypeError(f"{_class(mode).__name__} is not a fastreduce mode")
    return dict(getattr(_class(mode), "membership_settings", {}))


def meets(have: Any, want: Any) -> bool:
    """Whether a setting's value ``have`` is what a Membership needs (``want``, from
    ``membership_settings``): equal, or where ``True`` is needed any count of at least 1
    (ZeRO's ``redundant=k``: k copies of each shard)."""
    if want is True and isinstance(have, int) and not isinstance(have, bool):
        return have >= 1
    return have == want


def check_membership(mode: Any) -> None:
    """Refuse, on every member alike, a mode (built) that a Membership cannot keep training:
    not a mode, a setting its class requires under one (``membership_settings``) set otherwise,
    or a reason of its own (``membership_refusal``)."""
    if not commit_style(mode):
        raise TypeError(f"fastreduce.Membership runs the fused, overlapped, ZeRO, gossip, LocalSGD and DiLoCo modes, "
                        f"not {type(mode).__name__}")
    for key, want in membership_settings(mode).items():
        if not meets(getattr(mode, key), want):
            raise ValueError(f"{type(mode).__name__} under fastreduce.Membership needs {key}={want!r}: "
                             f"{getattr(_class(mode), 'membership_why', '')}")
    refusal = getattr(mode, "membership_refusal", None)
    if refusal:
        raise ValueError(f"{refusal} under fastreduce.Membership")


def settings_refusal(mode: Any, settings: dict[str, Any]) -> str | None:
    """Why a Membership cannot run ``mode`` (a mode's class) with ``settings``, before it is
    built (a trainer's check at construction), as its class says (``membership_refusal_for``);
    ``None``: nothing its class can tell yet."""
    tell = getattr(_class(mode), "membership_refusal_for", None)
    return tell(settings) if tell is not None else None
