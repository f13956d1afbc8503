"""Imported first by each script, above its other imports: a Ctrl-C while the script still loads
torch and transformers (seconds, on a busy CPU) ends it with one line and exit status 130, as a
Ctrl-C during its work does (config.interruptible), instead of the traceback of the import it
stopped. It acts only in a program started as one of the scripts (`python stage1_sft.py`,
torchrun's workers): importing a script from a test, a benchmark or a notebook changes nothing."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def started_script() -> Path | None:
    """The script this program was started as, when it is one of the project's; else None."""
    file = getattr(sys.modules.get("__main__"), "__file__", None)
    if file is None:
        return None
    path = Path(file).resolve()
    return path if path.parent == PROJECT else None


def stopped_while_loading(kind, value, tb, script: Path) -> bool:
    """Did a KeyboardInterrupt stop `script` in its own top-level code (its imports), not in a
    function it had begun (main, whose work has its own line)?"""
    if not issubclass(kind, KeyboardInterrupt):
        return False
    names = [
        frame.f_code.co_name
        for frame, _ in traceback.walk_tb(tb)
        if Path(frame.f_code.co_filename).resolve() == script
    ]
    return bool(names) and names[-1] == "<module>"


def install() -> None:
    script, previous = started_script(), sys.excepthook
    if script is None:
        return

    def hook(kind, value, tb):
        if not stopped_while_loading(kind, value, tb, script):
            return previous(kind, value, tb)
        sys.stdout.flush()
        print(
            f"\ninterrupted: {script.name} was still loading its libraries; it had done nothing",
            file=sys.stderr,
            flush=True,
        )
        os._exit(130)  # the status of every Ctrl-C of the scripts; after a flush, nothing is left to run

    sys.excepthook = hook


install()
