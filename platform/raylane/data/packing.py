"""Documents to training rows: split by document, tokenized, joined with the end-of-text token
and packed into non-overlapping windows of inputs with next-token labels.

A label is -100 (PyTorch's `ignore_index`, which `raylane.models.losses` keeps) where the token
it names is only read, not learnt: a prompt, a user or system turn, the chat template's text.
Windows without a single learnt label are left out (their loss would be 0/0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from raylane.data.corpus import Document
from raylane.data.errors import DataError
from raylane.data.tokenizer import Tokenizer

#: The label of a token the loss skips (PyTorch's `ignore_index`).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Packed:
    inputs: np.ndarray  # [N, T] int64 token ids
    labels: np.ndarray  # [N, T] int64 next-token ids, IGNORE_INDEX where not learnt
    tokens: int  # tokens in the split's stream (documents and end-of-text tokens)
    masked: int  # IGNORE_INDEX labels in the windows written
    unlearnt_windows: int  # windows left out: no learnt label at all


def windows(tokens: np.ndarray, context_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows of a 1-D stream: inputs `[N, T]` and the values one position
    later `[N, T]`; the tail too short for a window (plus its next value) is dropped."""
    count = max(0, (len(tokens) - 1) // context_length)
    span = tokens[: count * context_length + 1]
    inputs = span[:-1].reshape(count, context_length)
    following = span[1:].reshape(count, context_length)
    return inputs, following


def split_documents(
    documents: Sequence[Document], fraction: float, seed: int
) -> tuple[list[Document], list[Document]]:
    """`(train, validation)`: a seeded share `fraction` of the documents (at least one, at most
    all but one) held out, each split in corpus order."""
    if len(documents) < 2:
        origin = documents[0].origin if documents else "data.files"
        raise DataError(
            f"{origin}: the only document; train and validation are split by document, so "
            "data.files needs at least 2 (files, or JSONL rows)"
        )
    train, validation = split_indices(len(documents), fraction, seed)
    return [documents[i] for i in train], [documents[i] for i in validation]


def split_indices(count: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`(train, validation)` indices of `count` items (at least 2): a seeded permutation's
    share `fraction` held out (at least one, at most all but one), each split sorted."""
    order = np.random.default_rng(seed).permutation(count)
    held_out = min(count - 1, max(1, round(count * fraction)))
    return np.sort(order[held_out:]), np.sort(order[:held_out])


def token_stream(
    documents: Sequence[Document], tokenizer: Tokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """The documents' tokens, each document followed by the end-of-text token, and whether each
    token is learnt. Each piece is tokenized on its own, so a learnt piece's tokens are exactly
    its text's; only a chat template's pieces turn special-token text into special tokens, so
    the data's text cannot end a document or a turn where raylane does not."""
    encoded = {}
    if tokenizer.hf is not None:
        for template in (False, True):
            texts = [p.text for d in documents for p in d.pieces if p.template == template]
            encoded[template] = iter(tokenizer.encode_batch(texts, special_tokens=template))
    end = np.array([tokenizer.eot_id], dtype=np.int64)
    chunks: list[np.ndarray] = []
    learnt: list[bool] = []
    for document in documents:
        for piece in document.pieces:
            if tokenizer.hf is None:  # bytes: the text's UTF-8 bytes, as `encode_batch` gives
                chunks.append(np.frombuffer(piece.text.encode("utf-8"), dtype=np.uint8))
            else:
                chunks.append(np.asarray(next(encoded[piece.template]), dtype=np.int64))
            learnt.append(piece.learnt)
        chunks.append(end)
        learnt.append(document.ends_learnt)
    if not chunks:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    lengths = [len(chunk) for chunk in chunks]
    return np.concatenate(chunks).astype(np.int64), np.repeat(np.array(learnt), lengths)


def pack(documents: Sequence[Document], tokenizer: Tokenizer, context_length: int) -> Packed:
    """The documents' stream as windows of `context_length` inputs and next-token labels."""
    ids, learnt = token_stream(documents, tokenizer)
    inputs, targets = windows(ids, context_length)
    _, learns = windows(learnt, context_length)
    keep = learns.any(axis=1)
    labels = np.where(learns, targets, IGNORE_INDEX)[keep]
    return Packed(
        inputs=inputs[keep],
        labels=labels,
        tokens=len(ids),
        masked=int((labels == IGNORE_INDEX).sum()),
        unlearnt_windows=int((~keep).sum()),
    )
