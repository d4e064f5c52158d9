"""Every notebook follows the course anatomy: Colab badge from the canonical URL, the bootstrap
cell first, a `parameters` settings cell, an exercise, a recap, and a place in the README."""
import json
import re
import shutil
from pathlib import Path

import pytest

from course_tools import colab

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))  # 01b_... too
URL = colab.canonical_repo_url()

BOOTSTRAP = re.compile(
    r'^# Setup\. On Colab this installs the course helpers.*\n'
    r'(#.*\n)*'
    r'import importlib\.util, os, subprocess, sys\n'
    r'COURSE_REPO = "(?P<url>[^"]+)"\n'
    r'if importlib\.util\.find_spec\("course_utils"\) is None:\n'
    r'    if "google\.colab" not in sys\.modules and "COURSE_INSTALL_SPEC" not in os\.environ:\n'
    r'        raise ImportError\(.*\n(.*\n)?'
    r'    spec = os\.environ\.get\("COURSE_INSTALL_SPEC", f"git\+\{COURSE_REPO\}"\)\n'
    r'    subprocess\.run\(\[sys\.executable, "-m", "pip", "install", "-q", "--no-deps", spec\], check=True\)\n'
    r'import course_utils\n'
    r'course_utils\.bootstrap\.ensure_packages\(\[(?P<packages>[^\]]*)\](,\s*optional=\{(?P<optional>[^}]*)\})?\)\n'
    r'PROFILE = course_utils\.setup\("(?P<name>[^"]+)"\)\s*$'
)


def _cells(path):
    nb = json.loads(path.read_text())
    return [(c["cell_type"], "".join(c["source"]), c.get("metadata", {})) for c in nb["cells"]]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_title_cell_has_badge_with_canonical_url(path):
    kind, source, _ = _cells(path)[0]
    assert kind == "markdown" and source.startswith("# "), "the first cell is the title"
    assert colab.badge(URL, f"notebooks/{path.name}") in source, "run: python scripts/sync_colab.py"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_first_code_cell_is_the_bootstrap(path):
    code = [source for kind, source, _ in _cells(path) if kind == "code"]
    match = BOOTSTRAP.match(code[0])
    assert match, f"{path.name}: the first code cell must be the standard bootstrap cell"
    assert match["url"] == URL
    assert match["name"] == path.stem, "course_utils.setup() must name the notebook after its file"
    asked = set(re.findall(r"[\"'](\w+)[\"']", match["packages"]))
    asked |= set(re.findall(r"[\"'](\w+)[\"']\s*:", match["optional"] or ""))
    assert not asked & {"torch", "torchvision", "torchaudio"}, "the bootstrap never installs torch"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_anatomy(path):
    cells = _cells(path)
    assert any("parameters" in meta.get("tags", []) for kind, _, meta in cells if kind == "code"), \
        "one settings cell tagged `parameters`"
    markdown = "\n".join(source for kind, source, _ in cells if kind == "markdown").lower()
    assert "recap" in markdown
    assert "exercise" in markdown
    assert "question" in markdown
    code = "\n".join(source for kind, source, _ in cells if kind == "code")
    assert re.search(r"check_\w*\(", code), "an exercise with an auto-check (checks.check_exercise or a check_* helper)"
    assert re.search(r"\brecord\(", code), "headline figures are recorded (course_utils.results.record)"
    assert "torch.cuda.amp" not in code, "use torch.amp (torch.cuda.amp is deprecated)"


def test_readme_syllabus_lists_every_notebook_with_badge():
    readme = (ROOT / "README.md").read_text()
    for path in NOTEBOOKS:
        assert f"notebooks/{path.name}" in readme
        assert colab.badge(URL, f"notebooks/{path.name}") in readme


def test_everything_in_sync_with_pyproject_url():
    assert colab.sync(check=True) == [], "run: python scripts/sync_colab.py"


def test_sync_rewrites_a_changed_url(tmp_path):
    (tmp_path / "notebooks").mkdir()
    for path in NOTEBOOKS[:1]:
        shutil.copy(path, tmp_path / "notebooks" / path.name)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    text = (ROOT / "pyproject.toml").read_text().replace(URL, "https://github.com/someone-else/fork")
    (tmp_path / "pyproject.toml").write_text(text)
    changed = colab.sync(tmp_path)
    assert "README.md" in changed
    if NOTEBOOKS:
        nb_text = (tmp_path / "notebooks" / NOTEBOOKS[0].name).read_text()
        assert "someone-else/fork" in nb_text and URL not in nb_text
    assert colab.sync(tmp_path, check=True) == []


def test_bad_repository_url(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project.urls]\nRepository = "not a url"\n')
    with pytest.raises(ValueError, match="GitHub URL"):
        colab.canonical_repo_url(tmp_path / "pyproject.toml")


# ---------------------------------------------------------------------------- the lesson lives in the notebook
LESSONS = [p for p in NOTEBOOKS if not p.stem.startswith("00_")]  # 00 is the tour: no lesson to predict


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_predict_then_measure(path):
    cells = _cells(path)
    predicts = [source for kind, source, meta in cells if kind == "code" and "predict" in meta.get("tags", [])]
    assert len(predicts) >= 3, f"{path.name}: at least 3 cells tagged `predict` before headline measurements"
    code = "\n".join(source for kind, source, _ in cells if kind == "code")
    assert code.count("compare_prediction(") >= 3, "each prediction is compared with its measurement"
    assert re.search(r'record\(\s*"prediction_cells"', code), "the notebook records prediction_cells"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_solutions_are_hidden(path):
    cells = _cells(path)
    solutions = [(source, meta) for kind, source, meta in cells if kind == "code" and "solution" in meta.get("tags", [])]
    assert solutions, f"{path.name}: an exercise solution in a cell tagged `solution`"
    for source, meta in solutions:
        assert meta.get("jupyter", {}).get("source_hidden") is True, "hidden in JupyterLab"
        assert meta.get("cellView") == "form" and source.startswith("#@title"), "hidden on Colab (a form cell)"


def test_start_here_maps_every_notebook():
    """00's map links every notebook of the course (a new one joins the map when it joins the course)."""
    start = next(p for p in NOTEBOOKS if p.name.startswith("00_"))
    text = "\n".join(source for kind, source, _ in _cells(start) if kind == "markdown")
    missing = [p.name for p in NOTEBOOKS if f"]({p.name})" not in text]
    assert not missing, f"00's map does not link {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_checkers_are_proven_in_the_tests(path):
    """A notebook keeps the learner's check; the proof that it rejects wrong answers is test scaffolding, and runs
    in tests/ (notebook_lessons.checker_rejects)."""
    code = "\n".join(source for kind, source, _ in _cells(path) if kind == "code")
    assert "checker_rejects" not in code, f"{path.name}: move the checker's rejection proof into tests/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_package_source_printed(path):
    code = "\n".join(source for kind, source, _ in _cells(path) if kind == "code")
    assert "getsource" not in code, "the lesson's code lives in the notebook's cells, not printed from the package"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_product_text_stands_alone(path):
    text = path.read_text()
    assert "../shared" not in text and "shared/seeds" not in text, "nothing outside the repository is read or cited"
    assert not re.search(r"\bissue #?\d+", text, re.I), "no issue numbers in product text"
    assert not re.search(r"\bseed articles?\b|\bthe seed's\b|\bseed 00[0-3]\b", text, re.I), "cite the articles by title"


def test_product_files_stand_alone():
    """No product file reads or cites a folder outside the repository, names an issue, or says 'seed article'."""
    files = [*ROOT.glob("course_utils/**/*.py"), *ROOT.glob("course_tools/**/*.py"), *ROOT.glob("scripts/*"),
             ROOT / "README.md", *ROOT.glob("INSTRUCTORS.md"), *ROOT.glob("course_utils/data_files/*.txt")]
    offenders = []
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if "../shared" in text or "shared/seeds" in text or re.search(r"\(issue \d+\)|\bissue #?1\d\b", text) \
                or re.search(r"\bseed articles?\b|\bthe seed's\b", text, re.I):
            offenders.append(path.relative_to(ROOT).as_posix())
    assert not offenders, f"product files that do not stand alone: {offenders}"


# ---------------------------------------------------------------------------- predict, then see; pictures
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_answer_is_shown_before_it_is_predicted(path):
    """Predict cells are saved empty; the cells that show their answers, and solutions, are saved without output
    (`make outputs` refreshes a notebook and hides them: course_tools.hide_answers)."""
    from course_tools import hide_answers

    problems = hide_answers.problems(json.loads(path.read_text(encoding="utf-8")))
    assert not problems, f"{path.name}: {problems}; run python -m course_tools.hide_answers {path.name}"


FIGURE_CALL = re.compile(r"plt\.subplots|plt\.figure|sns\.\w+plot\(|\bplot_\w+\(|\.plot\(")


@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_at_least_two_titled_figures(path):
    drawn = [source for kind, source, _ in _cells(path)
             if kind == "code" and FIGURE_CALL.search(source) and "title" in source]
    assert len(drawn) >= 2, f"{path.name}: {len(drawn)} cell(s) draw a titled figure; results people compare are plotted"


# ---------------------------------------------------------------------------- one explanation per idea, one number
SECTION_LINK = re.compile(r"\]\((?:\.\./)?(?:notebooks/)?(?P<nb>\d\d\w*\.ipynb)#(?P<anchor>[\w-]+)\)")
ANCHOR = re.compile(r'<a id="([\w-]+)"></a>')
# each idea explained once, where it is first needed; later notebooks and the glossary link to it
HOMES = {"16-bytes-per-parameter": "01_memory_accounting", "fake-tensors": "01_memory_accounting",
         "attention-kernels": "01_memory_accounting", "four-numbers": "01b_reading_gpu_memory",
         "pcie": "06_capstone_gpt2_xl", "cuda-streams": "09_smaller_than_the_model"}


def _anchors(path):
    return set(ANCHOR.findall("\n".join(source for kind, source, _ in _cells(path) if kind == "markdown")))


def test_every_section_link_reaches_its_anchor():
    """A link `NN_topic.ipynb#name` (notebooks, glossary) lands on an `<a id="name"></a>` in that notebook."""
    anchors = {path.name: _anchors(path) for path in NOTEBOOKS}
    texts = {path.name: "\n".join(s for kind, s, _ in _cells(path) if kind == "markdown") for path in NOTEBOOKS}
    texts["GLOSSARY.md"] = (ROOT / "GLOSSARY.md").read_text(encoding="utf-8")
    broken = [f"{where}: {m['nb']}#{m['anchor']}" for where, text in texts.items() for m in SECTION_LINK.finditer(text)
              if m["anchor"] not in anchors.get(m["nb"], set())]
    assert not broken, f"links to sections that do not exist (add <a id=...></a> there or fix the link): {broken}"


def test_each_idea_has_one_home_that_the_glossary_and_later_notebooks_link():
    glossary = (ROOT / "GLOSSARY.md").read_text(encoding="utf-8")
    links = {(m["nb"], m["anchor"]) for path in NOTEBOOKS for kind, s, _ in _cells(path) if kind == "markdown"
             for m in SECTION_LINK.finditer(s)}
    for anchor, home in HOMES.items():
        holders = [path.stem for path in NOTEBOOKS if anchor in _anchors(path)]
        assert holders == [home], f"'{anchor}' is explained in {holders}; it lives in {home} only"
        assert f"{home}.ipynb#{anchor})" in glossary, f"GLOSSARY.md must point to {home}.ipynb#{anchor}"
        assert (f"{home}.ipynb", anchor) in links, f"no notebook links back to {home}.ipynb#{anchor}"


PCIE_COPIES = re.compile(r"PCIE_GB_PER_S|PCIE_EFFICIENCY|\.pcie_gbs\b|\b(?:15\.75|31\.5|63\.0)\b|transfer_seconds")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_pcie_is_priced_by_one_function(path):
    """Copy times come from hardware.pcie_seconds / pcie_table (or a measured rate through it), never from the
    table's constants or a notebook's own formula, so two notebooks cannot show two numbers for one quantity."""
    code = [(i, line) for i, (kind, source, _) in enumerate(_cells(path)) if kind == "code"
            for line in source.splitlines() if PCIE_COPIES.search(line)]
    assert not code, f"{path.name}: price PCIe with hardware.pcie_seconds / hardware.pcie_table, not {code}"
