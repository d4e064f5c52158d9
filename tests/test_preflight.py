"""course_tools.preflight (`make check`): one green or red line per item, a fix for each red one,
a summary line, and never a traceback."""
import importlib.metadata
import os
import stat

import pytest

from course_tools import preflight
from course_utils import bootstrap


def test_python_version():
    assert preflight.check_python((3, 11, 7)).ok
    old = preflight.check_python((3, 8, 10))
    assert not old.ok and "3.8.10" in old.detail and "3.11" in old.fix


def test_missing_package_gets_the_install_fix():
    def version_of(name):
        if name == "timm":
            raise importlib.metadata.PackageNotFoundError(name)
        return "2.0"

    item = preflight.check_packages(("torch", "timm"), ranges={}, version_of=version_of)
    assert not item.ok and "timm" in item.detail and "make install" in item.fix


def test_a_missing_optional_package_is_reported_not_failed():
    def version_of(name):
        if name in ("bitsandbytes", "torchao"):
            raise importlib.metadata.PackageNotFoundError(name)
        return "2.0"

    item = preflight.check_packages(("torch",), ranges={}, version_of=version_of)
    assert item.ok and item.detail.endswith("not installed (optional: the notebooks skip what needs them): "
                                            "bitsandbytes, torchao"), item.detail
    assert set(preflight.OPTIONAL_PACKAGES) == {bootstrap.pip_name(n) for n in bootstrap.OPTIONAL_PACKAGES}
    assert not set(preflight.OPTIONAL_PACKAGES) & set(preflight.LEARNER_PACKAGES)


def test_version_outside_the_tested_range():
    item = preflight.check_packages(("torch",), ranges={"torch": ">=2.4,<=2.14.1"}, version_of=lambda n: "2.1.0")
    assert not item.ok and "torch 2.1.0" in item.detail and ">=2.4" in item.detail
    assert preflight.check_packages(("torch",), ranges={"torch": ">=2.4,<=2.14.1"}, version_of=lambda n: "2.14.1").ok


def test_requirements_are_read_from_the_repository():
    ranges = preflight.requirements()
    assert ranges["torch"].startswith(">=") and "ipywidgets" in ranges


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to any folder, so a read-only folder cannot be shown")
def test_unwritable_course_folder(tmp_path, monkeypatch):  # pragma: no cover - CI runs as root
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.setenv("COURSE_HOME", str(folder))
    item = preflight.check_course_folder()
    assert not item.ok and "COURSE_HOME" in item.fix


def test_course_folder_that_cannot_be_created(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("COURSE_HOME", str(blocker / "course"))
    item = preflight.run_checks((("course folder", preflight.check_course_folder, "set COURSE_HOME"),))[0]
    assert not item.ok and "COURSE_HOME" in item.fix


def test_a_crashing_check_becomes_a_red_line_not_a_traceback():
    def broken():
        raise RuntimeError("driver exploded")

    def missing():
        import a_package_that_does_not_exist  # noqa: F401

    items = preflight.run_checks((("gpu", broken, "reinstall the driver"), ("widgets", missing, "make install")))
    assert [i.ok for i in items] == [False, False]
    assert "driver exploded" in items[0].detail and items[0].fix == "reinstall the driver"
    assert "a_package_that_does_not_exist" in items[1].detail
    line = items[0].line(color=False)
    assert line.startswith("✗ gpu") and "fix: reinstall the driver" in line


@pytest.mark.slow
def test_whole_preflight_on_this_machine(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_RESULTS_DIR", str(tmp_path))
    code = preflight.main(["--no-color", "--record"])
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) == len(preflight.CHECKS) + 1
    assert lines[-1].startswith("course preflight: READY"), out
    assert code == 0
    import json

    seconds = json.loads((tmp_path / "preflight.json").read_text())["preflight_seconds"]["value"]
    assert seconds <= 90, f"preflight took {seconds} s; a learner's laptop should need under 90 s"
