"""Fixed feature transforms of the examples (ScatterNet features, Tramer & Boneh 2021), computed
once per dataset split, cached on disk and validated on every load.

Guarantee: the features of an example are a function of that example's pixels and of public
transform parameters only: each image is transformed alone, with filters that depend on no data
(no statistic of any split, no learned weight). Training on features therefore costs no privacy
beyond the run's own mechanisms, and the features of an example do not depend on what else is in
the dataset (tests/test_features.py checks it).

The cache is keyed by the dataset, the split, the transform's parameters, the library version and
a SHA-256 of the input pixels; a cache file whose metadata, shape or checksum does not match is
reported with its path and rebuilt, never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Optional

import gin
import numpy as np
import scipy.fft
from absl import logging

from dpbench import records

FEATURES = ("pixels", "scattering")
FORMAT_VERSION = 1  # bump when the stored layout changes: old caches then miss, never mislead


class CorruptCacheError(RuntimeError):
    """A feature cache file that cannot be used as it is (its message names the file)."""


def scattering_operator(J: int, shape: tuple, L: int):
    """kymatio's 2-D scattering on NumPy: the one place dpbench imports kymatio.

    The 2-D frontend module is imported directly: ``import kymatio.numpy`` also imports the 3-D
    frontend, which needs ``scipy.special.sph_harm``, removed in SciPy 1.15, and fails."""
    from kymatio.scattering2d.frontend.numpy_frontend import ScatteringNumPy2D

    return ScatteringNumPy2D(J=J, shape=tuple(shape), L=L)


@gin.configurable("scattering")
@dataclasses.dataclass(frozen=True)
class Scattering:
    """Wavelet scattering to order 2 (Bruna & Mallat; kymatio's Scattering2D): an (H, W, C)
    image becomes (H / 2^J, W / 2^J, C * (1 + J L + L^2 J (J - 1) / 2)) features, channels
    last; J=2, L=8 gives 81 channels per input channel (Tramer & Boneh's setting)."""

    J: int = 2
    L: int = 8
    chunk: int = 256  # images per kymatio call: a speed knob only (each image is alone)

    def __post_init__(self):
        for name in ("J", "L", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"scattering.{name} must be an integer >= 1, got {value!r}")

    def describe(self) -> dict:
        """The parameters that define the features (the cache key; the run record)."""
        return dict(kind="scattering", J=self.J, L=self.L, max_order=2,
                    library=f"kymatio {metadata.version('kymatio')}")

    def output_shape(self, input_shape: tuple) -> tuple:
        h, w, c = input_shape
        channels = 1 + self.J * self.L + self.L ** 2 * self.J * (self.J - 1) // 2
        return (-(-h // 2 ** self.J), -(-w // 2 ** self.J), c * channels)

    def __call__(self, images: np.ndarray, progress: bool = False) -> np.ndarray:
        """float32 (n, H, W, C) images -> float32 features (n,) + output_shape((H, W, C))."""
        n, h, w, c = images.shape
        if min(h, w) < 2 ** self.J:
            raise ValueError(f"scattering.J = {self.J} needs images of at least {2 ** self.J} "
                             f"pixels a side, got {h}x{w}; lower scattering.J")
        op = scattering_operator(self.J, (h, w), self.L)
        out = np.empty((n,) + self.output_shape((h, w, c)), np.float32)
        starts = range(0, n, self.chunk)
        if progress:
            from tqdm import tqdm  # a dependency of TFDS, and of dpbench
            starts = tqdm(starts, desc=f"scattering J={self.J} L={self.L}", unit="chunk")
        with scipy.fft.set_workers(os.cpu_count() or 1):  # threads over independent images
            for start in starts:
                x = np.ascontiguousarray(np.moveaxis(images[start:start + self.chunk], -1, 1))
                s = op.scattering(x)  # (b, C, K, H', W')
                s = s.reshape(s.shape[0], -1, *s.shape[-2:])
                out[start:start + len(x)] = np.moveaxis(s, 1, -1)
        return out


def make_transform(features: str) -> Optional[Scattering]:
    """None for raw pixels; else the configured transform. Raises ValueError naming the
    choices."""
    if features == "pixels":
        return None
    if features == "scattering":
        return Scattering()
    raise ValueError(f"dataset.features must be one of {FEATURES}, got {features!r}")


def default_cache_dir() -> Path:
    """``$DPBENCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/dpbench``, else ``~/.cache/dpbench``;
    features live in its ``features/`` folder."""
    return records.cache_root() / "features"


def _sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).data).hexdigest()


def cache_key(images: np.ndarray, *, dataset: str, split: str, transform: Scattering) -> dict:
    return dict(format=FORMAT_VERSION, dataset=dataset, split=split,
                transform=transform.describe(), input_shape=list(images.shape),
                input_dtype=str(images.dtype), input_sha256=_sha256(images))


def cache_path(key: dict, directory: Path) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    kind = key["transform"]["kind"]
    return Path(directory) / f"{key['dataset']}-{key['split']}-{kind}-{digest}.npy"


def load_cached(path: Path, key: dict) -> np.ndarray:
    """The features stored at ``path`` for ``key``; raises CorruptCacheError (naming the file)
    if its metadata is unreadable or for another key, or the array is truncated, of the wrong
    shape or does not match its checksum."""
    meta_path = path.with_suffix(".json")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise CorruptCacheError(f"feature cache metadata {meta_path} is unreadable "
                                f"({type(e).__name__}: {e})") from e
    if meta.get("key") != key:
        raise CorruptCacheError(f"feature cache {meta_path} was written for other inputs "
                                f"({meta.get('key')} != {key})")
    try:
        features = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise CorruptCacheError(f"feature cache {path} is unreadable or truncated "
                                f"({type(e).__name__}: {e})") from e
    if list(features.shape) != meta.get("shape") or str(features.dtype) != "float32":
        raise CorruptCacheError(f"feature cache {path} holds {features.dtype} "
                                f"{features.shape}, its metadata says float32 {meta.get('shape')}")
    if _sha256(features) != meta.get("sha256"):
        raise CorruptCacheError(f"feature cache {path} does not match its SHA-256")
    features.flags.writeable = False
    return features


def store(path: Path, key: dict, features: np.ndarray) -> None:
    """Writes the array, then its metadata (the metadata marks a complete entry); each file
    atomically, so concurrent runs and crashes never leave a half-written one."""
    records.atomic_write(path, lambda f: np.save(f, features, allow_pickle=False))
    records.atomic_write_text(path.with_suffix(".json"), json.dumps(
        dict(key=key, shape=list(features.shape), sha256=_sha256(features)), indent=1))


def cached_features(images: np.ndarray, *, dataset: str, split: str, transform: Scattering,
                    directory: Optional[Path] = None) -> np.ndarray:
    """``transform(images)``, from the cache when a valid entry exists; else computed (with a
    progress bar) and stored. A corrupt entry is logged with its path and rebuilt."""
    directory = default_cache_dir() if directory is None else Path(directory)
    key = cache_key(images, dataset=dataset, split=split, transform=transform)
    path = cache_path(key, directory)
    if path.exists() or path.with_suffix(".json").exists():
        try:
            return load_cached(path, key)
        except CorruptCacheError as e:
            logging.warning("%s: rebuilding it", e)
    logging.info("computing %s features of %s/%s (%d examples) into %s", key["transform"],
                 dataset, split, len(images), path)
    features = transform(images, progress=True)
    store(path, key, features)
    features.flags.writeable = False
    return features
