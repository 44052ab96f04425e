"""A Hypothesis strategy for files the agent wrote and reads back, damaged: bytes flipped, the
file cut short, tokens of the format put in or in place of bytes, a line given again elsewhere."""

from __future__ import annotations

from hypothesis import strategies as st

HOWS = ("flip", "cut", "insert", "replace", "repeat")


@st.composite
def damaged(draw, valid: bytes, tokens: list[bytes], hows: tuple[str, ...] = HOWS) -> bytes:
    """``valid`` with one to three of ``hows`` done at offsets drawn; ``tokens``: what goes in."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        how = draw(st.sampled_from(hows))
        if how == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif how == "cut":
            del data[at:]
        elif how == "insert":
            data[at:at] = draw(st.sampled_from(tokens))
        elif how == "replace":
            data[at:at + draw(st.integers(1, 12))] = draw(st.sampled_from(tokens))
        elif how == "repeat":
            lines = bytes(data).splitlines(keepends=True) or [b""]
            data[at:at] = draw(st.sampled_from(lines))
    return bytes(data)
