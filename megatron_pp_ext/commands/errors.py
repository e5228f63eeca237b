"""The one error type commands raise for bad input: it names the flag to change."""

from __future__ import annotations


class UsageError(Exception):
    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag

    def __str__(self) -> str:
        return f"{self.flag}: {self.args[0]}"
