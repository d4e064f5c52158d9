"""course_utils.bootstrap: a notebook's required packages and the optional ones it can do without. Installs only
what is missing, only where it can (Colab; a writable virtual environment with the network up), never torch;
elsewhere a missing required package stops the notebook with what to run, a missing optional one prints one line.
Quick: nothing here installs or reaches the network (tests/test_without_optional.py runs the notebooks without them)."""
import importlib
import importlib.util
import json
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from course_utils import bootstrap, hardware
from stand_ins import stand_in

ROOT = Path(__file__).resolve().parent.parent


def hide(monkeypatch, *names):
    """bootstrap sees ``names`` as not installed (find_spec None, import fails): only bootstrap, nothing else."""
    def find_spec(name, *args):
        return None if name in names else importlib.util.find_spec(name, *args)

    def import_module(name, *args):
        if name.split(".")[0] in names:
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}", name=name.split(".")[0])
        return importlib.import_module(name, *args)

    fake = stand_in(importlib, util=stand_in(importlib.util, find_spec=find_spec), import_module=import_module)
    monkeypatch.setattr(bootstrap, "importlib", fake)


def offline(monkeypatch, why="cannot install here: no network"):
    monkeypatch.setattr(bootstrap, "can_install", lambda: (False, why))


def test_nothing_missing_here(capsys):
    assert bootstrap.ensure_packages(["timm", "seaborn"], optional={"bitsandbytes": "section 3"}) == []
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("call, error, message", [
    (lambda: bootstrap.missing_packages(["not_a_course_package"]), ValueError, "knows"),
    (lambda: bootstrap.ensure_packages("seaborn"), TypeError, "list of import names"),
    (lambda: bootstrap.ensure_packages(["seaborn"], optional={"nope": "x"}), ValueError, "knows"),
    (lambda: bootstrap.ensure_packages(["seaborn"], optional=["torch"]), ValueError, "cannot be optional"),
    (lambda: bootstrap.ensure_packages(["seaborn"], optional=["seaborn"]), ValueError, "both required and optional"),
    (lambda: bootstrap.available(""), TypeError, "module name"),
    (lambda: bootstrap.available("not_a_course_package"), ValueError, "knows"),
])
def test_bad_input_says_what_to_give(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_missing_required_offline_tells_how_to_install(monkeypatch):
    hide(monkeypatch, "mlxtend")
    offline(monkeypatch)
    with pytest.raises(ImportError, match=r"Missing package\(s\) \['mlxtend'\] \(cannot install here: no network\)"
                                          r".*make lab.*'mlxtend>=0.23'"):
        bootstrap.ensure_packages(["mlxtend", "seaborn"])


def test_missing_optional_prints_one_line_per_package_and_returns(monkeypatch, capsys):
    hide(monkeypatch, "bitsandbytes", "torchao")
    offline(monkeypatch)
    parts = {"bitsandbytes": "section 3's 8-bit AdamW and the StableEmbedding demo", "torchao": "section 4's rows"}
    assert bootstrap.ensure_packages(["seaborn"], optional=parts) == []
    assert capsys.readouterr().out.splitlines() == [
        "[course] bitsandbytes is not installed: skipping section 3's 8-bit AdamW and the StableEmbedding demo "
        "(`pip install bitsandbytes` adds it).",
        "[course] torchao is not installed: skipping section 4's rows (`pip install torchao` adds it)."]


def test_optional_as_a_list_gets_a_general_line(monkeypatch, capsys):
    hide(monkeypatch, "lion_pytorch")
    offline(monkeypatch)
    bootstrap.ensure_packages(["seaborn"], optional=["lion_pytorch", "bitsandbytes"])
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("[course] lion-pytorch is not installed: the parts of this notebook that use it are "
                           "skipped, each with a line"), line


def test_a_missing_required_package_stops_even_when_optional_ones_are_missing_too(monkeypatch):
    hide(monkeypatch, "mlxtend", "bitsandbytes")
    offline(monkeypatch)
    with pytest.raises(ImportError, match="mlxtend"):
        bootstrap.ensure_packages(["mlxtend"], optional=["bitsandbytes"])


class FakePip:
    """pip as a stand-in: records each install; the names in ``fails`` fail; the others are installed after it."""

    def __init__(self, monkeypatch, hidden, fails=()):
        self.calls, self.constraints, self.hidden, self.fails = [], [], set(hidden), set(fails)
        self.monkeypatch = monkeypatch
        hide(monkeypatch, *self.hidden)
        monkeypatch.setattr(bootstrap, "subprocess", stand_in(subprocess, run=self.run))

    def run(self, cmd, check):
        assert cmd[1:4] == ["-m", "pip", "install"] and check
        self.calls.append(cmd)
        self.constraints.append(Path(cmd[cmd.index("-c") + 1]).read_text())
        names = {re.split(r"[<>=]", part)[0] for part in cmd[cmd.index("-c") + 2:]}
        if names & self.fails:
            raise subprocess.CalledProcessError(1, cmd)
        self.hidden -= {n.replace("-", "_") for n in names} | {"sklearn" for n in names if n == "scikit-learn"}
        hide(self.monkeypatch, *self.hidden)


def test_colab_installs_only_the_missing_and_never_torch(monkeypatch, capsys):
    monkeypatch.delenv("COURSE_NO_INSTALL", raising=False)
    monkeypatch.setattr(hardware, "in_colab", lambda: True)
    pip = FakePip(monkeypatch, hidden=["mlxtend", "timm", "bitsandbytes"])
    installed = bootstrap.ensure_packages(["mlxtend", "timm", "seaborn"], optional={"bitsandbytes": "section 3"})
    assert installed == ["mlxtend", "timm", "bitsandbytes"]
    required, optional = pip.calls
    assert "mlxtend>=0.23" in required and "timm>=1.0" in required and "bitsandbytes>=0.50" in optional
    assert not any(part.startswith("torch") for cmd in pip.calls for part in cmd)
    torch_pin = f"torch=={importlib.metadata.version('torch')}"
    assert all(torch_pin in text.splitlines() for text in pip.constraints), "the installed torch is pinned"
    assert "is not installed" not in capsys.readouterr().out


def test_an_optional_package_that_fails_to_install_is_skipped_with_a_line(monkeypatch, capsys):
    monkeypatch.setattr(bootstrap, "can_install", lambda: (True, ""))
    pip = FakePip(monkeypatch, hidden=["bitsandbytes", "lion_pytorch"], fails=["bitsandbytes"])
    assert bootstrap.ensure_packages(["seaborn"], optional={"bitsandbytes": "section 3", "lion_pytorch": "Lion"}) \
        == ["lion_pytorch"]
    assert len(pip.calls) == 2, "one at a time: the one that fails leaves the other"
    out = capsys.readouterr().out
    assert "could not install bitsandbytes" in out and "could not install lion" not in out
    assert out.splitlines()[-1] == "[course] bitsandbytes is not installed: skipping section 3 (`pip install " \
                                   "bitsandbytes` adds it)."


def test_a_required_package_that_fails_to_install_raises(monkeypatch):
    monkeypatch.setattr(bootstrap, "can_install", lambda: (True, ""))
    FakePip(monkeypatch, hidden=["mlxtend"], fails=["mlxtend"])
    with pytest.raises(ImportError, match=r"Missing package\(s\) \['mlxtend'\] \(pip failed: "
                                          r".*pip install 'mlxtend>=0.23'"):
        bootstrap.ensure_packages(["mlxtend"])


def test_missing_torch_is_never_installed(monkeypatch):
    hide(monkeypatch, "torch")
    monkeypatch.setattr(hardware, "in_colab", lambda: True)
    with pytest.raises(ImportError, match="never installs torch"):
        bootstrap.ensure_packages(["torch"])


def test_installs_only_where_it_can(monkeypatch):
    monkeypatch.setenv("COURSE_NO_INSTALL", "1")
    assert bootstrap.can_install() == (False, "cannot install here: COURSE_NO_INSTALL is set")
    monkeypatch.delenv("COURSE_NO_INSTALL")
    monkeypatch.setattr(hardware, "in_colab", lambda: True)
    assert bootstrap.can_install() == (True, "")
    monkeypatch.setattr(hardware, "in_colab", lambda: False)
    monkeypatch.setattr(bootstrap, "sys", stand_in(bootstrap.sys, prefix="/usr", base_prefix="/usr"))
    assert bootstrap.can_install() == (False, "cannot install here: not a virtual environment the course may "
                                              "install into")


def test_offline_is_found_quickly_even_when_the_name_lookup_hangs(monkeypatch):
    def hangs(address, timeout):
        time.sleep(30)

    monkeypatch.setattr(bootstrap, "socket", stand_in(socket, create_connection=hangs))
    start = time.perf_counter()
    assert bootstrap.network_up(timeout=0.3) is False
    assert time.perf_counter() - start < 2


def test_offline_venv_does_not_install(monkeypatch):
    def refused(address, timeout):
        raise OSError(101, "Network is unreachable")

    monkeypatch.delenv("COURSE_NO_INSTALL", raising=False)
    monkeypatch.setattr(hardware, "in_colab", lambda: False)
    monkeypatch.setattr(bootstrap, "sys", stand_in(bootstrap.sys, prefix="/venv", base_prefix="/usr"))
    monkeypatch.setattr(bootstrap, "os", stand_in(bootstrap.os, access=lambda path, mode: True,
                                                  environ={}))
    monkeypatch.setattr(bootstrap, "socket", stand_in(socket, create_connection=refused))
    assert bootstrap.can_install() == (False, "cannot install here: no network")


def test_available_says_what_is_skipped(monkeypatch, capsys):
    assert bootstrap.available("tqdm") and bootstrap.available("tqdm", skipping="the progress bars")
    hide(monkeypatch, "bitsandbytes", "torchao")
    assert not bootstrap.available("bitsandbytes")          # ensure_packages said so already: no second line
    assert capsys.readouterr().out == ""
    assert not bootstrap.available("torchao.optim", skipping="the 4-bit AdamW rows")
    assert capsys.readouterr().out == ("[course] torchao is not installed: skipping the 4-bit AdamW rows "
                                       "(`pip install torchao` adds it).\n")


def test_available_reports_a_package_that_is_installed_but_does_not_import(monkeypatch, capsys):
    def import_module(name, *args):
        raise ModuleNotFoundError("No module named 'accelerate'", name="accelerate")  # peft without its dependency

    monkeypatch.setattr(bootstrap, "importlib", stand_in(importlib, import_module=import_module))
    assert not bootstrap.available("peft")
    assert capsys.readouterr().out == ("[course] peft is installed but does not import here (ModuleNotFoundError: "
                                       "No module named 'accelerate'): skipping what needs it.\n")


def test_pip_names():
    assert [bootstrap.pip_name(n) for n in ("lion_pytorch", "torchao.optim", "sklearn", "torch")] == \
        ["lion-pytorch", "torchao", "scikit-learn", "torch"]


def test_what_colab_installs_matches_requirements_txt():
    """The bootstrap's pip specs are the learner install's, so Colab gets the same lower bounds."""
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    specs = {re.split(r"[<>=!~ ]", s)[0].lower(): s for s in (line.split("#")[0].strip() for line in lines) if s}
    for requirement in bootstrap.COURSE_PACKAGES.values():
        name = re.split(r"[<>=!~ ]", requirement)[0].lower()
        assert specs.get(name) == requirement, f"bootstrap asks {requirement!r}, requirements.txt {specs.get(name)!r}"


def _setup_calls():
    """{notebook stem: (required, optional)} from each notebook's first code cell."""
    calls = {}
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        source = "".join(next(c for c in cells if c["cell_type"] == "code")["source"])
        match = re.search(r"ensure_packages\((\[[^\]]*\])(?:,\s*optional=(\{[^}]*\}))?\)", source)
        calls[path.stem] = (eval(match[1]), eval(match[2]) if match[2] else {})  # noqa: S307 - literals only
    return calls


def test_notebooks_mark_only_the_optional_packages_optional():
    for stem, (required, optional) in _setup_calls().items():
        assert set(optional) <= set(bootstrap.OPTIONAL_PACKAGES), f"{stem}: {set(optional)} are not optional packages"
        assert not set(required) & set(bootstrap.OPTIONAL_PACKAGES), \
            f"{stem} requires {set(required) & set(bootstrap.OPTIONAL_PACKAGES)}: name them in optional= with the parts"
        assert all(isinstance(v, str) and v for v in optional.values()), f"{stem}: say which parts each one runs"


def test_the_readme_says_what_each_optional_package_adds():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Optional packages", 1)[-1].split("\n## ", 1)[0]
    assert "## Optional packages" in readme
    for name in bootstrap.OPTIONAL_PACKAGES:
        assert f"`{bootstrap.pip_name(name)}`" in section, f"README's optional packages do not mention {name}"
