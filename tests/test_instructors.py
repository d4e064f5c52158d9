"""INSTRUCTORS.md: linked from the README, and every message its troubleshooting table quotes is one the
course really prints (a renamed message would otherwise leave instructors searching for text that no longer exists)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "INSTRUCTORS.md"

# fragments the table quotes, each of which must appear in the product's sources
QUOTED = [
    "course_utils is not installed: run `make lab` in the course folder",
    "No GPU attached. On Colab: Runtime > Change runtime type > T4 GPU, then re-run.",
    "outside the tested range: results may differ or cells may fail.",
    "Host RAM: ",
    "tokenizer offline (",
    "is not a profile; set it to one of",
    "-> fix: ",
]


def _product_text() -> str:
    files = [*ROOT.glob("course_utils/**/*.py"), *ROOT.glob("course_tools/**/*.py"), *ROOT.glob("notebooks/*.ipynb")]
    return "\n".join(p.read_text(errors="replace").replace('\\"', '"') for p in files)


def test_guide_is_linked_from_the_readme():
    assert GUIDE.is_file()
    assert "(INSTRUCTORS.md)" in (ROOT / "README.md").read_text()


def test_quoted_messages_exist_in_the_product():
    guide = GUIDE.read_text()
    product = _product_text()
    for fragment in QUOTED:
        assert fragment.replace("`", "") in guide.replace("`", ""), f"INSTRUCTORS.md no longer quotes {fragment!r}"
        assert fragment in product, f"the course no longer prints {fragment!r}: update INSTRUCTORS.md's table"


def test_every_notebook_has_objectives_in_the_guide():
    guide = GUIDE.read_text()
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb")):
        number = re.match(r"(\d\d[a-z]?)_", path.name).group(1)
        assert f"**{number} · " in guide, f"INSTRUCTORS.md has no objectives for {path.name}"


def test_binder_builds_from_the_course_requirements_and_points_at_this_repository():
    from course_tools import colab

    post_build = (ROOT / "binder" / "postBuild").read_text()
    assert "-r requirements.txt" in post_build and "-e ." in post_build, "Binder installs what `make install` does"
    assert "whl/cpu" in post_build, "Binder has no GPU: the CPU build of torch"
    assert "COURSE_PROFILE=smoke" in (ROOT / "binder" / "start").read_text()
    owner_name = colab.canonical_repo_url().removeprefix("https://github.com/")
    assert f"mybinder.org/v2/gh/{owner_name}/main" in (ROOT / "README.md").read_text(), \
        "the README's Binder badge must point at pyproject's Repository URL"
