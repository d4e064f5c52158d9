#!/usr/bin/env python3
"""Rebuild the capstone's offline corpus, course_utils/data_files/course_corpus.txt, from the
markdown prose of notebooks/*.ipynb. It ships inside the package, so the capstone trains on it
wherever the course is installed (Colab included) without a download. Run it after editing the
notebooks' prose:

    python scripts/build_corpus.py           # rewrite the file
    python scripts/build_corpus.py --check   # exit 1 if the file differs from the notebooks' prose
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from course_utils import capstone, paths  # noqa: E402

CREDIT = ('Markdown prose of the notebooks of the course "When the model does not fit" (MIT license, '
          "the course authors); made by scripts/build_corpus.py.")


def corpus_text() -> str:
    prose = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        prose.append("\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown"))
    text = "\n\n".join(p for p in prose if p)
    return f"{CREDIT}\n\n{text.strip()}\n"


def main() -> int:
    target = paths.DATA_DIR / capstone.CORPUS_FILE
    text = corpus_text()
    if "--check" in sys.argv[1:]:
        current = target.read_text(encoding="utf-8") if target.is_file() else ""
        if current != text:
            print(f"{target.relative_to(ROOT)} is out of date with the notebooks: run python scripts/build_corpus.py")
            return 1
        print(f"{target.relative_to(ROOT)} matches the notebooks' prose.")
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")
    print(f"Wrote {target.relative_to(ROOT)}: {len(text):,} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
