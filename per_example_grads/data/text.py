"""Generated text for the language-model examples: short reviews, byte-level tokens.

Nothing is downloaded: ``reviews(n, seed)`` draws ``n`` one-sentence reviews
from a small grammar, each positive or negative with probability 1/2, and ``byte_tokens``
turns texts into token ids a KerasHub backbone with a vocabulary of 257 or
more takes (id 0 is padding; byte ``b`` is id ``b + 1``).

    >>> texts, labels = reviews(4, seed=0)
    >>> texts[3], labels.tolist()
    ('that phone was truly terrible overall.', [1, 1, 1, 0])
    >>> ids, mask = byte_tokens(["hi"], seq_len=4)
    >>> ids.tolist(), mask.tolist()
    ([[105, 106, 0, 0]], [[1, 1, 0, 0]])
"""

from __future__ import annotations

import numpy as np

PAD_ID = 0
VOCABULARY_SIZE = 257  # 256 bytes + padding

_SUBJECTS = ["the film", "this book", "the soup", "our hotel", "the concert", "that phone", "the game", "this course"]
_POSITIVE = ["wonderful", "great", "a delight", "lovely", "superb", "worth every minute", "excellent"]
_NEGATIVE = ["awful", "dull", "a waste of time", "terrible", "boring", "a letdown", "poor"]
_ADVERBS = ["", "really ", "truly ", "quite ", "simply "]
_ENDINGS = [".", "!", ", I think.", " overall."]


def reviews(n: int, seed: int = 0) -> tuple[list[str], np.ndarray]:
    """``n`` generated one-sentence reviews and their labels (``[n]`` int32: 1 positive, 0 negative)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative int; got {n!r}.")
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n).astype("int32")
    texts = []
    for label in labels:
        words = _POSITIVE if label else _NEGATIVE
        texts.append(f"{rng.choice(_SUBJECTS)} was {rng.choice(_ADVERBS)}{rng.choice(words)}{rng.choice(_ENDINGS)}")
    return texts, labels


def byte_tokens(texts: list[str], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, padding_mask)``, both ``[len(texts), seq_len]`` int32: UTF-8 bytes + 1, cut or padded with 0."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int; got {seq_len!r}.")
    ids = np.zeros((len(texts), seq_len), "int32")
    for i, text in enumerate(texts):
        row = np.frombuffer(text.encode("utf-8"), np.uint8)[:seq_len].astype("int32") + 1
        ids[i, : len(row)] = row
    return ids, (ids != PAD_ID).astype("int32")
