"""Are the installed libraries inside the versions the course was tested with?

The tested ranges are course_utils' declared requirements, read from the installed package's
metadata (``importlib.metadata.requires("course_utils")``: the dependencies and extras in
``pyproject.toml``), so they are written in one place. :func:`version_report` says, package by
package, whether the installed version is inside its range, and says it loudly when it is not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

PACKAGES = ("torch", "transformers", "ipywidgets", "bitsandbytes")
STATUSES = ("ok", "outside", "not installed", "no range declared")
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*\(?([^;)]*)\)?\s*(;.*)?$")
_CLAUSE = re.compile(r"^\s*(~=|==|!=|<=|>=|<|>)\s*([0-9][0-9A-Za-z.*+!-]*)\s*$")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_version(version: str) -> tuple:
    """A comparable key for a version string: '2.14.1+cu130' -> ((2, 14, 1), 0); '2.5.0rc1' sorts before '2.5.0'.

    The local part (``+cu130``) is ignored; a pre- or dev release counts as before its release.
    """
    if not isinstance(version, str):
        raise TypeError(f"version must be a string such as '2.6.0', not {type(version).__name__}.")
    public = version.strip().split("+")[0]
    match = re.match(r"^v?(\d+(?:\.\d+)*)(.*)$", public)
    if not match:
        raise ValueError(f"Cannot read the version {version!r}: expected numbers separated by dots, e.g. '2.6.0'.")
    release = tuple(int(part) for part in match.group(1).split("."))
    while len(release) > 1 and release[-1] == 0:
        release = release[:-1]
    rest = match.group(2).lower()
    pre = -1 if re.match(r"^[.-]?(a|b|c|rc|alpha|beta|pre|preview|dev)", rest) else 0
    return release, pre


def _satisfies(version: str, clause: str) -> bool:
    match = _CLAUSE.match(clause)
    if not match:
        raise ValueError(f"Cannot read the version bound {clause!r}: expected e.g. '>=2.6' or '<=2.14.1'.")
    op, bound = match.groups()
    have = parse_version(version)

    def starts_with(prefix):
        return (have[0] + (0,) * len(prefix))[:len(prefix)] == prefix

    if bound.endswith(".*"):  # ==2.6.* / !=2.6.*
        inside = starts_with(tuple(int(p) for p in bound[:-2].split(".")))
        return inside if op == "==" else not inside
    want = parse_version(bound)
    if op == "~=":  # compatible release: >= the bound, same release up to the bound's next-to-last part
        parts = tuple(int(p) for p in re.findall(r"\d+", bound.split("+")[0].split("rc")[0]))
        return have >= want and starts_with(parts[:-1] if len(parts) > 1 else parts)
    return {"==": have == want, "!=": have != want, "<=": have <= want, ">=": have >= want,
            "<": have < want, ">": have > want}[op]


def in_range(version: str, specifier: str) -> bool:
    """True when ``version`` meets every clause of ``specifier`` (e.g. '>=2.6,<=2.14.1'; '' = any)."""
    clauses = [c for c in specifier.split(",") if c.strip()]
    return all(_satisfies(version, clause) for clause in clauses)


def declared_ranges(distribution: str = "course_utils") -> dict:
    """{package: specifier} from the installed ``distribution``'s requirements (extras included).

    Raises ValueError when the distribution is not installed (its metadata is where the ranges live).
    """
    try:
        requirements = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError as err:
        raise ValueError(f"{distribution} is not installed as a package, so its tested version ranges are unknown: "
                         f"install it (`pip install -e .` in the course folder) and run this again.") from err
    ranges: dict = {}
    for line in requirements:
        match = _REQUIREMENT.match(line)
        if not match:
            continue
        name, spec = _normalize(match.group(1)), match.group(3).replace(" ", "")
        ranges[name] = ",".join(c for c in (ranges.get(name, ""), spec) if c)
    return ranges


@dataclass(frozen=True)
class VersionCheck:
    """One package: its installed version, the tested range and the verdict (one of ``STATUSES``)."""

    package: str
    installed: str | None
    tested: str
    status: str

    def __str__(self) -> str:
        installed = self.installed or "-"
        tested = self.tested or "-"
        line = f"{self.package:<14}{installed:<18}{tested:<22}{self.status}"
        if self.status == "outside":
            line += f"  <- OUTSIDE the tested range: the notebooks may fail; pip install '{self.package}{self.tested}'"
        return line


def check_versions(packages=PACKAGES, *, ranges: dict | None = None) -> list:
    """A :class:`VersionCheck` per package; ``ranges`` defaults to :func:`declared_ranges`."""
    if isinstance(packages, str) or not all(isinstance(p, str) for p in packages):
        raise TypeError("packages must be a list of package names, e.g. ['torch', 'transformers'].")
    ranges = declared_ranges() if ranges is None else {_normalize(k): v for k, v in ranges.items()}
    checks = []
    for package in packages:
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            installed = None
        tested = ranges.get(_normalize(package))
        if installed is None:
            status = "not installed"
        elif tested is None:
            status = "no range declared"
        else:
            status = "ok" if in_range(installed, tested) else "outside"
        checks.append(VersionCheck(package, installed, tested or "", status))
    return checks


def version_report(packages=PACKAGES, *, ranges: dict | None = None) -> str:
    """A table of installed versions against the tested ranges, ending with a one-line verdict."""
    try:
        checks = check_versions(packages, ranges=ranges)
    except ValueError as err:
        return f"Version check skipped: {err}"
    lines = [f"{'package':<14}{'installed':<18}{'tested range':<22}status"] + [str(c) for c in checks]
    outside = [c.package for c in checks if c.status == "outside"]
    if outside:
        lines.append(f"WARNING: {', '.join(outside)} outside the tested range: results may differ or cells may fail.")
    else:
        lines.append("Every installed package with a declared range is inside it.")
    return "\n".join(lines)
