"""Operator tools around the agent: ``doctor``, ``record``, ``demo``."""
