"""Where the course writes: ``$COURSE_HOME``, else the repository checkout, else ~/when-the-model-does-not-fit;
never inside the package. On Colab with Drive mounted, checkpoints go to Drive."""
from __future__ import annotations

import os
import re
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
DATA_DIR = PACKAGE_DIR / "data_files"
HOME_FOLDER_NAME = "when-the-model-does-not-fit"
COLAB_DRIVE_MOUNT = Path("/content/drive")
COLAB_DRIVE_HOME = COLAB_DRIVE_MOUNT / "MyDrive" / HOME_FOLDER_NAME
MOUNT_DRIVE_CODE = "from google.colab import drive; drive.mount('/content/drive')"
_SUBFOLDER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def repository_root() -> Path | None:
    """The course repository this package runs from, or None when it is installed (site-packages)."""
    root = PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() and (root / "notebooks").is_dir() else None


def _writable_folder(folder: Path, how_to_fix: str) -> Path:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"Cannot create the folder {folder} ({err.strerror}); {how_to_fix}.") from None
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"The folder {folder} is not writable; {how_to_fix}.")
    return folder


def course_home() -> Path:
    """The user-writable course folder (created if missing); see the module docstring."""
    custom = os.environ.get("COURSE_HOME", "").strip()
    home = Path(custom).expanduser() if custom else repository_root() or Path.home() / HOME_FOLDER_NAME
    return _writable_folder(home, "set COURSE_HOME to a folder you can write to")


def results_dir() -> Path:
    """``$COURSE_RESULTS_DIR``, else ``<course home>/results``."""
    custom = os.environ.get("COURSE_RESULTS_DIR", "").strip()
    return Path(custom).expanduser() if custom else course_home() / "results"


def _checkpoints_on_drive() -> bool:
    """True without COURSE_HOME when Google Drive is mounted where Colab mounts it."""
    return not os.environ.get("COURSE_HOME", "").strip() and (COLAB_DRIVE_MOUNT / "MyDrive").is_dir()


def checkpoints_dir(subfolder: str | None = None) -> Path:
    """Where checkpoints go (created if missing), optionally a ``subfolder`` such as ``"06_capstone"``."""
    if subfolder is not None and (not isinstance(subfolder, str) or not _SUBFOLDER_RE.match(subfolder)):
        raise ValueError(f"subfolder {subfolder!r} must be one folder name of letters, digits, '_', '-' or '.', "
                         "for example '06_capstone'.")
    base = COLAB_DRIVE_HOME / "checkpoints" if _checkpoints_on_drive() else course_home() / "checkpoints"
    return _writable_folder(base / subfolder if subfolder else base, "set COURSE_HOME to a folder you can write to")


def colab_drive_hint() -> str:
    """One sentence on where checkpoints are kept; on Colab without Drive, how to mount it."""
    from .hardware import in_colab

    if _checkpoints_on_drive():
        return (f"Checkpoints are saved on Google Drive ({COLAB_DRIVE_HOME / 'checkpoints'}): "
                "a disconnect loses nothing, and re-running resumes from the last one.")
    local = course_home() / "checkpoints"
    if in_colab():
        return (f"Checkpoints are saved in {local}, which a Colab disconnect erases. To keep them, mount Google "
                f"Drive with `{MOUNT_DRIVE_CODE}` and re-run this cell: they then go to "
                f"{COLAB_DRIVE_HOME / 'checkpoints'}.")
    return f"Checkpoints are saved in {local} (set COURSE_HOME to keep them elsewhere)."


def data_file(name: str) -> Path:
    """A data file shipped inside the package (``course_utils/data_files/<name>``)."""
    if not isinstance(name, str) or not _SUBFOLDER_RE.match(name):
        raise ValueError(f"data file name {name!r} must be a plain file name such as 'course_corpus.txt'.")
    path = DATA_DIR / name
    if not path.is_file():
        shipped = sorted(p.name for p in DATA_DIR.glob("*")) if DATA_DIR.is_dir() else []
        raise FileNotFoundError(f"No data file {name!r} in the installed package ({DATA_DIR}); it ships "
                                f"{shipped or 'nothing'}. Reinstall the course (`make lab`, or the notebook's first cell on Colab).")
    return path
