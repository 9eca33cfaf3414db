"""One root exception; the CLI turns each into one line and an exit code."""

from __future__ import annotations


class AutotuneError(Exception):
    """Root of every error autotune reports to the user."""

    exit_code = 2


class UsageError(AutotuneError):
    """Bad arguments, a bad path or a bad config file."""


class UnparseableScript(AutotuneError):
    """A source file that is not valid Python."""

    def __init__(self, path: str, line: int, col: int, msg: str) -> None:
        super().__init__(f"{path}:{line}:{col}: {msg}")
        self.path, self.line, self.col, self.msg = path, line, col, msg


class NoTrainingLoop(AutotuneError):
    """A script in which no training loop could be found."""
