"""An offline stand-in for the internet, for TFDS's REAL mnist, cifar10 and svhn_cropped builders.

Only the HTTP transport is replaced (``requests.adapters.HTTPAdapter.send``): TFDS's download
manager, downloader, checksum validation, gzip/tar extraction, the builders' own
``_split_generators`` / ``_generate_examples``, feature encoding and the array_record writer all
run as they do for a user with network access. Each real URL is answered with a tiny synthetic
file in the exact format the builder parses (gzipped IDX for mnist, the binary-version tar.gz for
cifar10, MATLAB .mat files for svhn_cropped); any other URL gets a 404. Two things are adjusted,
both scoped to one test by ``monkeypatch``: the builder's registered checksums are those of the
synthetic files (so validation still runs), and mnist's hard-coded 60000/10000 example counts are
the synthetic files' counts.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import sys
import tarfile

import numpy as np
import requests

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                   "ship", "truck")


@dataclasses.dataclass
class Served:
    """What the fake internet holds for one dataset, and what it was asked for."""

    files: dict            # real URL -> bytes
    expected: dict         # split -> (uint8 images (n, H, W, C), int labels (n,))
    requested: list = dataclasses.field(default_factory=list)


def _idx_gz(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes())


def _mnist(rng) -> Served:
    url = "https://storage.googleapis.com/cvdf-datasets/mnist/"
    files, expected = {}, {}
    for split, prefix, n in (("train", "train", 12), ("test", "t10k", 7)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.permutation(np.arange(n) % 10)
        files[f"{url}{prefix}-images-idx3-ubyte.gz"] = _idx_gz(images)
        files[f"{url}{prefix}-labels-idx1-ubyte.gz"] = _idx_gz(labels)
        expected[split] = (images[..., None], labels)
    return Served(files, expected)


def _cifar10(rng) -> Served:
    """The binary version: records of 1 label byte + 3072 image bytes (channel-major)."""
    members = {"cifar-10-batches-bin/batches.meta.txt":
               ("\n".join(CIFAR10_CLASSES) + "\n\n").encode()}
    parts = {"train": [f"data_batch_{i}.bin" for i in range(1, 6)], "test": ["test_batch.bin"]}
    expected = {}
    for split, batch_files in parts.items():
        images, labels = [], []
        for fname in batch_files:
            chw = rng.integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)
            lab = rng.integers(0, 10, 2)
            members[f"cifar-10-batches-bin/{fname}"] = b"".join(
                bytes([int(lab[i])]) + chw[i].tobytes() for i in range(2))
            images.append(chw.transpose(0, 2, 3, 1))
            labels.append(lab)
        expected[split] = (np.concatenate(images), np.concatenate(labels))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for member, payload in members.items():
            info = tarfile.TarInfo(member)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return Served({"https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz": buffer.getvalue()},
                  expected)


def _svhn_cropped(rng) -> Served:
    """MATLAB files: X (32, 32, 3, n) uint8, y (n, 1) in 1..10 where 10 is the digit 0."""
    import scipy.io

    files, expected = {}, {}
    for split, n in (("train", 9), ("test", 5), ("extra", 2)):
        images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        digits = rng.permutation(np.arange(n) % 10)
        buffer = io.BytesIO()
        scipy.io.savemat(buffer, {"X": np.moveaxis(images, 0, -1),
                                  "y": np.where(digits == 0, 10, digits)[:, None]})
        files[f"http://ufldl.stanford.edu/housenumbers/{split}_32x32.mat"] = buffer.getvalue()
        expected[split] = (images, digits)
    return Served(files, expected)


SOURCES = {"mnist": _mnist, "cifar10": _cifar10, "svhn_cropped": _svhn_cropped}


def _response(request, status: int, body: bytes) -> requests.Response:
    response = requests.Response()
    response.status_code, response.url, response.request = status, request.url, request
    response.headers["Content-Length"] = str(len(body))
    response.raw = io.BytesIO(body)
    return response


def serve(monkeypatch, name: str, seed: int = 0) -> Served:
    """Answers the real builder of ``name``'s URLs from memory; returns what is served."""
    import tensorflow_datasets as tfds
    from tensorflow_datasets.core import utils as tfds_utils
    from tensorflow_datasets.core.download import checksums

    served = SOURCES[name](np.random.default_rng(seed))

    def send(adapter, request, **kwargs):
        served.requested.append(request.url)
        body = served.files.get(request.url)
        return _response(request, 200, body) if body is not None else _response(request, 404, b"")

    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", send)
    builder_cls = tfds.builder_cls(name)
    monkeypatch.setattr(builder_cls, "url_infos", {
        url: checksums.UrlInfo(size=tfds_utils.Size(len(body)),
                               checksum=hashlib.sha256(body).hexdigest(),
                               filename=url.rsplit("/", 1)[1])
        for url, body in served.files.items()})
    if name == "mnist":
        module = sys.modules[builder_cls.__module__]
        monkeypatch.setattr(module, "_TRAIN_EXAMPLES", len(served.expected["train"][1]))
        monkeypatch.setattr(module, "_TEST_EXAMPLES", len(served.expected["test"][1]))
    return served


def no_network(monkeypatch) -> None:
    """Every HTTP request fails as on a machine without network access."""
    def send(adapter, request, **kwargs):
        raise requests.ConnectionError(f"no network here (asked for {request.url})")
    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", send)
