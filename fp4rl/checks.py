"""Checks of configuration values, each failing with fp4rl's one message shape:
``"<section>.<key> must be <what>, got <value!r>"``. Imports nothing from fp4rl, so every
config class (the tasks' included) can use it."""

from __future__ import annotations

import math


def integer(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def number(name: str, value, bound: str, ok) -> None:
    """A finite int or float for which ``ok(value)`` holds; ``bound`` says which in words."""
    real = isinstance(value, int | float) and not isinstance(value, bool)
    if not (real and math.isfinite(value) and ok(value)):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def boolean(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
