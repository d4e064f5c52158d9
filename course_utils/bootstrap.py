"""Make a notebook's imports work locally (`make lab` installs everything) and on Colab (the course's packages but
torch may be missing). Never reinstalls torch: Colab's torch matches its CUDA driver, and replacing it breaks the GPU."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

from . import hardware

# import name -> pip requirement (what requirements.txt asks for)
COURSE_PACKAGES = {"timm": "timm>=1.0", "bitsandbytes": "bitsandbytes>=0.50", "transformers": "transformers>=4.46",
                   "seaborn": "seaborn>=0.13", "tqdm": "tqdm>=4.66", "ipywidgets": "ipywidgets>=7.7",
                   "mlxtend": "mlxtend>=0.23", "sklearn": "scikit-learn>=1.3", "psutil": "psutil>=5.9",
                   "torchao": "torchao>=0.18", "peft": "peft>=0.21", "accelerate": "accelerate>=1.0",
                   "lion_pytorch": "lion-pytorch>=0.2.5,<0.3", "adam_mini": "adam-mini>=1.1.1,<1.2",
                   "galore_torch": "galore-torch>=1.0,<1.1", "apollo_torch": "apollo-torch>=1.0.3,<1.1"}
NEVER_INSTALL = {"torch", "torchvision", "torchaudio"}


def missing_packages(import_names) -> list[str]:
    """Import names among ``import_names`` that are not installed."""
    names = list(import_names)
    unknown = [n for n in names if n not in COURSE_PACKAGES and n not in NEVER_INSTALL]
    if unknown:
        raise ValueError(f"Unknown package(s) {unknown}; the course knows {sorted(COURSE_PACKAGES)}.")
    return [n for n in names if importlib.util.find_spec(n) is None]


def ensure_packages(import_names) -> list[str]:
    """Install (on Colab) the course packages that are missing; return what was installed."""
    missing = missing_packages(import_names)
    if not missing:
        return []
    torchy = sorted(set(missing) & NEVER_INSTALL)
    if torchy:
        raise ImportError(f"{torchy} not installed. Install PyTorch for your machine first (https://pytorch.org), "
                          "then re-run this cell; the course never installs torch itself.")
    if not hardware.in_colab():
        raise ImportError(f"Missing package(s) {missing}. From the course folder run `make lab` (it installs "
                          "everything into .venv), or `pip install -r requirements.txt -e .` in your own environment.")
    requirements = [COURSE_PACKAGES[n] for n in missing]
    print(f"[course] Colab: installing {', '.join(requirements)} (torch is left as Colab ships it)...")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *requirements], check=True)
    return missing
