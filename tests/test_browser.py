"""The course's widgets, driven in a real browser: JupyterLab + headless Chromium (Debian's
`chromium` and `chromium-driver`, through selenium).

In 00 it runs the notebook from the Run menu up to the planner, changes the planner's model and then
its GPU, and checks that the verdict text and the chart change with no widget error; in 03 it runs up
to the checkpointing explorer, moves its slider and checks that the drawing changes. The cells after a
widget (nbval runs them all) are left out of the copy the browser opens: they would only add minutes.
On failure it saves screenshots under report/browser/.

`.ci/run` installs the browser on a fresh machine; elsewhere the test is skipped, with the command
that installs it, when Chromium or its driver is missing.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "report" / "browser"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
INSTALL = "apt-get install chromium chromium-driver (Debian/Ubuntu), then pip install selenium"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason=f"no Chromium/ChromeDriver here: {INSTALL}"),
]
selenium = pytest.importorskip("selenium", reason=f"selenium is not installed: {INSTALL}")
from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

TOKEN = "course-browser-test"
# Each notebook the browser opens, and the start of the code cell that shows its widget: the copy ends there.
WIDGET_CELLS = {"00_start_here.ipynb": "planner.planner_widget(",
                "03_gradient_checkpointing.ipynb": "ckpt.chain_explorer("}
CELL_OF = "./ancestor::div[contains(@class,'jp-CodeCell')][1]"  # the notebook cell holding a widget
WIDGET_ERRORS = ("Error displaying widget", "Failed to load model class", "model not found")


def _copy_up_to(source: Path, target: Path, widget_code: str) -> None:
    """Copy a notebook's cells up to and including the first code cell that starts with ``widget_code``."""
    notebook = json.loads(source.read_text(encoding="utf-8"))
    ends = [i for i, cell in enumerate(notebook["cells"])
            if cell["cell_type"] == "code" and "".join(cell["source"]).lstrip().startswith(widget_code)]
    if not ends:
        pytest.fail(f"{source.name} has no code cell starting with {widget_code!r}: update WIDGET_CELLS")
    notebook["cells"] = notebook["cells"][:ends[0] + 1]
    target.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a free local port, serving copies of the notebooks."""
    folder = tmp_path_factory.mktemp("lab")
    for name, widget_code in WIDGET_CELLS.items():
        _copy_up_to(ROOT / "notebooks" / name, folder / name, widget_code)
    port = _free_port()
    # Render every cell, not only those in view (JupyterLab 4 windows long notebooks), so widgets exist to be driven.
    settings = folder / "lab-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    env = dict(os.environ, COURSE_PROFILE="smoke", COURSE_HOME=str(folder / "home"),
               JUPYTER_CONFIG_DIR=str(folder / "jupyter-config"), HOME=str(folder))
    env.pop("MPLBACKEND", None)  # a learner's kernel has the inline backend, not the test harness's Agg
    log = open(folder / "lab.log", "w")
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           f"--ServerApp.token={TOKEN}", f"--ServerApp.root_dir={folder}", "--allow-root",
           "--LabApp.news_url=", "--ServerApp.open_browser=False",
           f"--LabApp.user_settings_dir={folder / 'lab-settings'}"]
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited: {(folder / 'lab.log').read_text()[-2000:]}")
            time.sleep(0.5)
    else:
        server.kill()
        pytest.fail("JupyterLab did not start within 90 s")
    yield url
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:  # pragma: no cover
        server.kill()
    log.close()


@pytest.fixture
def browser(request):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(120)
    failures_before = request.session.testsfailed
    yield driver
    if request.session.testsfailed > failures_before:  # the test's call phase failed: keep what it saw
        REPORT.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(REPORT / f"{request.node.name}.png"))
    driver.quit()


def _wait(driver, condition, timeout, message):
    # a widget that redraws replaces its DOM nodes: a node read mid-redraw is "not yet", not a failure
    return WebDriverWait(driver, timeout, poll_frequency=0.5, ignored_exceptions=(StaleElementReferenceException,)
                         ).until(lambda d: condition(d), message=message)


def _run_all(driver, lab_url: str, notebook: str) -> None:
    # A workspace of its own, reset: JupyterLab would otherwise reopen the notebooks of an earlier test beside this
    # one, and "Run All Cells" would run whichever it made current.
    driver.get(f"{lab_url}/lab/workspaces/{Path(notebook).stem}/tree/{notebook}?reset&token={TOKEN}")
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell"), 120, "notebook never opened")
    _wait(driver, lambda d: "Idle" in _kernel_status(d), 120, "kernel never became idle")
    # Run > Run All Cells, from the menu bar as a learner would
    run_menu = _wait(driver, lambda d: [e for e in d.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-itemLabel")
                                        if e.text.strip() == "Run"], 20, "no Run menu")[0]
    run_menu.click()
    run_all = _wait(driver, lambda d: [e for e in d.find_elements(By.CSS_SELECTOR, ".lm-Menu-itemLabel")
                                       if e.text.strip() == "Run All Cells" and e.is_displayed()], 20,
                    "no 'Run All Cells' in the Run menu")[0]
    run_all.click()
    time.sleep(2)  # JupyterLab marks every queued cell [*] at once; give it that moment
    # Finished: the kernel is idle and every code cell has an execution count (a cell whose input is collapsed
    # shows no prompt). An error stops the queue, so page errors end the wait too.
    try:
        _wait(driver, lambda d: _page_errors(d) or ("Idle" in _kernel_status(d) and _all_cells_ran(d)), 300,
              "cells did not finish running within 300 s")
    except TimeoutException as timeout:
        raise AssertionError(f"{notebook}: cells did not finish within 300 s; {_diagnosis(driver)}") from timeout


def _diagnosis(driver) -> str:
    """What the page shows, for a failure message: kernel status, prompts, widget placeholders."""
    prompts = _prompts(driver)
    waiting = [e.get_attribute("textContent").strip()[:120] for e in driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output")
               if "widget" in (e.get_attribute("textContent") or "").lower()]
    return (f"{sum(p[1:-2].isdigit() for p in prompts)} of {len(prompts)} code cells ran (prompts {prompts}); "
            f"kernel status {_kernel_status(driver)!r}; outputs mentioning widgets {waiting}; "
            f"page errors {_page_errors(driver)}")


def _kernel_status(driver) -> str:
    return " ".join(e.text for e in driver.find_elements(By.CSS_SELECTOR, ".jp-StatusBar-TextItem, .jp-Toolbar-kernelStatus")) + \
        " ".join((e.get_attribute("title") or "") for e in driver.find_elements(By.CSS_SELECTOR, ".jp-Toolbar-kernelStatus, .jp-KernelStatus"))


def _prompts(driver) -> list[str]:
    """Each code cell's input prompt: '[ ]:' not run, '[*]:' running or queued, '[7]:' run."""
    return [e.get_attribute("textContent").strip() for e in driver.find_elements(By.CSS_SELECTOR, ".jp-CodeCell .jp-InputPrompt")]


def _all_cells_ran(driver) -> bool:
    prompts = _prompts(driver)
    return any(p[1:-2].isdigit() for p in prompts) and not any(p in ("[ ]:", "[*]:") for p in prompts)


def _page_errors(driver) -> list[str]:
    text = driver.find_element(By.TAG_NAME, "body").text
    errors = [e for e in WIDGET_ERRORS if e in text]
    errors += [e.text[:300] for e in driver.find_elements(By.CSS_SELECTOR, ".jp-RenderedText[data-mime-type='application/vnd.jupyter.stderr']")
               if "Traceback" in e.text or "Error" in e.text.split("\n")[0]]
    return errors


def _widget_images(driver, container) -> list[str]:
    return [img.get_attribute("src")[-200:] for img in container.find_elements(By.CSS_SELECTOR, "img")]


def _labelled(driver, css: str, label: str, required: bool = True):
    """The widget of class ``css`` whose description label reads ``label``, scrolled into view."""
    for widget in driver.find_elements(By.CSS_SELECTOR, css):
        labels = widget.find_elements(By.CSS_SELECTOR, "label, .widget-label")
        if any(lab.get_attribute("textContent").strip() == label for lab in labels):
            driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", widget)
            time.sleep(0.5)
            return widget
    if required:
        raise AssertionError(f"no {css} labelled {label!r} on the page")
    return None


def _open_widget(browser, lab_url: str, notebook: str, css: str, label: str, what: str):
    """Run ``notebook`` (its copy ends at the widget) from the Run menu; return (the widget labelled ``label``, its
    cell, the cell's images)."""
    _run_all(browser, lab_url, notebook)
    assert not _page_errors(browser), _page_errors(browser)
    try:
        widget = _wait(browser, lambda d: _labelled(d, css, label, required=False), 60, "")
    except TimeoutException as timeout:
        raise AssertionError(f"{notebook}: no {css} labelled {label!r} appeared within 60 s of the last cell; "
                             f"{_diagnosis(browser)}") from timeout
    cell = widget.find_element(By.XPATH, CELL_OF)
    images = _wait(browser, lambda d: _widget_images(d, cell), 30, f"the {what} shows no drawing")
    return widget, cell, images


def _choose_another(dropdown) -> str:
    """Pick an option of ``dropdown`` other than the current one (and not the custom entries); return it."""
    select = Select(dropdown.find_element(By.TAG_NAME, "select"))
    current = select.first_selected_option.text
    choice = next(o.text for o in select.options if o.text != current and "custom" not in o.text)
    select.select_by_visible_text(choice)
    return choice


def test_planner_widget_redraws_in_00(lab, browser):
    model_box, panel, before_imgs = _open_widget(browser, lab, "00_start_here.ipynb", ".widget-dropdown", "model",
                                                 "planner")
    before_text = panel.text
    new = _choose_another(model_box)
    _wait(browser, lambda d: panel.text != before_text and _widget_images(d, panel) != before_imgs, 60,
          f"changing the model to {new!r} did not redraw the verdict and the chart")
    after_model_text, after_model_imgs = panel.text, _widget_images(browser, panel)

    new_gpu = _choose_another(_labelled(browser, ".widget-dropdown", "GPU"))
    _wait(browser, lambda d: panel.text != after_model_text or _widget_images(d, panel) != after_model_imgs, 60,
          f"changing the GPU to {new_gpu!r} did not redraw the verdict or the chart")
    assert not _page_errors(browser), _page_errors(browser)
    REPORT.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(REPORT / "00_planner_after.png"))


def test_checkpointing_slider_redraws_in_03(lab, browser):
    slider, panel, before = _open_widget(browser, lab, "03_gradient_checkpointing.ipynb", ".widget-slider", "step",
                                         "checkpointing explorer")
    handle = slider.find_element(By.CSS_SELECTOR, ".noUi-handle, .ui-slider-handle, [role='slider']")
    handle.click()
    for _ in range(3):
        handle.send_keys(Keys.ARROW_RIGHT)
    _wait(browser, lambda d: _widget_images(d, panel) != before, 60, "moving the slider did not redraw the drawing")
    assert not _page_errors(browser), _page_errors(browser)
