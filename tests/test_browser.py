"""The notebooks in a real browser: JupyterLab (as `make lab` starts it) driven in Debian's
Chromium through Playwright. For each notebook, "Run All": no error output, every plotly
figure drawn. Then every control of the Explorer (01) and of the CostExplorer (08), used as
a person would: the verdicts and the figures must change to match; and notebook 12's live
training figure must grow while the ranks train. Screenshots of a failure go to
.tplab-state/browser/.

Notebooks run at world_size 2 (papermill's parameters cell, injected into the copy the lab
serves), except 01 at 4, where the Explorer's TP degree has a choice (2 or 4), and 13 at 4,
the only size it claims (tplab.lessons.SIZES: a dp=2 x tp=2 mesh), and in the
simulated mode where they have one (00 starts processes): the browser run checks what a
learner sees, and keeps within the suite's time; papermill (test_notebooks.py) runs every
notebook in each of its modes at world 2, and at its other sizes in the extended run.

The default run opens the notebooks whose page does something papermill cannot see: 00 (a plain
notebook, ranks in processes), 01 and 08 (their widgets' controls) and 12 (its live figure), and
13, the lesson at world 4 (papermill leaves 00, 12 and 13 to this test where it runs:
tests/test_notebooks.py's IN_THE_BROWSER). The other notebooks' Run All in the browser is
`extended`: papermill runs them in the default run, and their figures go through the same plotly
renderer that 00, 01, 08 and 12 check here. The notebooks open one after another in one page (File
> Open from Path), as a person opens the next lesson; when a test ends its tab is closed and its
kernel shut down."""

from __future__ import annotations

import html
import os
import pathlib
import re
import shutil
import tempfile
import time

import browser
import papermill
import pytest
import report
from test_notebooks import modes

from tplab.lessons import SIZES

REPO = pathlib.Path(__file__).parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SHOTS = REPO / ".tplab-state" / "browser"
WORLD_SIZE = 2
EXPLORER_WORLD_SIZE = 4  # notebook 01
# notebook 12: its first correct run trains for this many steps (its default, 30, is over in
# about two seconds: too short to see its live figure, redrawn every 1 s, grow; 30 steps
# with tplab.checks.train_live.REDRAW_S at 0.2 s were tried: the page showed the counts
# [-1, 0, 18, 30], one partial); the runs after it train for the notebook's default again
# (a cell injected after the watched one)
LIVE_STEPS = 150
WATCHED = "tp_run = tplab.train_check("  # the cell of notebook 12 whose live figure is watched
# what the page shows that papermill does not: a plain notebook with ranks in processes (00),
# widgets' controls (01, 08), a figure drawn while the cell runs (12); 13: the lesson at world 4
IN_DEFAULT_RUN = ("00", "01", "08", "12", "13")
# how long a control's effect may take to show (and RUN_ALL_S, a Run All), bounds and no
# pace: the waits end on what the page shows, and 2 cores shared with the rest of the suite
# make a step many times slower than alone (13's Run All: 166 s at a load of 12)
FOLLOW_S = 120
RUN_ALL_S = 600
_times: dict[str, float] = {}

if not os.path.exists(browser.CHROMIUM):
    pytest.skip(f"no Chromium at {browser.CHROMIUM} (Debian: apt-get install -y chromium; "
                ".ci/run installs it)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed "
                               "(pip install -e '.[dev]')")


@pytest.fixture(scope="module")
def served():
    state = pathlib.Path(tempfile.mkdtemp(prefix="tplab-browser-"))
    root = state / "notebooks"
    root.mkdir()
    for nb in NOTEBOOKS:
        world = EXPLORER_WORLD_SIZE if nb.stem.startswith("01") else WORLD_SIZE
        if WORLD_SIZE not in SIZES[nb.stem[:2]]:   # 13: 4 alone
            world = min(SIZES[nb.stem[:2]])
        fast = {"mode": "simulated"} if "simulated" in modes(nb) else {}
        longer = {"steps": LIVE_STEPS} if nb.stem.startswith("12") else {}
        out = browser.prepare(nb, root, {"world_size": world, **fast, **longer})
        if longer:
            default = papermill.inspect_notebook(str(nb))["steps"]["default"]
            browser.insert_after(out, WATCHED, f"steps = {default}  # the other runs: the "
                                 "notebook's default (tests/test_browser.py)")
    lab = browser.JupyterLab(root, state)
    try:
        yield lab
    finally:
        lab.stop()
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def chromium():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=browser.CHROMIUM, args=browser.FLAGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def pages(chromium):
    """The page the notebooks open in, one after another (JupyterLab loads once, as for a
    person who opens the next notebook); a test that fails leaves it for a fresh one."""
    held = []
    yield held
    for page in held:
        page.close()


@pytest.fixture
def page(chromium, served, pages, request):
    if not pages:
        pages.append(chromium.new_page(viewport={"width": 1400, "height": 1000}))
    page = pages[0]
    shot = SHOTS / f"{request.node.name}.png"
    shot.unlink(missing_ok=True)  # a screenshot left from an earlier failure
    failed = request.session.testsfailed
    yield page
    if request.session.testsfailed > failed:  # the call phase is reported before teardown
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shot), full_page=True)
        print(f"screenshot: {shot}")
        pages.remove(page)
        page.close()
    try:
        if page in pages:
            browser.close_tabs(page)
    except Exception:
        pages.remove(page)  # the next notebook gets a fresh page
        page.close()
        raise
    finally:
        served.shut_kernels()  # the notebook's kernel (and any lab it still holds) ends here


def _errors(nb: dict) -> list[str]:
    return [f"cell {i}: {o.get('ename')}: {o.get('evalue')}"
            for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
            for o in c.get("outputs", []) if o["output_type"] == "error"]


def _plotly_outputs(nb: dict) -> int:
    return sum("application/vnd.plotly.v1+json" in o.get("data", {})
               for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", []))


CASES = [pytest.param(p, id=p.stem, marks=(pytest.mark.slow,) + (
    () if p.stem.startswith(IN_DEFAULT_RUN) else (pytest.mark.extended,)))
    for p in NOTEBOOKS]


@pytest.mark.parametrize("path", CASES)
def test_run_all(path, served, page, request):
    started = time.perf_counter()
    kernel = browser.open_notebook(page, served, path.name)
    live = TrainingFigureWatch(page) if path.stem.startswith("12") else None
    prompts = browser.run_all(page, timeout_s=RUN_ALL_S)
    ran_in = [s["kernel"]["id"] for s in served.sessions() if s["path"] == path.name]
    assert ran_in == [kernel], f"the kernel changed during Run All: {kernel} -> {ran_in}"
    nb = browser.save(page, served.root / path.name)
    assert not _errors(nb), _errors(nb)
    assert all(p[1:-2].isdigit() for p in prompts), f"cells that never ran: {prompts}"
    figures = browser.plotly_figures(page)
    assert len(figures) >= _plotly_outputs(nb), (len(figures), _plotly_outputs(nb))
    bad = [f for f in figures if not f["svg"] or f["height"] < 100 or not f["traces"]]
    assert not bad, f"plotly figures that did not render: {bad}"
    assert not page.locator("text=Error displaying widget").count()
    _times[path.stem] = time.perf_counter() - started
    if live is not None:
        live.check()
    if path.stem.startswith("01"):
        explore(page)
    if path.stem.startswith("08"):
        explore_cost(page)
    if path.stem.startswith(("01", "08")):
        _times[path.stem + " (and its widget's controls)"] = time.perf_counter() - started


# --- notebook 12: train_check's figure, drawn while the ranks train -----------------------

class TrainingFigureWatch:
    """Counts the steps drawn in the first figure of notebook 12 (the live view of its first
    train_check) while the cells run: it must grow step by step, not appear whole at the
    end. The page itself looks every 100 ms and keeps each new count (window.tplabSteps), so
    that no redraw goes unseen however slowly this process gets to look."""

    JS = """() => {
        const count = () => { const e = document.querySelector(
            '.jp-NotebookPanel:not(.lm-mod-hidden) .js-plotly-plot');
            if (!e || !e.data || e.data.length < 2) return -1;
            return (e.data[1].y || []).filter(v => v !== null).length; };
        window.tplabSteps = [];
        window.tplabStepsTimer = setInterval(() => { const n = count(), seen = window.tplabSteps;
            if (seen[seen.length - 1] !== n) seen.push(n); }, 100); }"""

    def __init__(self, page):
        self.page = page
        page.evaluate(self.JS)

    def check(self) -> None:
        seen = self.page.evaluate("() => { clearInterval(window.tplabStepsTimer); "
                                  "return window.tplabSteps; }")
        final = max(seen)
        partial = sorted({n for n in seen if 0 < n < final})
        assert final > 0, "the training figure was never drawn"
        assert len(partial) >= 2, f"the figure did not grow while the ranks trained: {seen}"


# --- notebook 01: the Explorer ------------------------------------------------------------

def _status(page) -> str:
    texts = page.evaluate("""() => [...document.querySelectorAll('.widget-html-content')]
        .map(e => e.textContent).filter(t => /Megatron by hand|DTensor plan/.test(t))""")
    return texts[-1] if texts else ""


def _titles(page, prefix: str) -> list[str]:
    return [f["title"] for f in browser.plotly_figures(page) if f["title"].startswith(prefix)]


def _wait_status(page, expected: str, timeout_s: float = FOLLOW_S) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = _status(page)
        if text.startswith(expected + ":") and "running" not in text:
            return text
        page.wait_for_timeout(200)
    raise AssertionError(f"the Explorer says {_status(page)!r}, expected {expected!r}")


def explore(page) -> None:
    """Every control of the Explorer, in turn; each step checked against one device."""
    panel = page.locator(".widget-vbox:has(.widget-toggle-buttons)").last
    model = panel.locator(".widget-dropdown:has(label:text-is('model')) select")
    tp = panel.locator(".widget-dropdown:has(label:text-is('TP degree')) select")
    sp = panel.locator(".widget-checkbox:has-text('sequence parallelism') input")
    drop_f = panel.locator(".widget-checkbox:has-text(\"drop f's backward all-reduce\") input")
    w = EXPLORER_WORLD_SIZE
    steps = [  # (what a person does, the description the status and figures must show)
        (lambda: panel.locator("button:has-text('Megatron by hand')").click(),
         f"mlp, tp={w}, Megatron by hand", True),
        (lambda: drop_f.check(), f"mlp, tp={w}, Megatron by hand, f without all-reduce", False),
        (lambda: drop_f.uncheck(), f"mlp, tp={w}, Megatron by hand", True),
        (lambda: sp.check(), f"mlp, tp={w}, Megatron by hand, sequence parallel", True),
        (lambda: model.select_option(label="attention"),
         f"attention, tp={w}, Megatron by hand, sequence parallel", True),
        (lambda: sp.uncheck(), f"attention, tp={w}, Megatron by hand", True),
        (lambda: model.select_option(label="block"), f"block, tp={w}, Megatron by hand", True),
        (lambda: tp.select_option(label="2"), f"block, dp={w // 2} × tp=2, Megatron by hand",
         True),
        (lambda: panel.locator("button:has-text('DTensor plan')").click(),
         f"block, dp={w // 2} × tp=2, DTensor plan", True),
        (lambda: tp.select_option(label=str(w)), f"block, tp={w}, DTensor plan", True),
    ]
    for act, desc, ok in steps:
        act()
        status = _wait_status(page, desc)
        verdict = "matches the single-device model" if ok else "WRONG"
        assert verdict in status, (desc, status)
        for prefix in ("Where the collectives sit", "Collectives per rank",
                       "Errors against one device"):
            head = f"{prefix}: {desc}"

            def drawn(head=head, prefix=prefix):
                titles = _titles(page, prefix)
                return titles and all(t.startswith(head) and not t[len(head):].startswith(",")
                                      for t in titles)

            deadline = time.monotonic() + FOLLOW_S  # the figures follow the status line
            while not drawn() and time.monotonic() < deadline:
                page.wait_for_timeout(200)
            assert drawn(), (head, _titles(page, prefix))
    assert drop_f.is_disabled()  # a DTensor plan has no f to drop


# --- notebook 08: the CostExplorer --------------------------------------------------------

def _cost_state(page) -> dict:
    return page.evaluate("""() => {
        // the explorer's two figures are the notebook's last (its cell comes after every
        // other): the step time, then the memory per GPU
        const plots = [...document.querySelectorAll(
            '.jp-NotebookPanel:not(.lm-mod-hidden) .js-plotly-plot')];
        const [out, memory] = plots.slice(-2);
        const summary = [...document.querySelectorAll('.widget-html-content')]
            .map(e => e.textContent).filter(t => t.includes('Shortest micro-batch')).pop();
        const ys = fig => fig.data.map(t => Array.from(t.y).map(v => Number(v.toPrecision(6))));
        return {title: out.querySelector('.gtitle').textContent, summary: summary,
                y: ys(out), memory_y: ys(memory)};
    }""")


def _expected(mirror) -> dict:
    summary = html.unescape(re.sub(r"<[^>]+>", "", mirror.summary.value))
    def ys(figure):
        return [[float(f"{v:.6g}") for v in t.y] for t in figure.data]

    return {"title": mirror.hw.name, "summary": summary, "y": ys(mirror.figure),
            "memory_y": ys(mirror.memory_figure)}


def explore_cost(page) -> None:
    """Every control of the CostExplorer; after each, the figure and the summary must be
    what the same explorer computes here for the same settings."""
    from tplab import cost
    from tplab.cost.explorer import CostExplorer

    # the notebook's explorer after Run All (simulated mode: the presets only)
    mirror = CostExplorer(hardware=dict(cost.HARDWARE), tps=[1, 2, 4, 8, 16, 32, 64])
    mirror.update(model="Llama-3 70B", hardware="A100 SXM")
    mirror.update(gpus_per_node=72)
    mirror.update(sequence_parallel=True)
    panel = page.locator(".widget-vbox:has(label:text-is('GPUs per node'))").first

    def select(label):
        box = panel.locator(f".widget-dropdown:has(label:text-is('{label}')) select")
        return lambda value: box.select_option(label=str(value))

    def batch(value):
        box = panel.locator(".widget-text:has(label:text-is('micro-batch')) input")
        box.fill(str(value))
        box.press("Enter")

    def sp(value):
        box = panel.locator(".widget-checkbox:has-text('sequence parallel') input")
        box.check() if value else box.uncheck()

    steps = [(select("hardware"), "hardware", "H100 PCIe"),
             (select("model"), "model", "Llama-3 8B"),
             (select("hidden size"), "hidden", 8192),
             (select("sequence"), "seq", 16384),
             (batch, "batch", 4),
             (select("GPUs per node"), "gpus_per_node", 16),
             (sp, "sequence_parallel", False),
             (select("hardware"), "hardware", "H100 SXM")]
    before = _cost_state(page)  # after the cell that drove it from code
    assert before == _expected(mirror), f"the page shows {before}, expected {_expected(mirror)}"
    for act, name, value in steps:
        act(value)
        mirror.update(**{name: value})
        want = _expected(mirror)
        deadline = time.monotonic() + FOLLOW_S
        while (got := _cost_state(page)) != want and time.monotonic() < deadline:
            page.wait_for_timeout(200)
        assert got == want, f"after {name}={value!r}: the page shows {got}, expected {want}"
        assert got["y"] != before["y"] or name == "sequence_parallel", f"{name}: no redraw"
        before = got


def teardown_module(module):
    if _times:
        lines = [f"  {name}: {s:.1f} s" for name, s in sorted(_times.items())]
        total = sum(s for name, s in _times.items() if "(" not in name)
        report.LINES["browser"] = [f"browser (JupyterLab in Chromium, world_size "
                                   f"{WORLD_SIZE}, 01 at {EXPLORER_WORLD_SIZE}), Run All "
                                   "per notebook:", *lines,
                                   f"  total: {total:.1f} s"]
