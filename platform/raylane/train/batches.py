"""Turn a worker's Ray Data shard into torch batches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from raylane.data.parquet import as_matrix


def iter_torch_batches(
    shard,
    *,
    batch_size: int,
    features_column: str,
    label_column: str,
    shuffle_seed: int | None = None,
    drop_last: bool = False,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield `(features float32 [B, F], labels int64 [B])` from a `DataIterator` shard.

    With `shuffle_seed` set, rows are shuffled through a local buffer seeded by it, so a run
    is repeatable.
    """
    batches = shard.iter_batches(
        batch_size=batch_size,
        batch_format="numpy",
        prefetch_batches=2,
        drop_last=drop_last,
        local_shuffle_buffer_size=None if shuffle_seed is None else 4 * batch_size,
        local_shuffle_seed=shuffle_seed,
    )
    for batch in batches:
        # Copies: batches may be read-only views of Ray's object store.
        features = torch.from_numpy(as_matrix(batch[features_column]).copy())
        labels = batch[label_column]
        labels = as_matrix(labels) if labels.ndim > 1 or labels.dtype == object else labels
        labels = torch.from_numpy(np.array(labels, dtype=np.int64))
        yield features, labels
