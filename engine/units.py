"""Byte sizes as users write them: `0`, `123456`, `512MiB`, `4GiB`, `1.5GB`."""

import re

from .errors import UserError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a size; raises UserError naming the accepted forms."""
    if isinstance(text, int):
        if text < 0:
            raise UserError(f"size must not be negative: {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise UserError(f"cannot read size {text!r}: use bytes or a unit like 512MiB, 4GiB, 1.5GB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: int | float) -> str:
    """Human-readable binary size, e.g. 1.50 GiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_rate(per_second: float) -> str:
    """A speed in words: two significant figures, never an exponent (`0.9`, `12`, `27,000`)."""
    if per_second >= 10:
        return f"{float(f'{per_second:.2g}'):,.0f}"
    return f"{per_second:.2g}"
