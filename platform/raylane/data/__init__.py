"""Datasets: preparation to Parquet (built-in sources, the user's text and JSONL files as token
windows and their CSV and Parquet tables as feature rows), checks, digests, and Ray Data
loading."""

from raylane.data.errors import DataError
from raylane.data.parquet import check_parquet, dataset_digest, ensure_dataset
from raylane.data.prepare import prepare_digits

__all__ = ["DataError", "check_parquet", "dataset_digest", "ensure_dataset", "prepare_digits"]
