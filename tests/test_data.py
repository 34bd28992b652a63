import gzip
from pathlib import Path

import gin
import numpy as np
import pytest

from dpbench import data

FMNIST = Path(data.FASHION_MNIST_DIR)
needs_fmnist = pytest.mark.skipif(
    not (FMNIST / "train-images-idx3-ubyte.gz").exists(),
    reason="run `apt-get install -y dataset-fashion-mnist` (tools/install.sh does)")


@needs_fmnist
def test_fashion_mnist_loads_from_the_debian_files():
    ds = data.load_dataset("fashion_mnist", validation_size=5000, public_size=1000)
    assert len(ds.train) + len(ds.validation) + len(ds.public) == 60_000
    assert len(ds.test) == 10_000 and ds.input_shape == (28, 28, 1)
    assert ds.train.images.dtype == np.float32 and ds.train.labels.dtype == np.int32
    assert 0.0 <= ds.train.images.min() and ds.train.images.max() <= 1.0
    assert set(np.unique(ds.test.labels)) == set(range(10)) and ds.num_classes == 10


@needs_fmnist
def test_carving_is_disjoint_covering_and_deterministic():
    ds = data.load_dataset("fashion_mnist", validation_size=5000, public_size=2000, split_seed=3)
    parts = [set(ds.train_indices), set(ds.validation_indices), set(ds.public_indices)]
    assert set().union(*parts) == set(range(60_000))
    assert not (parts[0] & parts[1]) and not (parts[0] & parts[2]) and not (parts[1] & parts[2])
    again = data.load_dataset("fashion_mnist", validation_size=5000, public_size=2000,
                              split_seed=3)
    np.testing.assert_array_equal(ds.train_indices, again.train_indices)
    other = data.load_dataset("fashion_mnist", validation_size=5000, public_size=2000,
                              split_seed=4)
    assert not np.array_equal(ds.validation_indices, other.validation_indices)
    assert ds.public is not None and len(ds.public) == 2000


def test_digits_has_a_fixed_test_split_and_images_in_unit_range():
    ds = data.load_dataset("digits", validation_size=200)
    assert ds.input_shape == (8, 8, 1) and len(ds.test) == data.DIGITS_TEST_SIZE
    assert len(ds.train) + len(ds.validation) == 1797 - data.DIGITS_TEST_SIZE
    assert ds.public is None and len(ds.public_indices) == 0
    assert 0 <= ds.train.images.min() and ds.train.images.max() <= 1


def test_missing_files_name_the_install_command(tmp_path, monkeypatch):
    def no_network(name):
        raise ConnectionError("no network here")
    monkeypatch.setattr(data, "_load_via_tfds", no_network)
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        data.load_dataset("fashion_mnist", data_dir=str(tmp_path))


@needs_fmnist
def test_truncated_idx_file_is_named(tmp_path):
    for name in data.FASHION_MNIST_FILES.values():
        (tmp_path / name).write_bytes((FMNIST / name).read_bytes())
    raw = gzip.decompress((FMNIST / "t10k-labels-idx1-ubyte.gz").read_bytes())
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(raw[:-100]))
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.gz is truncated"):
        data.load_dataset("fashion_mnist", data_dir=str(tmp_path))


def test_unknown_name_and_bad_sizes_say_what_to_change():
    with pytest.raises(ValueError, match="unknown dataset 'cifar100'.*fashion_mnist"):
        data.load_dataset("cifar100")
    with pytest.raises(ValueError, match="validation_size"):
        data.load_dataset("digits", validation_size=-1)
    with pytest.raises(ValueError, match="leave private training examples"):
        data.load_dataset("digits", validation_size=1500)


def test_gin_binds_the_dataset():
    gin.parse_config("dataset.name = 'digits'\ndataset.validation_size = 100")
    assert len(data.load_dataset().validation) == 100
