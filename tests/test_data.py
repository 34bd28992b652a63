import gzip
from pathlib import Path

import gin
import numpy as np
import pytest

from dpbench import data
from tests import tfds_offline

FMNIST = Path(data.FASHION_MNIST_DIR)
needs_fmnist = pytest.mark.skipif(
    not all((FMNIST / f).exists() for f in data.FASHION_MNIST_FILES.values()),
    reason="run `apt-get install -y dataset-fashion-mnist` (tools/install.sh does)")


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def _write_idx_gz(path, array, magic_dtype=0x08):
    header = bytes([0, 0, magic_dtype, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def _assert_disjoint_cover(ds, n, raw_x, raw_y):
    """The splits' indices are disjoint and cover the original training split, AND each
    split's rows are the original rows at its indices (so the public anchors cannot be private
    examples under another index)."""
    parts = [set(ds.train_indices.tolist()), set(ds.validation_indices.tolist()),
             set(ds.public_indices.tolist())]
    assert sum(map(len, parts)) == n and set().union(*parts) == set(range(n))
    assert not (parts[0] & parts[1]) and not (parts[0] & parts[2]) and not (parts[1] & parts[2])
    for split, indices in ((ds.train, ds.train_indices), (ds.validation, ds.validation_indices),
                           (ds.public, ds.public_indices)):
        if split is None:
            assert len(indices) == 0
            continue
        np.testing.assert_array_equal(split.images, raw_x[indices])
        np.testing.assert_array_equal(split.labels, raw_y[indices])


@needs_fmnist
def test_fashion_mnist_loads_from_the_debian_files():
    data._CACHE.clear(), data._CARVED.clear()
    ds = data.load_dataset("fashion_mnist", validation_size=5000, public_size=1000)
    assert len(ds.train) + len(ds.validation) + len(ds.public) == 60_000
    assert (len(ds.train), len(ds.validation), len(ds.public)) == (54_000, 5000, 1000)
    assert len(ds.test) == 10_000 and ds.input_shape == (28, 28, 1) and ds.num_classes == 10
    for split in (ds.train, ds.validation, ds.public, ds.test):
        assert split.images.dtype == np.float32 and split.labels.dtype == np.int32
        assert split.images.shape[1:] == (28, 28, 1) and not split.images.flags.writeable
        assert 0.0 <= split.images.min() and split.images.max() <= 1.0
    assert ds.train.images.max() == 1.0  # scaled by 255, not left as bytes or normalised
    for labels in (ds.train.labels, ds.test.labels):
        assert set(np.unique(labels).tolist()) == set(range(10))
    assert data.load_dataset("fashion_mnist", public_size=1000) is ds  # cached, not re-read


@needs_fmnist
def test_carving_is_disjoint_covering_and_deterministic():
    ds = data.load_dataset("fashion_mnist", validation_size=5000, public_size=2000, split_seed=3)
    raw = data._CACHE[("fashion_mnist", str(FMNIST), "pixels", None)][0]
    _assert_disjoint_cover(ds, 60_000, raw[0], raw[1])
    data._CARVED.clear()  # recompute rather than hit the carving cache
    again = data.load_dataset("fashion_mnist", validation_size=5000, public_size=2000,
                              split_seed=3)
    for a, b in [(ds.train_indices, again.train_indices), (ds.train.images, again.train.images),
                 (ds.public_indices, again.public_indices)]:
        np.testing.assert_array_equal(a, b)
    other = data.load_dataset("fashion_mnist", validation_size=5000, public_size=2000,
                              split_seed=4)
    assert not np.array_equal(ds.validation_indices, other.validation_indices)
    # the split rows really are the original rows at those indices
    raw_train_y = data._CACHE[("fashion_mnist", str(FMNIST), "pixels", None)][0][1]
    np.testing.assert_array_equal(ds.validation.labels, raw_train_y[ds.validation_indices])


def test_public_split_is_disjoint_from_train_and_validation():
    ds = data.load_dataset("digits", validation_size=100, public_size=150, split_seed=7)
    assert ds.public is not None and len(ds.public) == 150 and len(ds.validation) == 100
    _assert_disjoint_cover(ds, 1797 - data.DIGITS_TEST_SIZE,
                           *data._CACHE[("digits", None, "pixels", None)][0][:2])
    assert len(data.load_dataset("digits", validation_size=100).public_indices) == 0


def test_digits_has_a_fixed_test_split_and_images_in_unit_range():
    ds = data.load_dataset("digits", validation_size=200)
    assert ds.input_shape == (8, 8, 1) and ds.train.images.shape[1:] == (8, 8, 1)
    assert len(ds.test) == data.DIGITS_TEST_SIZE and ds.num_classes == 10
    assert len(ds.train) + len(ds.validation) == 1797 - data.DIGITS_TEST_SIZE
    assert ds.public is None and len(ds.public_indices) == 0
    assert 0 <= ds.train.images.min() and ds.train.images.max() == 1.0
    assert ds.train.images.dtype == np.float32 and ds.train.labels.dtype == np.int32
    other = data.load_dataset("digits", validation_size=200, split_seed=5)
    np.testing.assert_array_equal(ds.test.labels, other.test.labels)  # seed-independent test


def test_missing_files_name_the_install_command(tmp_path, monkeypatch):
    def no_network(name):
        raise ConnectionError("no network here")
    monkeypatch.setattr(data, "_load_via_tfds", no_network)
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist") as e:
        data.load_dataset("fashion_mnist", data_dir=str(tmp_path))
    assert "dataset.data_dir" in str(e.value) and "TFDS" in str(e.value)


def test_tfds_failure_names_the_dataset(monkeypatch):
    monkeypatch.setattr(data, "_load_via_tfds", lambda name, data_dir=None: 1 / 0)
    with pytest.raises(FileNotFoundError, match="'svhn_cropped'.*network access"):
        data.load_dataset("svhn_cropped")


@needs_fmnist
def test_truncated_idx_file_is_named(tmp_path):
    for name in data.FASHION_MNIST_FILES.values():
        (tmp_path / name).write_bytes((FMNIST / name).read_bytes())
    raw = gzip.decompress((FMNIST / "t10k-labels-idx1-ubyte.gz").read_bytes())
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(raw[:-100]))
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.gz is truncated"):
        data.load_dataset("fashion_mnist", data_dir=str(tmp_path))


def test_corrupt_idx_files_are_named(tmp_path):
    good = tmp_path / "good.gz"
    _write_idx_gz(good, np.arange(24).reshape(2, 3, 4))
    assert data.read_idx_gz(good, 3).shape == (2, 3, 4)
    cut = tmp_path / "cut.gz"
    cut.write_bytes(good.read_bytes()[:-10])  # truncated gzip stream
    with pytest.raises(ValueError, match="cut.gz is corrupt or truncated"):
        data.read_idx_gz(cut, 3)
    magic = tmp_path / "magic.gz"
    _write_idx_gz(magic, np.arange(24).reshape(2, 3, 4), magic_dtype=0x0D)
    with pytest.raises(ValueError, match="magic.gz has bad magic number"):
        data.read_idx_gz(magic, 3)
    with pytest.raises(ValueError, match="good.gz has bad magic number"):
        data.read_idx_gz(good, 1)  # labels file expected, images file given


def test_unknown_name_and_bad_sizes_say_what_to_change():
    with pytest.raises(ValueError, match="unknown dataset 'cifar100'; known: cifar10, digits, "
                                         "fashion_mnist, mnist, svhn_cropped .*register_dataset"):
        data.load_dataset("cifar100")


def test_a_registered_loader_that_returns_bad_arrays_is_refused_with_what_it_must_give():
    data.register_dataset("broken_for_test", lambda data_dir: (
        np.zeros((10, 8, 8), np.float32), np.zeros(10, np.int32),
        np.zeros((5, 8, 8, 1), np.float32), np.zeros(5, np.int32), 2))
    try:
        with pytest.raises(ValueError, match="must give float32 \\(N, H, W, C\\) images"):
            data.load_dataset("broken_for_test", validation_size=2)
    finally:
        data._LOADERS.pop("broken_for_test")
    with pytest.raises(ValueError, match="validation_size"):
        data.load_dataset("digits", validation_size=-1)
    with pytest.raises(ValueError, match="public_size"):
        data.load_dataset("digits", public_size=-5)
    with pytest.raises(ValueError, match="leave private training examples"):
        data.load_dataset("digits", validation_size=1000, public_size=500)


def test_gin_binds_the_dataset():
    gin.parse_config("dataset.name = 'digits'\ndataset.validation_size = 100\n"
                     "dataset.public_size = 50")
    ds = data.load_dataset()
    assert ds.name == "digits" and len(ds.validation) == 100 and len(ds.public) == 50


def _rows(images, labels):
    """The examples of a split as a sorted list of (label, uint8 image bytes): TFDS shuffles the
    example order when it prepares a split, so splits are compared as multisets."""
    images = np.asarray(images)
    if images.dtype != np.uint8:  # dpbench's float32 in [0, 1] -> the original bytes
        images = np.round(images.astype(np.float64) * 255).astype(np.uint8)
    return sorted(zip(np.asarray(labels).tolist(), (x.tobytes() for x in images)))


@pytest.mark.parametrize("name,shape", [("mnist", (28, 28, 1)), ("cifar10", (32, 32, 3)),
                                        ("svhn_cropped", (32, 32, 3))])
def test_tfds_name_downloads_prepares_and_loads_offline(name, shape, tmp_path, monkeypatch):
    """dpbench's own loader, given a TFDS name and an empty data_dir, runs TFDS's REAL builder
    end to end (download, checksum check, extraction, _generate_examples, encoding, array_record
    files) against tfds_offline's fake internet, then reads the prepared data back; a second
    load reads the prepared data_dir with the network gone."""
    served = tfds_offline.serve(monkeypatch, name)
    ds = data.load_dataset(name, data_dir=str(tmp_path), validation_size=2, public_size=1)
    assert sorted(served.requested) == sorted(served.files)  # the real URLs, each fetched once
    version_dirs = list((tmp_path / name).iterdir())
    assert len(version_dirs) == 1 and list(version_dirs[0].glob(f"{name}-train.array_record-*"))
    cached = data._CACHE[(name, str(tmp_path), "pixels", None)][0]
    train_x, train_y, test_x, test_y, num_classes = cached
    assert num_classes == 10 and ds.num_classes == 10 and ds.input_shape == shape
    assert _rows(train_x, train_y) == _rows(*served.expected["train"])
    assert _rows(test_x, test_y) == _rows(*served.expected["test"])
    n = len(served.expected["train"][1])
    assert (len(ds.train), len(ds.validation), len(ds.public)) == (n - 3, 2, 1)
    _assert_disjoint_cover(ds, n, train_x, train_y)
    for split in (ds.train, ds.validation, ds.public, ds.test):
        assert split.images.dtype == np.float32 and split.labels.dtype == np.int32
        assert 0.0 <= split.images.min() and split.images.max() <= 1.0
    if name == "svhn_cropped":  # digit 0 is stored as 10 in the .mat files
        assert 0 in set(train_y.tolist()) and 10 not in set(train_y.tolist())

    tfds_offline.no_network(monkeypatch)
    data._CACHE.pop((name, str(tmp_path), "pixels", None)), data._CARVED.clear()
    again = data.load_dataset(name, data_dir=str(tmp_path), validation_size=2, public_size=1)
    np.testing.assert_array_equal(again.train.images, ds.train.images)
    np.testing.assert_array_equal(again.test.labels, ds.test.labels)


def test_tfds_name_without_network_fails_on_the_download_not_an_import(tmp_path, monkeypatch):
    """On a machine without network access the real TFDS path gets as far as the download:
    the error names the dataset and network access, and nothing in its chain is an ImportError
    (a fresh install used to fail with "No module named 'importlib_resources'")."""
    tfds_offline.no_network(monkeypatch)
    with pytest.raises(FileNotFoundError, match="'cifar10'.*network access") as e:
        data.load_dataset("cifar10", data_dir=str(tmp_path))
    chain, cause = [], e.value
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    assert not any(isinstance(c, ImportError) for c in chain), chain
    assert "no network here" in str(e.value)
