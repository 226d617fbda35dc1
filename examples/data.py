"""Datasets that need no download: scikit-learn's digits, Debian's Fashion-MNIST, text files."""

from __future__ import annotations

import gzip
import os

import numpy as np

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


def digits(seed: int = 0, test_fraction: float = 0.2):
    """8x8 handwritten digits (1,797 images, bundled with scikit-learn), split train/test."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images / 16.0).astype(np.float32)[..., None]
    labels = bunch.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    split = int(len(labels) * (1 - test_fraction))
    train, test = order[:split], order[split:]
    return {"image": images[train], "label": labels[train]}, {"image": images[test], "label": labels[test]}


def _read_idx(path: str) -> np.ndarray:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as stream:
        data = stream.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find(directory: str, stem: str) -> str | None:
    for name in (stem, stem + ".gz"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    return None


def fashion_mnist(directory: str = FASHION_MNIST_DIR):
    """Fashion-MNIST (28x28, 60k/10k) from Debian's ``dataset-fashion-mnist`` package, or None."""
    stems = {
        "train_image": "train-images-idx3-ubyte", "train_label": "train-labels-idx1-ubyte",
        "test_image": "t10k-images-idx3-ubyte", "test_label": "t10k-labels-idx1-ubyte",
    }
    paths = {key: _find(directory, stem) for key, stem in stems.items()}
    if not all(paths.values()):
        return None
    arrays = {key: _read_idx(path) for key, path in paths.items()}
    train = {"image": (arrays["train_image"] / 255.0).astype(np.float32)[..., None],
             "label": arrays["train_label"].astype(np.int32)}
    test = {"image": (arrays["test_image"] / 255.0).astype(np.float32)[..., None],
            "label": arrays["test_label"].astype(np.int32)}
    return train, test


def default_text() -> str:
    """About 465k characters of English prose that ship with Python (pydoc's topic help)."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
