"""Datasets: Fashion-MNIST offline from Debian's IDX files (else TFDS), scikit-learn digits, and
TFDS names. The original training split is carved, deterministically, into validation, public
and private training parts that are disjoint by construction.

Guarantees of every loaded :class:`Dataset`: images are float32 ``(n, H, W, C)`` in ``[0, 1]``
(no normalisation), or, with ``dataset.features = 'scattering'``, each image's ScatterNet
features (dpbench.features: per example, data-independent, cached on disk); labels int32
``(n,)`` in ``[0, num_classes)``; all arrays read-only. Nothing ever falls back silently to a
different dataset.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Optional

import gin
import numpy as np

from dpbench import features as features_lib

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte.gz", "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz", "test_labels": "t10k-labels-idx1-ubyte.gz"}
DIGITS_TEST_SIZE = 297
DIGITS_TEST_SEED = 1234  # fixed, independent of split_seed: the digits test split never moves
_CACHE: dict = {}          # (name, data_dir) -> (train_x, train_y, test_x, test_y, num_classes)
_CARVED: dict = {}         # full load_dataset arguments -> Dataset (a few most recent)
_MAX_CARVED = 4


@dataclasses.dataclass(frozen=True)
class Split:
    """One split: ``images`` float32 (n, H, W, C) in [0, 1]; ``labels`` int32 (n,)."""

    images: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclasses.dataclass(frozen=True)
class Dataset:
    """The splits of one dataset. ``train`` is the PRIVATE set DP training samples from
    (N = len(train)); ``validation`` and ``public`` (None when public_size == 0) are carved
    from the original training split. ``*_indices`` index the original training split, are
    pairwise disjoint and together cover it (``public_indices`` is empty when public is None).
    ``features`` describes what an example is: ``{"kind": "pixels"}`` or the transform's
    parameters (``features.Scattering.describe``).
    """

    name: str
    train: Split
    validation: Split
    test: Split
    public: Optional[Split]
    num_classes: int
    train_indices: np.ndarray
    validation_indices: np.ndarray
    public_indices: np.ndarray
    features: dict = dataclasses.field(default_factory=lambda: dict(kind="pixels"))

    @property
    def input_shape(self) -> tuple:
        """(H, W, C) of one example."""
        return tuple(self.train.images.shape[1:])


def _frozen(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def read_idx_gz(path: Path, expected_ndim: int) -> np.ndarray:
    """Parses one gzipped unsigned-byte IDX file (magic 0x0000 08 <ndim>, big-endian uint32
    dims, then the data). Raises ValueError naming ``path`` if the gzip stream is corrupt or
    truncated, the magic number is wrong, or the data size disagrees with the header."""
    fix = "reinstall with `apt-get install --reinstall -y dataset-fashion-mnist`"
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path} is corrupt or truncated ({e}); {fix}") from e
    magic = bytes([0, 0, 0x08, expected_ndim])
    if raw[:4] != magic:
        raise ValueError(f"{path} has bad magic number {raw[:4].hex()} (expected "
                         f"{magic.hex()}); {fix}")
    header = 4 + 4 * expected_ndim
    if len(raw) < header:
        raise ValueError(f"{path} is truncated inside its header; {fix}")
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(expected_ndim)]
    if len(raw) != header + int(np.prod(dims)):
        raise ValueError(f"{path} is truncated or padded: header says {dims} "
                         f"({int(np.prod(dims))} bytes) but it holds {len(raw) - header}; {fix}")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)


def _to_unit_images(array: np.ndarray) -> np.ndarray:
    """uint8 (n, H, W[, C]) -> float32 (n, H, W, C) in [0, 1]."""
    images = np.multiply(array, np.float32(1 / 255), dtype=np.float32)
    return images[..., None] if images.ndim == 3 else images


def _load_fashion_mnist_idx(data_dir: Path):
    """Reads the four IDX files; checks 28x28 images, matching counts and labels 0..9."""
    a = {k: read_idx_gz(data_dir / f, 3 if k.endswith("images") else 1)
         for k, f in FASHION_MNIST_FILES.items()}
    for part in ("train", "test"):
        images, labels = a[f"{part}_images"], a[f"{part}_labels"]
        img_file = data_dir / FASHION_MNIST_FILES[f"{part}_images"]
        lab_file = data_dir / FASHION_MNIST_FILES[f"{part}_labels"]
        if images.shape[1:] != (28, 28):
            raise ValueError(f"{img_file} holds {images.shape[1:]} images, expected 28x28")
        if len(images) != len(labels):
            raise ValueError(f"{img_file} has {len(images)} images but {lab_file} has "
                             f"{len(labels)} labels")
        if labels.size and labels.max() > 9:
            raise ValueError(f"{lab_file} has label {labels.max()}, expected 0..9")
    return (_to_unit_images(a["train_images"]), a["train_labels"].astype(np.int32),
            _to_unit_images(a["test_images"]), a["test_labels"].astype(np.int32), 10)


def _load_via_tfds(name: str, data_dir: Optional[str] = None):
    """Loads (train_x, train_y, test_x, test_y, num_classes) through TFDS's array-record
    ``data_source`` from ``data_dir`` (None: TFDS's default, ``~/tensorflow_datasets`` or
    ``$TFDS_DATA_DIR``). Reading needs no TensorFlow; the first use of a name downloads and
    prepares it there with TFDS's own builder, which needs network access and TensorFlow
    (``tf.io.gfile``, ``tf.image.encode_png``; a dependency, the CPU-only wheel on Linux)."""
    import tensorflow_datasets as tfds  # imported lazily: slow, and not needed offline

    out = []
    for split in ("train", "test"):
        # file_format explicitly: with a data_dir TFDS would otherwise prepare TFRecord files,
        # which its data_source then refuses to read (no random access)
        source = tfds.data_source(name, split=split, data_dir=data_dir, download=True,
                                  builder_kwargs={"file_format": "array_record"})
        examples = [source[i] for i in range(len(source))]
        out.append(_to_unit_images(np.stack([np.asarray(ex["image"]) for ex in examples])))
        out.append(np.asarray([ex["label"] for ex in examples], np.int32))
    try:
        num_classes = int(tfds.builder(name, data_dir=data_dir).info
                          .features["label"].num_classes)
    except Exception:  # noqa: BLE001 (metadata only; the labels themselves are authoritative)
        num_classes = int(max(out[1].max(), out[3].max())) + 1
    return (*out, num_classes)


def _load_digits():
    """scikit-learn digits (values 0..16 -> [0, 1]) with a fixed 297-example test split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images.astype(np.float32) / np.float32(16.0))[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(DIGITS_TEST_SEED).permutation(len(labels))
    test, train = order[:DIGITS_TEST_SIZE], order[DIGITS_TEST_SIZE:]
    return images[train], labels[train], images[test], labels[test], 10


def _load_fashion_mnist(data_dir: Optional[str]):
    """Debian's IDX files (``dataset-fashion-mnist``) in ``data_dir``, else TFDS."""
    directory = Path(data_dir or FASHION_MNIST_DIR)
    if all((directory / f).exists() for f in FASHION_MNIST_FILES.values()):
        return _load_fashion_mnist_idx(directory)
    try:
        return _load_via_tfds("fashion_mnist")
    except Exception as e:  # noqa: BLE001 (any TFDS failure means: no data available)
        raise FileNotFoundError(
            f"Fashion-MNIST IDX files not found in {directory} and TFDS could not load "
            f"'fashion_mnist' ({type(e).__name__}: {e}). Run `apt-get install -y "
            "dataset-fashion-mnist` (puts the IDX files in /usr/share/datasets/"
            "fashion-mnist), or pass dataset.data_dir=... (a directory holding the four "
            "IDX .gz files), or let TFDS download 'fashion_mnist' on a machine with "
            "network access") from e


def _tfds_loader(name: str):
    def load(data_dir: Optional[str]):
        try:
            return _load_via_tfds(name, data_dir)
        except Exception as e:  # noqa: BLE001
            raise FileNotFoundError(
                f"could not load TFDS dataset '{name}' ({type(e).__name__}: {e}); TFDS needs "
                f"network access to download '{name}' once (or an already prepared TFDS "
                "data directory, dataset.data_dir=...)") from e
    return load


_LOADERS: dict = {}


def register_dataset(name: str, load) -> None:
    """Registers a dataset under ``name`` (``dataset.name = '<name>'``): ``load(data_dir)``
    returns (train_images, train_labels, test_images, test_labels, num_classes), images as
    float32 (N, H, W, C) in [0, 1] and labels as integers in [0, num_classes). A module of the
    user's own registers one the same way, imported by their gin file."""
    _LOADERS[name] = load


def dataset_loader(name: str):
    """The load function registered under ``name`` (KeyError if none)."""
    return _LOADERS[name]


def registered_datasets() -> tuple:
    return tuple(sorted(_LOADERS))


register_dataset("digits", lambda data_dir: _load_digits())
register_dataset("fashion_mnist", _load_fashion_mnist)
for _name in ("mnist", "cifar10", "svhn_cropped"):  # through TFDS, for users with network
    register_dataset(_name, _tfds_loader(_name))


def _load_raw(name: str, data_dir: Optional[str]):
    """Returns the ORIGINAL (train_x, train_y, test_x, test_y, num_classes) of ``name``, as its
    registered loader gives it, checked."""
    train_x, train_y, test_x, test_y, num_classes = _LOADERS[name](data_dir)
    for what, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim != 4 or x.dtype != np.float32 or len(x) != len(y) or y.ndim != 1 or \
                not np.issubdtype(y.dtype, np.integer) or (y.size and (
                    y.min() < 0 or y.max() >= num_classes)):
            raise ValueError(
                f"dataset {name!r}'s loader returned {what} images {x.shape} {x.dtype} and "
                f"labels {y.shape} {y.dtype}: it must give float32 (N, H, W, C) images and N "
                f"integer labels in [0, {num_classes})")
    return (np.asarray(train_x), np.asarray(train_y).astype(np.int32), np.asarray(test_x),
            np.asarray(test_y).astype(np.int32), int(num_classes))


def _featurized(name: str, raw: tuple, features: str, cache_dir: Optional[str]) -> tuple:
    """The raw (train_x, train_y, test_x, test_y, num_classes) with the images replaced by their
    features (from the disk cache when valid), and the features' description."""
    transform = features_lib.make_transform(features)
    if transform is None:
        return raw, dict(kind="pixels")
    train_x, train_y, test_x, test_y, num_classes = raw
    train_f, test_f = (features_lib.cached_features(x, dataset=name, split=split,
                                                    transform=transform, directory=cache_dir)
                       for x, split in ((train_x, "train"), (test_x, "test")))
    return (train_f, train_y, test_f, test_y, num_classes), transform.describe()


@gin.configurable("dataset", allowlist=["name", "data_dir", "validation_size", "public_size",
                                         "split_seed", "features", "feature_cache_dir"])
def load_dataset(name: str = gin.REQUIRED, data_dir: Optional[str] = None,
                 validation_size: int = 5000, public_size: int = 0,
                 split_seed: int = 0, features: str = "pixels",
                 feature_cache_dir: Optional[str] = None) -> Dataset:
    """Loads ``name`` and carves validation and public splits off its original training split.

    The original training indices are permuted with ``np.random.default_rng(split_seed)``: the
    first ``validation_size`` go to validation, the next ``public_size`` to public, the rest
    are the private training set; the result is a deterministic function of the arguments.
    ``features`` other than 'pixels' replaces every image by its features (features.py; the
    original train and test splits are transformed, then carved, and cached on disk in
    ``feature_cache_dir``, default ``features.default_cache_dir()``).
    Parsed arrays are cached per (name, data_dir, features with their settings) and recent
    carvings per full argument set, so repeated loads in one process are (nearly) free; all
    arrays are read-only.
    Raises ValueError for an unknown name, features or bad sizes, FileNotFoundError if no data
    is found.
    """
    if name not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(registered_datasets())} "
                         "(set dataset.name; a dataset of your own registers itself with "
                         "dpbench.data.register_dataset, its module imported by your gin file)")
    for param, value in (("validation_size", validation_size), ("public_size", public_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"dataset.{param} must be an integer >= 0, got {value!r}")
    if name == "fashion_mnist":
        data_dir = os.path.abspath(os.fspath(data_dir or FASHION_MNIST_DIR))
    elif data_dir is not None:
        data_dir = os.fspath(data_dir)
    transform = features_lib.make_transform(features)  # an unknown name fails before loading
    # the in-process cache is keyed by the transform's settings (scattering.J, L, ...), not only
    # its name: loading again after a settings change must not reuse the old features
    settings = features if transform is None else json.dumps(transform.describe(),
                                                             sort_keys=True)
    key = (name, data_dir, settings, feature_cache_dir)
    full_key = (*key, int(validation_size), int(public_size), int(split_seed))
    if full_key in _CARVED:
        return _CARVED[full_key]
    if key not in _CACHE:
        raw = tuple(_frozen(a) if isinstance(a, np.ndarray) else a
                    for a in _load_raw(name, data_dir))
        _CACHE[key] = _featurized(name, raw, features, feature_cache_dir)
    (train_x, train_y, test_x, test_y, num_classes), described = _CACHE[key]
    n = len(train_y)
    if validation_size + public_size >= n:
        raise ValueError(f"dataset.validation_size ({validation_size}) + dataset.public_size "
                         f"({public_size}) must leave private training examples out of the "
                         f"{n} original training examples of {name!r}; lower them")
    order = _frozen(np.random.default_rng(split_seed).permutation(n))
    val_idx = order[:validation_size]
    pub_idx = order[validation_size:validation_size + public_size]
    train_idx = order[validation_size + public_size:]
    split = lambda idx: Split(_frozen(train_x[idx]), _frozen(train_y[idx]))  # noqa: E731
    dataset = Dataset(name=name, train=split(train_idx), validation=split(val_idx),
                      test=Split(test_x, test_y), public=split(pub_idx) if public_size else None,
                      num_classes=num_classes, train_indices=train_idx,
                      validation_indices=val_idx, public_indices=pub_idx, features=described)
    while len(_CARVED) >= _MAX_CARVED:
        _CARVED.pop(next(iter(_CARVED)))
    _CARVED[full_key] = dataset
    return dataset
