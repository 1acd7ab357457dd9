"""The cost model's inputs (:mod:`fastreduce.plan`): each setting's physical range
(:data:`LIMITS`) and the units users state them in. Pure Python."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

__all__ = ["LIMITS", "MB", "Bounds", "parse_bytes", "parse_rate", "parse_seconds"]

MB = 2**20


@dataclass(frozen=True)
class Bounds:
    """A setting's physical range, both ends included (``above``: the low end excluded)."""

    what: str
    lo: float
    hi: float
    text: str  # the range as a user reads it
    whole: bool = False
    above: bool = False

    def check(self, value: object, shown: object = None) -> float:
        """``value``, or a ValueError naming the setting, the value (as ``shown``) and the range."""
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and \
            (value > self.lo if self.above else value >= self.lo) and value <= self.hi and \
            (not self.whole or float(value).is_integer())
        if not ok:
            raise ValueError(f"{self.what} must be {self.text}, got {value if shown is None else shown!r}")
        return value  # type: ignore[return-value]


LIMITS = {
    "params": Bounds("the parameter count", 1, 1e15, "1 to 1e15"),
    "ranks": Bounds("the world size", 1, 1_000_000, "a whole number of ranks from 1 to 1,000,000", whole=True),
    "ranks_per_host": Bounds("the ranks (GPUs) per host", 1, 1024, "a whole number from 1 to 1,024", whole=True),
    "rate": Bounds("a link's rate", 1e6, 1e14, "1mbit to 100tbit (1 Mbit/s to 100 Tbit/s)"),
    "latency": Bounds("a link's latency", 0.0, 1.0, "0 to 1s"),
    "mtu": Bounds("the MTU", 68, 65536, "a whole number of bytes from 68 (IPv4's smallest) to 65536 (a loopback's)",
                  whole=True),
    "backward_s": Bounds("the backward's time", 0.0, 86400.0, "above 0 and at most a day (86400 s)", above=True),
    "seconds": Bounds("a compute time", 0.0, 86400.0, "0 to a day (86400 s)"),
    "value_bytes": Bounds("the bytes of a value", 0.5, 8.0, "0.5 (int4) to 8 (fp64)"),
}
"""Each setting's physical range: what ``fastreduce plan`` and the classes here accept."""


# ============================================================== units

_RATE_UNITS = {"tbit": 1e12, "gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0,
               "tbps": 8e12, "gbps": 8e9, "mbps": 8e6, "kbps": 8e3, "bps": 8.0}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_SIZE_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _number_with_unit(text: str, units: dict[str, float], what: str, example: str, zero: bool = False) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if m and m.group(2) in units and (float(m.group(1)) > 0 or zero):
        return float(m.group(1)) * units[m.group(2)]
    raise ValueError(f"{what} must be a {'non-negative' if zero else 'positive'} number with a unit like {example}, got {text!r} "
                     f"(units: {', '.join(u for u in units if u)})")


def parse_rate(text: str) -> float:
    """A link rate in bits per second, in tc's units: ``100gbit``, ``1gbit``, ``100mbit``, ``10gbps`` (bytes)."""
    return _number_with_unit(text, _RATE_UNITS, "a link rate", "100gbit or 100mbit")


def parse_seconds(text: str) -> float:
    """``20us``, ``1.5ms``, ``2s`` -> seconds."""
    return _number_with_unit(text, _TIME_UNITS, "a time", "20us or 1.5ms", zero=True)


def parse_bytes(text: str | float) -> float:
    """A parameter count: ``7e9``, ``7b``, ``125m``, ``2.1M``."""
    return _number_with_unit(str(text), _SIZE_UNITS, "a parameter count", "7e9, 7b or 125m")
