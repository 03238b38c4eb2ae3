"""A spinner for the long steps of a command (Ray start, data preparation, model logging,
replica start-up), on the console raylane's log lines go to.

Library code calls `long_step(...)` without knowing who prints: under the CLI the "raylane"
logger writes through rich, and the spinner shares its console; anywhere else (a Ray job's
log, a test, a non-terminal) it is silent and the step runs unchanged.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from rich.console import Console
from rich.logging import RichHandler


def _console() -> Console | None:
    for handler in logging.getLogger("raylane").handlers:
        if isinstance(handler, RichHandler) and handler.console.is_terminal:
            return handler.console
    return None


@contextlib.contextmanager
def long_step(message: str) -> Iterator[None]:
    """Show `message` with a spinner while the block runs (terminals only)."""
    console = _console()
    if console is None:
        yield
        return
    with console.status(message, spinner="dots"):
        yield
