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
        delay = min(self.cap, self.initial * self.factor**self.attempt)
        self.attempt += 1
        return delay * (1 + self.jitter * (2 * self._rng.random() - 1))

    def reset(self) -> None:
        self.attempt = 0
