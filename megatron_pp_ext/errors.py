"""The errors the commands and the training layer raise: bad input (exit 2, naming the flag to
change) and a job that failed while running (exit 1, saying what happened and how to resume).
A neutral module, below both: the training layer raises them without importing the commands."""

from __future__ import annotations


class UsageError(Exception):
    def __init__(self, flag: str, message: str, flag_in_message: bool = False) -> None:
        super().__init__(message)
        self.flag = flag
        self.flag_in_message = flag_in_message or flag in message

    def __str__(self) -> str:
        return self.args[0] if self.flag_in_message else f"{self.flag}: {self.args[0]}"


class JobError(Exception):
    """A job that started and failed (a rank died): one line, exit code 1."""
