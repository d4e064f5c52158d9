"""course_utils.paths: where the course writes (never inside the package) and what it reads (package data)."""
from pathlib import Path

import pytest

from course_utils import hardware, paths

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in ("COURSE_HOME", "COURSE_RESULTS_DIR", "COLAB_RELEASE_TAG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(paths, "COLAB_DRIVE_MOUNT", tmp_path / "content" / "drive")
    monkeypatch.setattr(paths, "COLAB_DRIVE_HOME", tmp_path / "content" / "drive" / "MyDrive" / paths.HOME_FOLDER_NAME)
    monkeypatch.setattr(hardware, "in_colab", lambda: False)
    return tmp_path


@pytest.fixture
def installed(clean_env, monkeypatch):
    """The package as pip installs it: in site-packages, no repository around it; a fresh HOME."""
    package = clean_env / "venv" / "lib" / "site-packages" / "course_utils"
    package.mkdir(parents=True)
    home = clean_env / "home"
    home.mkdir()
    monkeypatch.setattr(paths, "PACKAGE_DIR", package)
    monkeypatch.setenv("HOME", str(home))
    return package, home


def _mount_drive(clean_env):
    (clean_env / "content" / "drive" / "MyDrive").mkdir(parents=True)


def test_from_a_checkout_the_course_home_is_the_repository(clean_env):
    assert paths.repository_root() == REPO
    assert paths.course_home() == REPO
    assert paths.results_dir() == REPO / "results"


def test_installed_writes_under_the_home_folder_never_the_package(installed):
    package, home = installed
    assert paths.repository_root() is None
    assert paths.course_home() == home / paths.HOME_FOLDER_NAME
    assert paths.results_dir() == home / paths.HOME_FOLDER_NAME / "results"
    ckpt = paths.checkpoints_dir("06_capstone")
    assert ckpt == home / paths.HOME_FOLDER_NAME / "checkpoints" / "06_capstone" and ckpt.is_dir()
    assert package not in ckpt.parents and not any(package.iterdir())


def test_environment_overrides(clean_env, monkeypatch):
    monkeypatch.setenv("COURSE_HOME", str(clean_env / "mine"))
    assert paths.course_home() == clean_env / "mine" and (clean_env / "mine").is_dir()
    assert paths.checkpoints_dir() == clean_env / "mine" / "checkpoints"
    monkeypatch.setenv("COURSE_RESULTS_DIR", str(clean_env / "elsewhere"))
    assert paths.results_dir() == clean_env / "elsewhere"


def test_an_unusable_course_home_says_to_set_course_home(clean_env, monkeypatch):
    blocker = clean_env / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("COURSE_HOME", str(blocker / "sub"))
    with pytest.raises(OSError, match="set COURSE_HOME"):
        paths.course_home()


@pytest.mark.parametrize("bad", ["", "../up", "a/b", 3])
def test_bad_checkpoint_subfolder(clean_env, bad):
    with pytest.raises(ValueError, match="one folder name"):
        paths.checkpoints_dir(bad)


def test_colab_without_drive_explains_how_to_mount_it(installed, monkeypatch):
    monkeypatch.setattr(hardware, "in_colab", lambda: True)
    hint = paths.colab_drive_hint()
    assert "from google.colab import drive; drive.mount('/content/drive')" in hint
    assert "disconnect" in hint and str(paths.course_home() / "checkpoints") in hint
    assert paths.checkpoints_dir() == paths.course_home() / "checkpoints"


def test_colab_with_drive_keeps_checkpoints_on_drive(installed, clean_env, monkeypatch):
    monkeypatch.setattr(hardware, "in_colab", lambda: True)
    _mount_drive(clean_env)
    drive_ckpt = paths.COLAB_DRIVE_HOME / "checkpoints"
    assert paths.checkpoints_dir() == drive_ckpt and drive_ckpt.is_dir()
    assert paths.checkpoints_dir("06_capstone") == drive_ckpt / "06_capstone"
    assert "Google Drive" in paths.colab_drive_hint() and "loses nothing" in paths.colab_drive_hint()
    # results stay in the course folder; an explicit COURSE_HOME wins over Drive
    assert paths.results_dir() == paths.course_home() / "results"
    monkeypatch.setenv("COURSE_HOME", str(clean_env / "mine"))
    assert paths.checkpoints_dir() == clean_env / "mine" / "checkpoints"


def test_off_colab_the_hint_names_the_folder(installed):
    hint = paths.colab_drive_hint()
    assert str(paths.course_home() / "checkpoints") in hint and "drive.mount" not in hint


def test_data_files_ship_in_the_package():
    corpus = paths.data_file("course_corpus.txt")
    assert corpus.parent == paths.PACKAGE_DIR / "data_files" and corpus.stat().st_size > 50_000
    with pytest.raises(FileNotFoundError, match="course_corpus.txt"):
        paths.data_file("missing.txt")
    with pytest.raises(ValueError, match="plain file name"):
        paths.data_file("../pyproject.toml")


def test_the_capstone_corpus_is_the_shipped_prose():
    from course_utils import capstone

    text, source = capstone.course_corpus()
    assert len(text) > 50_000 and "shipped with the package" in source
    assert "When the model does not fit" not in text.splitlines()[0]  # the credit line is not training text


def test_the_shipped_corpus_covers_every_notebook():
    """The corpus is the notebooks' prose: a new notebook needs `python scripts/build_corpus.py`."""
    import json

    from course_utils import capstone

    text, _ = capstone.course_corpus()
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        title = next("".join(c["source"]).splitlines()[0] for c in cells if c["cell_type"] == "markdown")
        assert title in text, f"{path.name} is missing from the shipped corpus: run python scripts/build_corpus.py"
