"""The environment of a subprocess a test starts: this checkout's package first on ``PYTHONPATH``."""

from __future__ import annotations

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def checkout_env(**extra: str) -> dict[str, str]:
    """``os.environ`` plus ``extra``, with the repository root first on ``PYTHONPATH`` (the package of
    this checkout, not whichever copy is installed)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **extra, "PYTHONPATH": path}
