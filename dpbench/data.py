"""Datasets: Fashion-MNIST offline from Debian's IDX files (else TFDS), scikit-learn digits, and
TFDS names. The original training split is carved, deterministically, into validation, public
and private training parts that are disjoint by construction.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
from pathlib import Path
from typing import Optional

import gin
import numpy as np

KNOWN_DATASETS = ("fashion_mnist", "digits", "mnist", "cifar10", "svhn_cropped")
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte.gz", "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz", "test_labels": "t10k-labels-idx1-ubyte.gz"}
DIGITS_TEST_SIZE = 297
_CACHE: dict = {}


@dataclasses.dataclass(frozen=True)
class Split:
    images: np.ndarray  # float32 (n, H, W, C) in [0, 1]
    labels: np.ndarray  # int32 (n,)

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclasses.dataclass(frozen=True)
class Dataset:
    """The splits of one dataset. ``train`` is the PRIVATE set DP training samples from;
    ``validation`` and ``public`` are carved from the original training split and disjoint
    from it and from each other (indices into the original split are kept to prove it)."""

    name: str
    train: Split
    validation: Split
    test: Split
    public: Optional[Split]
    num_classes: int
    train_indices: np.ndarray
    validation_indices: np.ndarray
    public_indices: np.ndarray

    @property
    def input_shape(self) -> tuple:
        return tuple(self.train.images.shape[1:])


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def read_idx_gz(path: Path) -> np.ndarray:
    """Parses one gzipped IDX file (unsigned bytes); raises ValueError naming a bad file."""
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:
        raise ValueError(f"{path} is corrupt or truncated ({e}); reinstall it with "
                         "`apt-get install --reinstall -y dataset-fashion-mnist`") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file (bad magic number)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    if len(raw) != header + int(np.prod(dims)):
        raise ValueError(f"{path} is truncated: header says {dims} but it holds "
                         f"{len(raw) - header} bytes of data")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def _load_fashion_mnist_idx(data_dir: Path):
    arrays = {k: read_idx_gz(data_dir / name) for k, name in FASHION_MNIST_FILES.items()}
    to_images = lambda a: (a.astype(np.float32) / 255.0)[..., None]  # noqa: E731
    return (to_images(arrays["train_images"]), arrays["train_labels"].astype(np.int32),
            to_images(arrays["test_images"]), arrays["test_labels"].astype(np.int32), 10)


def _load_via_tfds(name: str):
    """Loads (train_x, train_y, test_x, test_y, classes) through TFDS (may download)."""
    import tensorflow_datasets as tfds  # imported lazily: slow, and not needed offline

    out = []
    for split in ("train", "test"):
        source = tfds.data_source(name, split=split, download=True)
        images = np.stack([np.asarray(ex["image"]) for ex in source])
        labels = np.asarray([ex["label"] for ex in source], np.int32)
        out += [(images.astype(np.float32) / 255.0), labels]
    return (*out, int(out[1].max()) + 1)


def _load_raw(name: str, data_dir: Optional[str]):
    if name == "fashion_mnist":
        directory = Path(data_dir or FASHION_MNIST_DIR)
        if all((directory / f).exists() for f in FASHION_MNIST_FILES.values()):
            return _load_fashion_mnist_idx(directory)
        try:
            return _load_via_tfds(name)
        except Exception as e:  # noqa: BLE001 (any TFDS failure means: files are missing)
            raise FileNotFoundError(
                f"Fashion-MNIST IDX files not found in {directory} and TFDS could not load "
                f"'fashion_mnist' ({type(e).__name__}: {e}). Run `apt-get install -y "
                "dataset-fashion-mnist` (puts them in /usr/share/datasets/fashion-mnist), or "
                "set dataset.data_dir to a directory holding the four IDX .gz files, or let "
                "TFDS download 'fashion_mnist' on a machine with network access") from e
    if name == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = (digits.images.astype(np.float32) / 16.0)[..., None]
        labels = digits.target.astype(np.int32)
        order = np.random.default_rng(1234).permutation(len(labels))
        test, train = order[:DIGITS_TEST_SIZE], order[DIGITS_TEST_SIZE:]
        return images[train], labels[train], images[test], labels[test], 10
    try:
        return _load_via_tfds(name)
    except Exception as e:  # noqa: BLE001
        raise FileNotFoundError(
            f"could not load TFDS dataset '{name}' ({type(e).__name__}: {e}); TFDS needs network "
            f"access to download '{name}' once (or a prepared TFDS data_dir)") from e


@gin.configurable("dataset")
def load_dataset(name: str = gin.REQUIRED, data_dir: Optional[str] = None,
                 validation_size: int = 5000, public_size: int = 0,
                 split_seed: int = 0) -> Dataset:
    """Loads ``name`` and carves validation and public splits off its training split.

    The original training indices are permuted with ``split_seed``: the first
    ``validation_size`` go to validation, the next ``public_size`` to public, the rest are the
    private training set. Never falls back to another dataset.
    """
    if name not in KNOWN_DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(KNOWN_DATASETS)} "
                         "(set dataset.name)")
    for param, value in (("validation_size", validation_size), ("public_size", public_size)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"dataset.{param} must be an integer >= 0, got {value!r}")
    key = (name, os.fspath(data_dir) if data_dir else None)
    if key not in _CACHE:
        _CACHE[key] = tuple(_frozen(a) if isinstance(a, np.ndarray) else a
                            for a in _load_raw(name, data_dir))
    train_x, train_y, test_x, test_y, num_classes = _CACHE[key]
    n = len(train_y)
    if validation_size + public_size >= n:
        raise ValueError(f"dataset.validation_size ({validation_size}) + dataset.public_size "
                         f"({public_size}) must leave private training examples out of {n}; "
                         "lower them")
    order = np.random.default_rng(split_seed).permutation(n)
    val_idx = order[:validation_size]
    pub_idx = order[validation_size:validation_size + public_size]
    train_idx = order[validation_size + public_size:]
    split = lambda idx: Split(_frozen(train_x[idx]), _frozen(train_y[idx]))  # noqa: E731
    return Dataset(name=name, train=split(train_idx), validation=split(val_idx),
                   test=Split(test_x, test_y), public=split(pub_idx) if public_size else None,
                   num_classes=num_classes, train_indices=train_idx,
                   validation_indices=val_idx, public_indices=pub_idx)
