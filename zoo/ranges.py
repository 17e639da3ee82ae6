"""The range of every numeric config field, declared beside its dataclass and checked in one place.

A config dataclass is decorated with `@ranged("<key prefix>", field="<range>", ...)`; a range is an
interval in the usual notation, `[0, 1)`, `(0, inf)`, or values and intervals joined by `or`
(`-1 or [1, inf)`), optionally followed by `: <what a value means>` (`[0, inf): 0 disables`). Every
instance checks its fields against their ranges before its own `__post_init__` runs, so NaN, an
infinity or a value out of range is one `ConfigError` naming the key, `optimizer.b1: must be in
[0, 1), got 1.5; e.g. optimizer.b1=0.9`, wherever the config is built (the command line, YAML,
Python). A field left `None` (an Optional one) is not checked; `inf` is in a range only where the
range names it as a value. A field whose range has no finite top stops where the step's numbers do:
an int at `INT_MAX` (JAX holds counts, sizes and ids in 32-bit integers, so a larger one overflows inside
the jitted step, a step count in the optimizer's schedule, or asks for a run nobody can wait for:
`trainer.steps=1e20`), a float at `FLOAT32_MAX` (past it the step computes with inf: `optimizer.eps=1e300`
froze every weight). The rules between fields (`topk_group <= n_group`) stay in `__post_init__`.

This module is on the ground floor: it imports nothing of zoo but the errors.
"""

import dataclasses
import math
import re
import typing
from typing import Optional, Union

from zoo.errors import ConfigError

Number = Union[int, float]

# The largest value of a field whose range has no finite top: what a 32-bit integer holds, and float32's
# largest finite number (numpy.finfo(numpy.float32).max).
INT_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38

_INTERVAL = re.compile(r"^([\[(])\s*([^,\s]+)\s*,\s*([^\]\s)]+)\s*([\])])$")


def _number(text: str) -> float:
    """`1e-3`, `inf`, `-inf`, or a power `2**32`."""
    base, power, exponent = text.partition("**")
    return float(base) ** int(exponent) if power else float(text)


@dataclasses.dataclass(frozen=True)
class Interval:
    lo: float
    hi: float
    lo_closed: bool
    hi_closed: bool

    def __contains__(self, v: Number) -> bool:
        above = v >= self.lo if self.lo_closed else v > self.lo
        below = v <= self.hi if self.hi_closed else v < self.hi
        return above and below


@dataclasses.dataclass(frozen=True)
class Range:
    """Values and intervals a field may take; `text` is how messages write it, `note` what values mean."""

    text: str
    values: tuple[float, ...]
    intervals: tuple[Interval, ...]
    note: str = ""

    @classmethod
    def parse(cls, spec: str) -> "Range":
        text, _, note = spec.partition(":")
        values, intervals = [], []
        for part in text.split(" or "):
            part = part.strip()
            m = _INTERVAL.match(part)
            if m:
                lo, hi = _number(m.group(2)), _number(m.group(3))
                intervals.append(Interval(lo, hi, m.group(1) == "[", m.group(4) == "]"))
            else:
                values.append(_number(part))
        return cls(text.strip(), tuple(values), tuple(intervals), note.strip())

    def __contains__(self, v: object) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            return False
        return v in self.values or any(v in i for i in self.intervals)

    def describe(self) -> str:
        """'positive', '>= 0', or 'in [0, 1)', '-1 or in [1, inf)'."""
        if not self.values and len(self.intervals) == 1:
            i = self.intervals[0]
            if i.hi == math.inf and not i.hi_closed and i.lo == 0:
                return ">= 0" if i.lo_closed else "positive"
            if i.hi == math.inf and not i.hi_closed and i.lo_closed:
                return f">= {_show(i.lo)}"
        parts = [_show(v) for v in self.values] + [f"in {_interval_text(i)}" for i in self.intervals]
        return " or ".join(parts)

    def example(self) -> Optional[Number]:
        """A value inside the range (an out-of-range test and a message's fallback example)."""
        if self.values:
            v = self.values[0]
        else:
            i = self.intervals[0]
            v = i.lo if i.lo_closed else i.lo + 1 if i.hi > i.lo + 1 else (i.lo + i.hi) / 2
        return int(v) if float(v).is_integer() else v

    def bounded(self) -> bool:
        """Whether the range has a finite top (`[0, 2**32)`), not `inf` (`(0, inf)`)."""
        return all(math.isfinite(i.hi) for i in self.intervals)

    def outside(self) -> Number:
        """A finite value outside the range (tests feed it to every field)."""
        for i in self.intervals:
            for candidate in (i.lo if not i.lo_closed else i.lo - 1, i.hi if not i.hi_closed else i.hi + 1):
                if math.isfinite(candidate) and candidate not in self:
                    return int(candidate) if float(candidate).is_integer() else candidate
        return max(self.values) + 1


def _show(v: Number) -> str:
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def _interval_text(i: Interval) -> str:
    return f"{'[' if i.lo_closed else '('}{_show(i.lo)}, {_show(i.hi)}{']' if i.hi_closed else ')'}"


RANGES_ATTR = "__zoo_ranges__"
PREFIX_ATTR = "__zoo_key_prefix__"
CAPPED_ATTR = "__zoo_capped__"  # field -> INT_MAX or FLOAT32_MAX, for those whose range has no finite top


def ranges_of(cls) -> dict[str, Range]:
    """The declared ranges of a `ranged` dataclass (empty for any other class)."""
    return getattr(cls, RANGES_ATTR, {})


def check(obj) -> None:
    """ConfigError for the first field of `obj` outside its declared range."""
    prefix = getattr(type(obj), PREFIX_ATTR, "")
    for name, rng in ranges_of(type(obj)).items():
        value = getattr(obj, name)
        cap = getattr(type(obj), CAPPED_ATTR, {}).get(name)
        if value is None or (value in rng and not (cap is not None and abs(value) > cap)):
            continue
        key = f"{prefix}.{name}" if prefix else name
        default = _default(type(obj), name)
        example = default if default is not None and default in rng else rng.example()
        note = f" ({rng.note})" if rng.note else ""
        top = f" and at most {_CAP_TEXT[cap]}" if cap is not None and value in rng else ""
        raise ConfigError(f"{key}: must be {rng.describe()}{note}{top}, got {value!r}; e.g. {key}={example}")


_CAP_TEXT = {INT_MAX: f"{INT_MAX} (what a 32-bit integer holds)", FLOAT32_MAX: "3.4e38 (float32's largest)"}


def _cap(hint) -> Optional[Number]:
    """INT_MAX for `int` / `Optional[int]`, FLOAT32_MAX for `float` / `Optional[float]`, else None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is Union else [hint]
    return {int: INT_MAX, float: FLOAT32_MAX}.get(args[0]) if len(args) == 1 else None


def _default(cls, name: str):
    f = cls.__dataclass_fields__[name]
    return f.default if f.default is not dataclasses.MISSING else None


def ranged(prefix: str, **specs: str):
    """Class decorator: declare `cls`'s numeric fields' ranges (field=spec) under the key `prefix`
    (`optimizer`, `model.moe`), and check them before the class's own `__post_init__`."""

    def decorate(cls):
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(specs) - fields)
        if unknown:
            raise TypeError(f"{cls.__name__}: ranges for unknown fields {unknown}")
        ranges = {name: Range.parse(spec) for name, spec in specs.items()}
        hints = typing.get_type_hints(cls)
        setattr(cls, RANGES_ATTR, ranges)
        setattr(cls, PREFIX_ATTR, prefix)
        caps = {n: _cap(hints[n]) for n, r in ranges.items() if not r.bounded()}
        setattr(cls, CAPPED_ATTR, {n: cap for n, cap in caps.items() if cap is not None})
        own = cls.__dict__.get("__post_init__")
        if own is None:  # dataclass's __init__ calls __post_init__ only where the class defined one
            raise TypeError(f"{cls.__name__}: a ranged dataclass defines __post_init__ (`pass` will do)")

        def __post_init__(self):
            check(self)
            own(self)

        cls.__post_init__ = __post_init__
        return cls

    return decorate
