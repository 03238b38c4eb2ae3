"""Turn a worker's Ray Data shard into torch batches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def _as_matrix(column: np.ndarray) -> np.ndarray:
    # A list column arrives either as a 2-D array (fixed-size lists) or as an object array of
    # 1-D arrays (variable-size lists that happen to share a length).
    if column.dtype == object:
        column = np.stack(column)
    return np.ascontiguousarray(column, dtype=np.float32)


def iter_torch_batches(
    shard,
    *,
    batch_size: int,
    features_column: str,
    label_column: str,
    shuffle_seed: int | None = None,
    device: torch.device | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield `(features float32 [B, F], labels int64 [B])` from a `DataIterator` shard.

    With `shuffle_seed` set, rows are shuffled through a local buffer seeded by it, so a run
    is repeatable.
    """
    batches = shard.iter_batches(
        batch_size=batch_size,
        batch_format="numpy",
        prefetch_batches=2,
        local_shuffle_buffer_size=None if shuffle_seed is None else 4 * batch_size,
        local_shuffle_seed=shuffle_seed,
    )
    for batch in batches:
        # Copies: batches may be read-only views of Ray's object store.
        features = torch.from_numpy(_as_matrix(batch[features_column]).copy())
        labels = torch.from_numpy(np.array(batch[label_column], dtype=np.int64))
        if device is not None and device.type != "cpu":
            features, labels = features.to(device), labels.to(device)
        yield features, labels
