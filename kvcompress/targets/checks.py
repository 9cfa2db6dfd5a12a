"""The checks one export ran, in order: the manifest records exactly these (passed, failed, or skipped with the reason)."""
from __future__ import annotations


class Checks:
    """The checks that ran in this export, in order; the manifest records exactly these."""

    def __init__(self):
        self.rows: list[dict] = []

    def add(self, name: str, passed: bool, detail) -> bool:
        self.rows.append({"check": name, "status": "passed" if passed else "failed", "detail": detail})
        return passed

    def skip(self, name: str, why: str) -> None:
        self.rows.append({"check": name, "status": "skipped", "detail": {"skipped": why}})
