"""Value constraints attached to schema fields with ``typing.Annotated``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ge:
    bound: float

    def check(self, value: float) -> str | None:
        return None if value >= self.bound else f"must be >= {self.bound}, got {value!r}"


@dataclass(frozen=True)
class Gt:
    bound: float

    def check(self, value: float) -> str | None:
        return None if value > self.bound else f"must be > {self.bound}, got {value!r}"


@dataclass(frozen=True)
class Le:
    bound: float

    def check(self, value: float) -> str | None:
        return None if value <= self.bound else f"must be <= {self.bound}, got {value!r}"
