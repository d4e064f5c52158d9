#!/usr/bin/env python3
"""Rewrite every Colab badge (README + notebooks) and every bootstrap cell's COURSE_REPO from
pyproject.toml's [project.urls] Repository. Run it after changing that URL:

    python scripts/sync_colab.py          # rewrite
    python scripts/sync_colab.py --check  # exit 1 and list files that are out of date
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from course_tools.colab import canonical_repo_url, sync  # noqa: E402


def main() -> int:
    check = "--check" in sys.argv[1:]
    changed = sync(check=check)
    url = canonical_repo_url()
    if check:
        if changed:
            print("Out of date with " + url + ": " + ", ".join(changed) + "\nRun: python scripts/sync_colab.py")
            return 1
        print(f"All badges and bootstrap cells point at {url}.")
        return 0
    print(f"Rewrote {len(changed)} file(s) to {url}: {', '.join(changed) or 'nothing to do'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
