"""The small data the library ships or generates for demos: handwritten digits, and text.

``text.py`` generates short reviews as byte-level tokens (for the language
model examples); the rest of this module reads the bundled digits.

``digits.npz`` holds the 1,797 8x8 images of the UCI "Optical Recognition of
Handwritten Digits" test set, as distributed by scikit-learn. See
``README.md`` in this folder for the source, citation and licence.
"""

from __future__ import annotations

import importlib.resources
from typing import NamedTuple

import numpy as np

N_EXAMPLES = 1797
N_FEATURES = 64
N_CLASSES = 10

# Pixel values in the file are counts of set pixels in 4x4 blocks: 0..16.
_MAX_PIXEL = 16.0


class DigitsSplit(NamedTuple):
    """A train/test split of the digits.

    Attributes:
      x_train: ``[N_train, 64]`` float32 in ``[0, 1]``.
      y_train: ``[N_train]`` int32 in ``0..9``.
      x_test: ``[N_test, 64]`` float32 in ``[0, 1]``.
      y_test: ``[N_test]`` int32 in ``0..9``.
      train_index: ``[N_train]`` int64, rows of ``load_digits()`` in ``x_train``.
      test_index: ``[N_test]`` int64, rows of ``load_digits()`` in ``x_test``.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    train_index: np.ndarray
    test_index: np.ndarray


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits, flattened and scaled.

    Returns:
      ``(x, y)``: x is ``[1797, 64]`` float32 in ``[0, 1]`` (row-major 8x8
      pixels divided by 16); y is ``[1797]`` int32 labels in ``0..9``.
    """
    resource = importlib.resources.files(__name__).joinpath("digits.npz")
    with resource.open("rb") as f, np.load(f) as arrays:
        images = arrays["images"]
        labels = arrays["labels"]
    x = images.reshape(len(images), -1).astype(np.float32) / np.float32(_MAX_PIXEL)
    y = labels.astype(np.int32)
    return x, y


def train_test_split_digits(seed: int = 0, test_fraction: float = 0.2) -> DigitsSplit:
    """A reproducible random split of ``load_digits()``.

    Args:
      seed: seed of the permutation; the same seed gives the same split.
      test_fraction: share of examples in the test set, in ``(0, 1)``; the test
        set gets ``round(1797 * test_fraction)`` examples.

    Returns:
      A ``DigitsSplit``; with the defaults, 1,438 training and 359 test
      examples.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1); got {test_fraction}.")
    x, y = load_digits()
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    if not 0 < n_test < len(x):
        raise ValueError(f"test_fraction={test_fraction} leaves an empty train or test set.")
    test_index, train_index = np.sort(order[:n_test]), np.sort(order[n_test:])
    return DigitsSplit(
        x_train=x[train_index],
        y_train=y[train_index],
        x_test=x[test_index],
        y_test=y[test_index],
        train_index=train_index,
        test_index=test_index,
    )


def digits_as_images(size: int = 32, channels: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """The digits as ``[1797, size, size, channels]`` float32 images, for vision models.

    Each of the 8x8 pixels becomes a ``size/8 x size/8`` block (nearest
    neighbour), repeated over ``channels``; values in ``[0, 1]``. Labels as
    ``load_digits``.

    >>> x, y = digits_as_images(32)
    >>> x.shape, y.shape
    ((1797, 32, 32, 3), (1797,))
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 8 or size % 8:
        raise ValueError(f"size must be a positive multiple of 8; got {size!r}.")
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
        raise ValueError(f"channels must be a positive int; got {channels!r}.")
    x, y = load_digits()
    block = size // 8
    images = x.reshape(-1, 8, 8).repeat(block, axis=1).repeat(block, axis=2)
    return np.repeat(images[..., None], channels, axis=-1), y
