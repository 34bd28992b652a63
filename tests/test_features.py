"""ScatterNet features: the transform is kymatio's, per example and public; the disk cache is
keyed and validated."""

import logging

import numpy as np
import pytest

from dpbench import data, features


def _images(n, size=28, seed=None):
    return np.random.default_rng(seed).uniform(size=(n, size, size, 1)).astype(np.float32)


def test_kymatio_loads_through_the_2d_frontend_and_gives_known_values():
    """kymatio.numpy cannot be imported with this SciPy (its 3-D frontend needs sph_harm);
    dpbench's one import of kymatio works, and a constant image keeps its value in the
    zeroth-order (low-pass) channel with nothing in the 80 wavelet channels."""
    transform = features.Scattering(J=2, L=8)
    constant = np.full((1, 28, 28, 1), 0.25, np.float32)
    out = transform(constant)
    assert out.shape == (1, 7, 7, 81) == (1,) + transform.output_shape((28, 28, 1))
    np.testing.assert_allclose(out[..., 0], 0.25, rtol=1e-4)  # the low-pass sums to 1
    assert np.abs(out[..., 1:]).max() < 1e-6
    edge = constant.copy()
    edge[:, :, 14:] = 1.0  # a vertical edge: the first-order channels respond
    assert np.abs(transform(edge)[..., 1:17]).max() > 1e-2
    assert transform.output_shape((32, 32, 3)) == (8, 8, 243)  # 81 per input channel


def test_the_features_of_an_example_do_not_depend_on_the_rest_of_the_dataset():
    images = _images(40)
    alone = np.concatenate([features.Scattering(chunk=1)(images[i:i + 1]) for i in range(40)])
    for chunk in (7, 40):
        np.testing.assert_array_equal(features.Scattering(chunk=chunk)(images), alone)
    other = _images(40)
    other[5] = images[5]  # the same example among different neighbours
    np.testing.assert_array_equal(features.Scattering(chunk=16)(other)[5], alone[5])


def test_bad_parameters_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match="scattering.J must be an integer >= 1"):
        features.Scattering(J=0)
    with pytest.raises(ValueError, match="lower scattering.J"):
        features.Scattering(J=4)(_images(1, size=8))
    with pytest.raises(ValueError, match="dataset.features must be one of"):
        features.make_transform("wavelets")


def test_the_cache_is_keyed_validated_and_rebuilt_when_corrupt(tmp_path, monkeypatch, caplog):
    images = _images(12)
    kwargs = dict(dataset="toy", split="train", directory=tmp_path)
    first = features.cached_features(images, transform=features.Scattering(), **kwargs)
    [path] = tmp_path.glob("toy-train-scattering-*.npy")
    assert path.with_suffix(".json").exists()

    calls = []
    real_call = features.Scattering.__call__
    monkeypatch.setattr(features.Scattering, "__call__",
                        lambda self, x, progress=False: calls.append(1) or real_call(self, x))
    np.testing.assert_array_equal(
        features.cached_features(images, transform=features.Scattering(), **kwargs), first)
    assert calls == []  # a valid entry is read, not recomputed
    # another parameter, another split or other pixels: another key, recomputed
    features.cached_features(images, transform=features.Scattering(J=1), **kwargs)
    features.cached_features(images, transform=features.Scattering(L=4), **kwargs)
    changed = images.copy()
    changed[3, 0, 0, 0] += 0.5
    features.cached_features(changed, transform=features.Scattering(), **kwargs)
    features.cached_features(images, transform=features.Scattering(), dataset="toy",
                             split="test", directory=tmp_path)
    assert len(calls) == 4 and len(list(tmp_path.glob("*.npy"))) == 5

    # a truncated file is refused, naming it, then rebuilt (never used)
    path.write_bytes(path.read_bytes()[:-100])
    key = features.cache_key(images, dataset="toy", split="train",
                             transform=features.Scattering())
    with pytest.raises(features.CorruptCacheError, match=str(path)):
        features.load_cached(path, key)
    with caplog.at_level(logging.WARNING):
        again = features.cached_features(images, transform=features.Scattering(), **kwargs)
    assert str(path) in caplog.text and "rebuilding" in caplog.text
    np.testing.assert_array_equal(again, first)
    assert len(calls) == 5
    np.testing.assert_array_equal(features.load_cached(path, key), first)  # repaired
    # same length, flipped bytes: the checksum catches it
    raw = bytearray(path.read_bytes())
    raw[-8:] = bytes(8)
    path.write_bytes(bytes(raw))
    with pytest.raises(features.CorruptCacheError, match="SHA-256"):
        features.load_cached(path, key)


def test_a_dataset_of_features_is_carved_like_its_pixels(tmp_path):
    pixels = data.load_dataset("digits", validation_size=100, public_size=50)
    scat = data.load_dataset("digits", validation_size=100, public_size=50,
                             features="scattering", feature_cache_dir=str(tmp_path))
    assert scat.input_shape == (2, 2, 81) and scat.features["kind"] == "scattering"
    assert scat.features["J"] == 2 and scat.features["library"].startswith("kymatio ")
    assert pixels.features == {"kind": "pixels"}
    transform = features.Scattering()
    for split in ("train", "validation", "public", "test"):
        got, want = getattr(scat, split), getattr(pixels, split)
        np.testing.assert_array_equal(got.labels, want.labels)
        np.testing.assert_array_equal(got.images, transform(want.images))
    assert not scat.train.images.flags.writeable


def test_new_scattering_settings_in_the_same_process_give_new_features(tmp_path):
    """The in-process dataset cache is keyed by the transform's settings: binding another
    scattering.J (or L) and loading again computes the features anew, never the stale ones."""
    import gin
    load = lambda: data.load_dataset("digits", validation_size=100, features="scattering",  # noqa: E731
                                     feature_cache_dir=str(tmp_path))
    try:
        default = load()
        gin.parse_config("scattering.J = 1")
        one = load()
        gin.parse_config("scattering.J = 2\nscattering.L = 4")
        four = load()
    finally:
        gin.clear_config()
    assert (default.features["J"], default.features["L"]) == (2, 8)
    assert one.features["J"] == 1 and one.input_shape == (4, 4, 9)
    assert four.features["L"] == 4 and four.input_shape == (2, 2, 25)
    np.testing.assert_array_equal(one.train.images,
                                  features.Scattering(J=1)(data.load_dataset(
                                      "digits", validation_size=100).train.images))
