"""One canonical repository URL (pyproject's ``[project.urls] Repository``) for every Colab
badge and bootstrap cell. ``scripts/sync_colab.py`` rewrites them when the URL changes;
``tests/test_notebook_structure.py`` fails when they drift.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # the course checkout these tools maintain
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
_BADGE_RE = re.compile(r"\[!\[Open In Colab\]\(https://colab\.research\.google\.com/assets/colab-badge\.svg\)\]"
                       r"\(https://colab\.research\.google\.com/github/[^)\s]+\)")
_REPO_LINE_RE = re.compile(r'^COURSE_REPO = "[^"]*"$', re.M)


def canonical_repo_url(pyproject: Path | None = None) -> str:
    """``https://github.com/OWNER/NAME`` from pyproject.toml's [project.urls] Repository."""
    import tomllib

    path = Path(pyproject or REPO_ROOT / "pyproject.toml")
    if not path.is_file():
        raise ValueError(f"No pyproject.toml at {path}: the Colab tools work on a checkout of the course repository.")
    data = tomllib.loads(path.read_text())
    url = data.get("project", {}).get("urls", {}).get("Repository", "")
    if not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url.rstrip("/")):
        raise ValueError(
            f"pyproject.toml [project.urls] Repository is {url!r}; set it to the course's GitHub URL, "
            "e.g. https://github.com/OWNER/NAME (Colab opens notebooks from GitHub)."
        )
    return url.rstrip("/")


def colab_url(repo_url: str, notebook_path: str, branch: str = "main") -> str:
    owner_name = repo_url.removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{owner_name}/blob/{branch}/{notebook_path}"


def badge(repo_url: str, notebook_path: str) -> str:
    return f"[![Open In Colab]({BADGE_IMAGE})]({colab_url(repo_url, notebook_path)})"


def _sync_notebook(path: Path, repo_url: str, root: Path) -> bool:
    nb = json.loads(path.read_text())
    rel = path.relative_to(root).as_posix()
    changed = False
    for cell in nb["cells"]:
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        new = source
        if cell["cell_type"] == "markdown":
            new = _BADGE_RE.sub(badge(repo_url, rel), source)
        elif cell["cell_type"] == "code":
            new = _REPO_LINE_RE.sub(f'COURSE_REPO = "{repo_url}"', source)
        if new != source:
            cell["source"] = new.splitlines(keepends=True)
            changed = True
    if changed:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    return changed


def _sync_readme(path: Path, repo_url: str) -> bool:
    text = path.read_text()

    def replace(match: re.Match) -> str:
        notebook = re.search(r"/blob/[^/]+/(notebooks/[^)\s]+\.ipynb)", match.group(0))
        return badge(repo_url, notebook.group(1)) if notebook else match.group(0)

    new = _BADGE_RE.sub(replace, text)
    if new != text:
        path.write_text(new)
    return new != text


def sync(root: Path | None = None, *, check: bool = False) -> list[str]:
    """Rewrite badges and bootstrap URLs to the canonical URL; return the files that differ.

    With ``check=True`` nothing is written (files are compared on copies).
    """
    root = Path(root or REPO_ROOT)
    repo_url = canonical_repo_url(root / "pyproject.toml")
    targets = sorted((root / "notebooks").glob("*.ipynb")) + [root / "README.md"]
    out_of_sync = []
    for path in targets:
        if not path.exists():
            continue
        original = path.read_text()
        changed = _sync_notebook(path, repo_url, root) if path.suffix == ".ipynb" else _sync_readme(path, repo_url)
        if changed:
            out_of_sync.append(path.relative_to(root).as_posix())
            if check:
                path.write_text(original)
    return out_of_sync
