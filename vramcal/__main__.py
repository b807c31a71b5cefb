"""``python -m vramcal``: the same command as ``vramcal``."""

from .cli import run

run()
