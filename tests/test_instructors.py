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


def _section(title: str) -> str:
    guide = GUIDE.read_text()
    start = guide.index(title)
    return guide[start:guide.index("\n#", start + len(title))]


def test_the_four_day_plan_covers_every_notebook_at_its_study_time():
    """Every notebook of the study-times table appears once, with the table's study minutes (run time included),
    and each day's total is the sum of its notebooks."""
    table = GUIDE.read_text().split("<!-- study-times:begin -->")[1].split("<!-- study-times:end -->")[0]
    study = {n: int(m) for n, m in re.findall(r"^\| (\d\d[a-z]?)_\w+ \|.* (\d+) min \|$", table, re.M)}
    in_table = list(study)
    planned = []
    days = re.findall(r"^\| (\d) \| (.+) \| (\d+) min \|$", _section("### Four-day course"), re.M)
    assert len(days) == 4, "the four-day plan has a row per day"
    for day, notebooks, total in days:
        entries = re.findall(r"(\d\d[a-z]?) \((\d+)\)", notebooks)
        for number, minutes in entries:
            assert int(minutes) == study[number], f"day {day}: {number} studies in {study[number]} min, not {minutes}"
        assert sum(int(m) for _, m in entries) == int(total), f"day {day}'s notebooks do not add up to {total} min"
        planned += [number for number, _ in entries]
    assert sorted(planned) == sorted(in_table), f"the plan lists {sorted(planned)}, the table {sorted(in_table)}"
    assert {f"{n:02d}" for n in range(10)} <= set(planned), "00-09 are all in the plan"


def test_the_half_day_workshop_adds_up():
    rows = re.findall(r"^\| (\d):(\d\d) \| .*\((\d+) min", _section("### Half-day workshop"), re.M)
    starts = [60 * int(h) + int(m) for h, m, _ in rows]
    ends = [start + int(minutes) for start, (_, _, minutes) in zip(starts, rows)]
    assert starts[0] == 0 and starts[1:] == ends[:-1], "each slot starts when the one before ends"
    assert ends[-1] == 210, "the slots fill the 3.5 hours"


def test_the_study_times_table_is_counted_from_the_notebooks_as_they_are():
    """The table's study minutes are study_times' count of each notebook now, plus its run time: a notebook that
    grows or shrinks needs the table regenerated (python -m course_tools.study_times)."""
    from course_tools import study_times

    table = GUIDE.read_text().split("<!-- study-times:begin -->")[1].split("<!-- study-times:end -->")[0]
    for name, run_s, minutes in re.findall(r"^\| (\d\d[a-z]?_\w+) \|.*\| (\d+) s \| (\d+) min \|$", table, re.M):
        counted = study_times.count(ROOT / "notebooks" / f"{name}.ipynb", float(run_s)).study_minutes
        assert abs(counted - int(minutes)) <= 1, f"{name}: counted {counted:.0f} min, the table says {minutes}"
