"""Errors users see. Each names where the problem is, so the CLI can print it and exit non-zero."""

from __future__ import annotations


class SlmsqlError(Exception):
    """A problem with the user's input or environment; the CLI prints it without a traceback."""


class DataError(SlmsqlError):
    """Bad input data, located by file, line and field where known."""

    def __init__(self, message: str, path=None, line: int | None = None, field: str | None = None):
        self.path, self.line, self.field = path, line, field
        where = ":".join(str(x) for x in (path, line) if x is not None)
        loc = f"{where}: " if where else ""
        fld = f"field '{field}': " if field else ""
        super().__init__(f"{loc}{fld}{message}")
