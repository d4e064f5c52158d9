"""Installed library versions against the ranges course_utils declares (its package metadata), read as pip reads
them (PEP 440)."""
from __future__ import annotations

from collections import namedtuple
from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

PACKAGES = ("torch", "transformers", "ipywidgets", "bitsandbytes")


def in_range(version: str, specifier: str) -> bool:
    """True when ``version`` meets every clause of ``specifier`` (e.g. '>=2.6,<=2.14.1'; '' = any), read as pip
    reads them (PEP 440): '2.14.1+cu130' compares as 2.14.1 against a bound, '2.5.0rc1' comes before '2.5.0'."""
    try:
        installed = Version(version.strip())
    except InvalidVersion:
        raise ValueError(f"Cannot read the version {version!r}: expected numbers separated by dots, e.g. '2.6.0'.") from None
    try:
        spec = SpecifierSet(specifier.replace(" ", ""))
    except InvalidSpecifier:
        raise ValueError(f"Cannot read the version bound {specifier!r}: expected e.g. '>=2.6' or '<=2.14.1'.") from None
    return spec.contains(installed)


def declared_ranges(distribution: str = "course_utils") -> dict:
    """{package: specifier} from the installed ``distribution``'s requirements (extras included)."""
    try:
        requirements = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError as err:
        raise ValueError(f"{distribution} is not installed as a package, so its tested version ranges are unknown: "
                         f"install it (`pip install -e .` in the course folder) and run this again.") from err
    ranges: dict = {}
    for line in requirements:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        name, spec = canonicalize_name(requirement.name), str(requirement.specifier)
        ranges[name] = ",".join(c for c in (ranges.get(name, ""), spec) if c)
    return ranges


# one package: its installed version (None if missing), the tested range ('' if none) and the verdict ('ok',
# 'outside', 'not installed' or 'no range declared')
VersionCheck = namedtuple("VersionCheck", "package installed tested status")


def check_versions(packages=PACKAGES, *, ranges: dict | None = None) -> list:
    """A :class:`VersionCheck` per package; ``ranges`` defaults to :func:`declared_ranges`."""
    if isinstance(packages, str) or not all(isinstance(p, str) for p in packages):
        raise TypeError("packages must be a list of package names, e.g. ['torch', 'transformers'].")
    ranges = declared_ranges() if ranges is None else {canonicalize_name(k): v for k, v in ranges.items()}
    checks = []
    for package in packages:
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            installed = None
        tested = ranges.get(canonicalize_name(package))
        status = ("not installed" if installed is None else "no range declared" if tested is None
                  else "ok" if in_range(installed, tested) else "outside")
        checks.append(VersionCheck(package, installed, tested or "", status))
    return checks


def version_report(packages=PACKAGES, *, ranges: dict | None = None) -> str:
    """A table of installed versions against the tested ranges, ending with a one-line verdict."""
    try:
        checks = check_versions(packages, ranges=ranges)
    except ValueError as err:
        return f"Version check skipped: {err}"
    lines = [f"{'package':<14}{'installed':<18}{'tested range':<22}status"]
    for c in checks:
        lines.append(f"{c.package:<14}{c.installed or '-':<18}{c.tested or '-':<22}{c.status}" + (
            f"  <- OUTSIDE the tested range: the notebooks may fail; pip install '{c.package}{c.tested}'"
            if c.status == "outside" else ""))
    outside = [c.package for c in checks if c.status == "outside"]
    lines.append(f"WARNING: {', '.join(outside)} outside the tested range: results may differ or cells may fail."
                 if outside else "Every installed package with a declared range is inside it.")
    return "\n".join(lines)
