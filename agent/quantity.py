"""Kubernetes quantities (``resource.Quantity``) as exact fractions, and back to strings.

Neutral: publishing validates capacities and request policies with it, prepare turns a
share's consumed capacity into numbers for the container's environment.

The syntax is the API server's (ASCII digits, an optional point, one suffix: ``Ki``..``Ei``,
``n``..``E`` or ``e<exponent>``), and so is the rounding: a non-zero value is rounded up, away
from zero, to a multiple of 1n. The text is at most ``QUANTITY_MAX_CHARS`` long and the value
at most ``QUANTITY_MAX`` in magnitude (agent/apilimits.py). Both are checked on the digits'
positions before any power of ten is taken, so an exponent of any length costs as little as
a short one: a quantity is input from claims, the config file and the checkpoint.
"""

from __future__ import annotations

import re
from fractions import Fraction

from agent.apilimits import QUANTITY_DECIMALS, QUANTITY_MAX, QUANTITY_MAX_CHARS

_QUANTITY = re.compile(r"([+-]?)([0-9]+\.?[0-9]*|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?")
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}  # powers of two
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_NANO = 10**QUANTITY_DECIMALS
# the power of ten of the most significant digit beyond which a value exceeds QUANTITY_MAX
# whatever its digits; below it, the exact value is cheap (at most 2**60 more for Ei)
_TOP = len(str(QUANTITY_MAX)) - 1


class QuantityError(ValueError):
    """Not a quantity, or one beyond the bounds; the message says which."""


def _exponent(suffix: str) -> int:
    """The power of ten of a decimal suffix (``e<n>`` or an SI letter)."""
    return _DECIMAL[suffix] if suffix in _DECIMAL else int(suffix[1:])


def parse_quantity(text: str) -> Fraction:
    """Value of a Kubernetes quantity string; QuantityError (a ValueError) when the syntax
    is wrong or the value is out of bounds."""
    if not isinstance(text, str):
        raise QuantityError(f"not a quantity: {type(text).__name__} is not a string")
    if len(text) > QUANTITY_MAX_CHARS:
        raise QuantityError(f"not a quantity of at most {QUANTITY_MAX_CHARS} characters: {text[:QUANTITY_MAX_CHARS]!r}...")
    m = _QUANTITY.fullmatch(text)
    if m is None:
        raise QuantityError(f"not a quantity: {text!r}")
    sign, number, suffix = m.group(1), m.group(2), m.group(3) or ""
    whole, _, frac = number.partition(".")
    digits = (whole + frac).lstrip("0")
    if not digits:
        return Fraction(0)
    binary = _BINARY.get(suffix, 0)
    exponent = 0 if binary else _exponent(suffix)
    # the power of ten of the most significant digit: len(digits) counts from it to the last one
    top = exponent - len(frac) + len(digits) - 1
    if top > _TOP:
        raise QuantityError(f"{text!r} is larger than {QUANTITY_MAX}")
    if top < -QUANTITY_DECIMALS:  # below 1n: the API server rounds it up to 1n
        value = Fraction(1, _NANO)
    else:
        value = Fraction(int(digits) * 2**binary) * Fraction(10) ** (exponent - len(frac))
        scaled = value * _NANO
        if scaled.denominator != 1:
            value = Fraction(-(-scaled.numerator // scaled.denominator), _NANO)
    if value > QUANTITY_MAX:
        raise QuantityError(f"{text!r} is larger than {QUANTITY_MAX}")
    return -value if sign == "-" else value


def plain(value: Fraction) -> str:
    """An exact decimal string of ``value`` (integer, or with the fewest decimals it needs);
    a value finer than 1n is rounded up to it, as parse_quantity returns every value."""
    if value.denominator == 1:
        return str(value.numerator)
    scaled = value * _NANO
    nanos = -(-abs(scaled.numerator) // scaled.denominator)
    whole, frac = divmod(nanos, _NANO)
    sign = "-" if value < 0 else ""
    return f"{sign}{whole}.{str(frac).rjust(QUANTITY_DECIMALS, '0').rstrip('0')}" if frac else f"{sign}{whole}"
