"""The one configuration pattern every script uses: argparse defaults that work, `--preset NAME`
applied with `parser.set_defaults(**PRESETS[NAME])` so that flags given on the command line win,
every numeric flag checked against its range, and the resolved configuration written next to the
outputs.

A numeric flag takes its range as its argparse `type`: `type=at_least(1)`, `type=positive(float)`,
`type=in_range(0.0, 1.0)`. argparse then rejects a bad value with one line that names the flag
(`error: argument --lr: must be > 0, got -1.0`), and `parse_config` applies the same check to the
values a preset sets, which argparse never converts.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from srt.data_io import write_json


class Bounded:
    """An argparse `type`: parse with `kind`, then require low <= value (or low < value when
    `strict`) and value <= high. A non-finite float (nan, inf) is always refused."""

    def __init__(self, kind=int, low=None, high=None, strict=False):
        self.kind, self.low, self.high, self.strict = kind, low, high, strict
        self.__name__ = kind.__name__  # argparse names the type in its "invalid int value" message

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in [{self.low}, {self.high}]"
        if self.low is not None:
            return f"> {self.low}" if self.strict else f">= {self.low}"
        return f"<= {self.high}"

    def check(self, value):
        if self.kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
        too_low = self.low is not None and (value <= self.low if self.strict else value < self.low)
        too_high = self.high is not None and value > self.high
        if too_low or too_high:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {value}")
        return value

    def __call__(self, text: str):
        return self.check(self.kind(text))


def at_least(low, kind=int) -> Bounded:
    return Bounded(kind, low=low)


def positive(kind=float) -> Bounded:
    return Bounded(kind, low=0, strict=True)


def in_range(low, high, kind=float) -> Bounded:
    return Bounded(kind, low=low, high=high)


def parse_config(parser: argparse.ArgumentParser, presets: dict, argv=None) -> argparse.Namespace:
    """Parse `argv` with `--preset` applied: argparse default < preset < explicit flag. Every
    bounded flag's final value is checked, a preset's included."""
    parser.add_argument(
        "--preset",
        choices=sorted(presets),
        help="a named set of defaults (explicit flags win): " + ", ".join(sorted(presets)),
    )
    known, _ = parser.parse_known_args(argv)
    if known.preset:
        dests = {action.dest for action in parser._actions}
        unknown = sorted(set(presets[known.preset]) - dests)
        if unknown:  # a typo in a preset would otherwise be silently ignored
            raise ValueError(f"preset {known.preset!r} sets unknown options {unknown}")
        parser.set_defaults(**presets[known.preset])
    config = parser.parse_args(argv)
    for action in parser._actions:
        value = getattr(config, action.dest, None)
        if isinstance(action.type, Bounded) and value is not None:
            try:
                action.type.check(value)
            except argparse.ArgumentTypeError as e:
                parser.error(f"argument {'/'.join(action.option_strings)}: {e}")
    return config


def require(condition: bool, message: str) -> None:
    """A one-line error for a bad combination of flags, before any work is done."""
    if not condition:
        sys.exit(f"error: {message}")


def write_config(out, config) -> Path:
    """<out>/config.json: the resolved configuration of this run (argparse.Namespace or dict)."""
    path = Path(out) / "config.json"
    write_json(path, dict(vars(config)) if isinstance(config, argparse.Namespace) else dict(config))
    return path
