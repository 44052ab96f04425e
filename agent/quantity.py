"""Kubernetes quantities (``resource.Quantity``) as exact fractions, and back to strings.

Neutral: publishing validates capacities and request policies with it, prepare turns a
share's consumed capacity into numbers for the container's environment."""

from __future__ import annotations

import re
from fractions import Fraction

_QUANTITY = re.compile(r"^([+-]?)(\d+\.?\d*|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(text: str) -> Fraction:
    """Value of a Kubernetes quantity string; ValueError when the syntax is wrong."""
    m = _QUANTITY.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"not a quantity: {text!r}")
    sign, number, suffix = m.group(1), m.group(2), m.group(3) or ""
    value = Fraction(number)
    if suffix in _BINARY:
        value *= _BINARY[suffix]
    elif suffix in _DECIMAL:
        value *= Fraction(10) ** _DECIMAL[suffix]
    else:  # decimal exponent, e.g. 1e3
        value *= Fraction(10) ** int(suffix[1:])
    return -value if sign == "-" else value


def plain(value: Fraction) -> str:
    """An exact decimal string of ``value`` (integer, or with the fewest decimals it needs)."""
    if value.denominator == 1:
        return str(value.numerator)
    for digits in range(1, 10):
        scaled = value * 10**digits
        if scaled.denominator == 1:
            sign = "-" if scaled < 0 else ""
            n = str(abs(scaled.numerator)).rjust(digits + 1, "0")
            return f"{sign}{n[:-digits]}.{n[-digits:]}"
    return f"{float(value):.9g}"
