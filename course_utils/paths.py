"""Where the course writes: one user-writable course folder, wherever the course is installed.

A learner may run the repository (``make lab``), or only the installed package and one notebook
(Colab). Nothing is ever written inside the package: results and checkpoints go under
:func:`course_home`:

* ``$COURSE_HOME`` when set;
* otherwise ``<repository>/`` when the package runs from a checkout (``results/`` and
  ``checkpoints/`` there are git-ignored);
* otherwise ``~/when-the-model-does-not-fit``.
"""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
HOME_FOLDER_NAME = "when-the-model-does-not-fit"


def repository_root() -> Path | None:
    """The course repository this package runs from, or None when it is installed (site-packages)."""
    root = PACKAGE_DIR.parent
    if (root / "pyproject.toml").is_file() and (root / "notebooks").is_dir():
        return root
    return None


def course_home() -> Path:
    """The user-writable course folder (created if missing); see the module docstring."""
    custom = os.environ.get("COURSE_HOME", "").strip()
    if custom:
        home = Path(custom).expanduser()
    else:
        home = repository_root() or Path.home() / HOME_FOLDER_NAME
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(
            f"Cannot create the course folder {home} ({err.strerror}); set COURSE_HOME to a folder you can write to."
        ) from None
    if not os.access(home, os.W_OK):
        raise PermissionError(f"The course folder {home} is not writable; set COURSE_HOME to a folder you can write to.")
    return home


def results_dir() -> Path:
    """``$COURSE_RESULTS_DIR``, else ``<course home>/results``."""
    custom = os.environ.get("COURSE_RESULTS_DIR", "").strip()
    return Path(custom).expanduser() if custom else course_home() / "results"


def checkpoints_dir() -> Path:
    """``<course home>/checkpoints`` (created if missing)."""
    folder = course_home() / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
