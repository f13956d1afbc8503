"""The one configuration pattern every script uses: argparse defaults that work, `--preset NAME`
applied with `parser.set_defaults(**PRESETS[NAME])` so that flags given on the command line win,
and the resolved configuration written next to the outputs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from srt.data_io import write_json


def parse_config(parser: argparse.ArgumentParser, presets: dict, argv=None) -> argparse.Namespace:
    """Parse `argv` with `--preset` applied: argparse default < preset < explicit flag."""
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
    return parser.parse_args(argv)


def require(condition: bool, message: str) -> None:
    """A one-line error for a bad flag value, before any work is done."""
    if not condition:
        sys.exit(f"error: {message}")


def write_config(out, config) -> Path:
    """<out>/config.json: the resolved configuration of this run (argparse.Namespace or dict)."""
    path = Path(out) / "config.json"
    write_json(path, dict(vars(config)) if isinstance(config, argparse.Namespace) else dict(config))
    return path
