"""Capped exponential backoff with jitter, so many nodes retrying after an API outage
do not hit the API server in lockstep."""

from __future__ import annotations

import random


class Backoff:
    def __init__(self, initial: float = 0.2, cap: float = 30.0, factor: float = 2.0, jitter: float = 0.2, rng: random.Random | None = None):
        self.initial, self.cap, self.factor, self.jitter = initial, cap, factor, jitter
        self.attempt = 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        delay = min(self.cap, self.initial * self.factor ** min(self.attempt, 64))
        # bounded: past the cap the exponent only grows towards 2.0 ** 1024, an OverflowError
        # (after ~1000 failures in a row, some 8 hours at the cap) that would end the retries
        self.attempt = min(self.attempt + 1, 64)
        return delay * (1 + self.jitter * (2 * self._rng.random() - 1))

    def reset(self) -> None:
        self.attempt = 0
