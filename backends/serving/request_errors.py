"""The error a client's mistake raises while its request is read (request.py and the
structured-output parameters it reads through structured_params.py)."""

from __future__ import annotations

from typing import Any


class RequestError(ValueError):
    """A client mistake; the message names the input at fault."""


def shown(v: Any, limit: int = 80) -> str:
    """A value for an error message, cut short: a client's megabyte string is not echoed."""
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
