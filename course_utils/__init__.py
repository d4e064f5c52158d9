"""course_utils: the helpers shared by the notebooks of "When the model does not fit": measurement (memory,
timeline, timing), estimation (estimate, planner), hardware, data, models, plots, claim checks and results.
Tooling no notebook imports is the separate package ``course_tools``."""
from __future__ import annotations

import random

from . import bootstrap, checks, hardware, results
from .doctor import doctor  # noqa: F401 - course_utils.doctor(): what holds memory in this kernel

__version__ = "0.1.0"


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and torch so a notebook's numbers repeat from run to run."""
    import numpy as np
    import torch

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, not {seed!r}.")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(notebook: str, *, seed: int = 0) -> str:
    """First call of every notebook: name it for ``results.record``, seed, style plots, print the banner; returns
    the course profile ('smoke', 'gpu-check' or 'full')."""
    results.set_notebook(notebook)
    seed_everything(seed)
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")
    print(hardware.banner())
    if hardware.in_colab() and hardware.device_type() != "cuda":
        print("[course] No GPU attached. On Colab: Runtime > Change runtime type > T4 GPU, then re-run. "
              "Every notebook also runs on the CPU in profile 'smoke'.")
    return hardware.course_profile()
