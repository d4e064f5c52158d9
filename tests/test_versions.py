"""course_utils.versions: installed versions against the tested ranges declared in the package metadata."""
from importlib import metadata

import pytest

from course_utils import versions


@pytest.mark.parametrize("version,spec,ok", [
    ("2.14.1+cu130", ">=2.6,<=2.14.1", True),   # the local part (+cu130) is ignored
    ("2.15.0", ">=2.6,<=2.14.1", False),
    ("2.5.1", ">=2.6", False),
    ("2.6", ">=2.6.0", True),                    # 2.6 == 2.6.0
    ("2.6.0rc1", ">=2.6", False),                # a release candidate comes before its release
    ("7.7.1", ">=7.7", True),
    ("8.1.9", ">=7.7,<9", True),
    ("0.50.2", "~=0.50.0", True),
    ("0.51.0", "~=0.50.0", False),
    ("4.46.3", "==4.46.*", True),
    ("4.47.0", "==4.46.*", False),
    ("5.24.0", "!=5.0.0", True),
    ("1.0", "", True),
])
def test_in_range(version, spec, ok):
    assert versions.in_range(version, spec) is ok


def test_declared_ranges_come_from_the_installed_metadata():
    ranges = versions.declared_ranges()
    torch_lines = [r for r in metadata.requires("course_utils") if r.lower().startswith("torch")]
    assert "torch" in ranges and torch_lines
    assert all(clause in torch_lines[0].replace(" ", "") for clause in ranges["torch"].split(","))


def test_a_version_outside_its_range_is_said_loudly():
    ranges = {"torch": ">=99", "transformers": ">=1.0"}
    checks = {c.package: c for c in versions.check_versions(("torch", "transformers", "no-such-package"),
                                                           ranges=ranges)}
    assert checks["torch"].status == "outside" and checks["transformers"].status == "ok"
    assert checks["no-such-package"].status == "not installed"
    report = versions.version_report(("torch", "transformers"), ranges=ranges)
    assert "OUTSIDE the tested range" in report and "WARNING: torch" in report
    assert "pip install 'torch>=99'" in report
    quiet = versions.version_report(("torch",), ranges={"torch": ">=1.0"})
    assert "WARNING" not in quiet and "inside" in quiet


def test_a_package_without_a_declared_range_says_so():
    (check,) = versions.check_versions(("torch",), ranges={})
    assert check.status == "no range declared"


def test_bad_input_says_what_to_pass():
    with pytest.raises(ValueError, match="Cannot read the version"):
        versions.in_range("latest", ">=1.0")
    with pytest.raises(ValueError, match="Cannot read the version bound"):
        versions.in_range("1.0", "about 2")
    with pytest.raises(TypeError, match="list of package names"):
        versions.check_versions("torch")
    with pytest.raises(ValueError, match="not installed as a package"):
        versions.declared_ranges("no-such-distribution")
    assert versions.version_report(ranges=None).count("\n") >= 1  # the real environment: a table
