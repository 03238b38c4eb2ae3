"""The error every dataset check and preparation raises."""

from __future__ import annotations


class DataError(ValueError):
    """A dataset problem, worded as one line that names the file and the column."""
