"""Byte units, at the edge only.

Everything inside vramcal counts integer bytes; names carry the unit (``peak_bytes``).
GiB (1024**3) and GB (1000**3) differ by 7.4 %, so both are shown side by side and never mixed.
"""

from __future__ import annotations

import re

KIB = 1024
MIB = 1024**2
GIB = 1024**3
GB = 1000**3

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGTP]?I?B?)?\s*$", re.IGNORECASE)
_FACTORS = {
    "": 1, "B": 1,
    "K": KIB, "KIB": KIB, "KB": 1000,
    "M": MIB, "MIB": MIB, "MB": 1000**2,
    "G": GIB, "GIB": GIB, "GB": GB,
    "T": 1024**4, "TIB": 1024**4, "TB": 1000**4,
    "P": 1024**5, "PIB": 1024**5, "PB": 1000**5,
}


def gib(n_bytes: int) -> float:
    return n_bytes / GIB


def gb(n_bytes: int) -> float:
    return n_bytes / GB


def fmt_gib_gb(n_bytes: int | None) -> str:
    """``12.60 GiB (13.53 GB)``; ``n/a`` for a value that could not be had."""
    if n_bytes is None:
        return "n/a"
    return f"{gib(n_bytes):.2f} GiB ({gb(n_bytes):.2f} GB)"


def parse_size(text: str) -> int:
    """Parse ``24GiB``, ``24 GB``, ``512MiB`` or a plain byte count into integer bytes.

    A bare ``G``/``M``/``K`` is binary (GiB, MiB, KiB), as nvidia-smi and torch report.
    """
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"cannot read size {text!r}: write it like 24GiB, 24GB or 25769803776")
    raw_unit = m.group(2) or ""
    if raw_unit.endswith("b") and len(raw_unit) == 2 and raw_unit[0].upper() in "KMGTP":
        # accelerate (and so transformers' max_memory) reads 24Gb as gigabits, 3 GB: never guess which
        raise ValueError(f"{text.strip()!r}: a lowercase b means bits to accelerate ({text.strip()} = "
                         f"{m.group(1)}/8 {raw_unit[0].upper()}B); write {m.group(1)}{raw_unit[0].upper()}B for "
                         f"bytes or {m.group(1)}{raw_unit[0].upper()}iB")
    unit = raw_unit.upper()
    if unit not in _FACTORS:
        raise ValueError(f"unknown unit in {text!r}: use B, KiB, MiB, GiB, TiB, PiB or KB, MB, GB, TB, PB")
    return int(float(m.group(1)) * _FACTORS[unit])


def size_option(text: str | None, flag: str, *, above_zero: bool = False) -> int | None:
    """A size given on the command line (``--budget 24GiB``) in bytes; None when the flag was not given.
    Bad input is one line that names the flag (:class:`~vramcal.errors.UserError`)."""
    from .errors import UserError

    if text is None:
        return None
    try:
        n = parse_size(text)
    except ValueError as exc:
        raise UserError(f"{flag}: {exc}") from None
    if above_zero and n <= 0:
        raise UserError(f"{flag} must be above zero, e.g. {flag} 80GiB")
    if n < 0:
        raise UserError(f"{flag} must not be negative")
    return n
