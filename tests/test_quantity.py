"""Quantities (agent/quantity.py) as the API server reads them, within bounds.

The syntax and rounding are the server's (k8s.io/apimachinery pkg/api/resource
ParseQuantity); the magnitude, the length and the work done on any text are bounded
(agent/apilimits.py), whatever the digits or the exponent: a quantity comes from claims,
the config file and the checkpoint."""

from __future__ import annotations

import tracemalloc
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.apilimits import QUANTITY_DECIMALS, QUANTITY_MAX, QUANTITY_MAX_CHARS
from agent.quantity import QuantityError, parse_quantity, plain

NANO = Fraction(1, 10**QUANTITY_DECIMALS)
# memory one parse may take at its peak: a few small ints and fractions; 10**9999999 alone
# takes 4 MB, and "1e" followed by 62 nines would never finish
PEAK_BYTES = 64 * 1024

ACCEPTED = {
    "0": 0, "1": 1, "+1": 1, "-1": -1, "1.": 1, ".5": Fraction(1, 2), "1.5Gi": 3 * 2**29,
    "100m": Fraction(1, 10), "5n": 5 * NANO, "7u": Fraction(7, 10**6), "1k": 1000, "2M": 2 * 10**6,
    "3G": 3 * 10**9, "4T": 4 * 10**12, "5P": 5 * 10**15, "1E": 10**18, "1Ki": 1024, "1Ei": 2**60,
    "1e3": 1000, "1E3": 1000, "1e+3": 1000, "15e-1": Fraction(3, 2), "1.5e-3": Fraction(3, 2000),
    "0e999999999999": 0, "000000000000000000000000000001": 1,
    str(QUANTITY_MAX): QUANTITY_MAX, "7Ei": 7 * 2**60,
    # the server rounds a non-zero value up, away from zero, to a multiple of 1n
    "0.0000000001": NANO, "-0.0000000001": -NANO, "1.0000000001": 1 + NANO, "1e-5000": NANO,
    "0." + "0" * 60 + "1": NANO,
}
REFUSED = [
    "", " 1", "1 ", "1\n", "1.2.3", "1K", "1e", "1Ki5", "1KiB", "0x10", "1_000", "inf", "nan", "1e+",
    "\u0663",  # ARABIC-INDIC DIGIT THREE: a digit to Python, not to the API server
    "1e5000", "1e9999999", "1e" + "9" * 62, "1" * 20, "8Ei", "9Ei", str(QUANTITY_MAX + 1), "10E",
    "1" * (QUANTITY_MAX_CHARS + 1), "0" * (QUANTITY_MAX_CHARS + 1), None, 1, 1.5, ["1"], {"value": "1"},
]


@pytest.mark.parametrize("text", ACCEPTED)
def test_the_api_servers_values(text):
    assert parse_quantity(text) == ACCEPTED[text]


@pytest.mark.parametrize("text", REFUSED, ids=repr)
def test_refused_with_the_reason(text):
    with pytest.raises(QuantityError) as err:
        parse_quantity(text)
    assert isinstance(err.value, ValueError) and ("not a quantity" in str(err.value) or "larger than" in str(err.value))


def within_memory(limit: int, fn, *args):
    """``fn(*args)``, failing when it needs more than ``limit`` bytes at its peak: a bound on
    the work that holds on any machine, unlike a clock."""
    tracemalloc.start()
    try:
        return fn(*args)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak <= limit, (args, peak)


def _parse_within_bounds(text: object) -> Fraction | None:
    """Parse ``text`` -> its value or None when refused; fails on any other exception and on
    a parse that needs more than PEAK_BYTES, and checks every bound of an accepted value."""
    try:
        value = within_memory(PEAK_BYTES, parse_quantity, text)
    except QuantityError:
        value = None
    if value is not None:
        assert isinstance(text, str) and len(text) <= QUANTITY_MAX_CHARS
        assert abs(value) <= QUANTITY_MAX and (value / NANO).denominator == 1, (text, value)
    return value


_digits = st.text("0123456789", max_size=40)
_suffix = st.one_of(st.sampled_from(["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E"]),
                    st.builds(lambda e, x: f"{e}{x:+d}" if x < 0 or x % 2 else f"{e}{x}",
                              st.sampled_from("eE"), st.integers(-10**62, 10**62)))
quantity_like = st.builds(lambda s, w, dot, f, x: f"{s}{w}{dot}{f}{x}", st.sampled_from(["", "+", "-"]), _digits,
                          st.sampled_from(["", "."]), _digits, _suffix)


@settings(max_examples=400, deadline=None)
@given(st.one_of(quantity_like, st.text(max_size=80)))
def test_any_text_is_a_bounded_value_or_the_quantity_error(text):
    value = _parse_within_bounds(text)
    if value is not None:  # the shortest exact form reads back as the same value
        assert parse_quantity(plain(value)) == value


@settings(max_examples=200, deadline=None)
@given(st.integers(-QUANTITY_MAX, QUANTITY_MAX), st.integers(0, QUANTITY_DECIMALS))
def test_every_value_within_the_bounds_is_accepted(n, decimals):
    value = Fraction(n, 10**decimals)
    assert parse_quantity(plain(value)) == value


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**40), st.integers(-60, 60), st.sampled_from(["", "-"]))
def test_beyond_the_maximum_is_refused_however_written(mantissa, exponent, sign):
    text = f"{sign}{mantissa}e{exponent}"
    value = Fraction(mantissa) * Fraction(10) ** exponent
    if len(text) <= QUANTITY_MAX_CHARS and value > QUANTITY_MAX:
        with pytest.raises(QuantityError, match="larger than"):
            parse_quantity(text)
