"""JupyterLab in Chromium, for tests/test_browser.py: start the lab's JupyterLab (as `make lab`
does) on a free loopback port with all Jupyter state in a temporary directory, and drive
notebooks in it through Playwright with Debian's Chromium.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """`jupyter lab` on 127.0.0.1 serving `root`, its state under `state`; ended by pid."""

    def __init__(self, root: pathlib.Path, state: pathlib.Path):
        self.root, self.state = root, state
        self.port, self.token = free_port(), os.urandom(12).hex()
        env = dict(os.environ)
        for var, sub in [("IPYTHONDIR", "ipython"), ("JUPYTER_CONFIG_DIR", "config"),
                         ("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTER_DATA_DIR", "data"),
                         ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                         ("JUPYTERLAB_WORKSPACES_DIR", "workspaces")]:
            env[var] = str(state / sub)
        settings = {  # every cell in the page (no windowing), no news fetched from the net
            "notebook-extension/tracker": {"windowingMode": "none"},
            "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        }
        for name, values in settings.items():
            path = state / "settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        # the flags of `make lab`, plus a known token
        cmd = [sys.executable, "-m", "jupyter", "lab", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={self.port}", f"--ServerApp.root_dir={root}",
               "--ServerApp.open_browser=False", "--LanguageServerManager.autodetect=False",
               f"--IdentityProvider.token={self.token}",
               # window.jupyterapp: the test waits on the notebook's kernel, not on a clock
               "--LabApp.expose_app_in_browser=True"]
        if os.getuid() == 0:
            cmd.append("--allow-root")
        self.log = open(state / "jupyterlab.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url('api/status')}", timeout=2)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start: "
                                       + (state / "jupyterlab.log").read_text()[-2000:]
                                       ) from None
                time.sleep(0.2)

    def url(self, path: str, reset: bool = False) -> str:
        # reset: a fresh workspace, not the tabs the last page left open
        return f"http://127.0.0.1:{self.port}/{path}?token={self.token}" + "&reset" * reset

    def shut_kernels(self) -> None:
        """Shut down every kernel the server runs (DELETE /api/kernels/ID), and wait until
        the server lists none: a closed page leaves its notebook's kernel running."""
        for kernel in self._api("api/kernels"):
            self._api(f"api/kernels/{kernel['id']}", method="DELETE")
        deadline = time.monotonic() + 30
        while self._api("api/kernels") and time.monotonic() < deadline:
            time.sleep(0.1)

    def sessions(self) -> list[dict]:
        """The server's sessions (GET /api/sessions): each with its path and kernel."""
        return self._api("api/sessions")

    def _api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(self.url(path), method=method)
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def stop(self) -> None:
        self.proc.terminate()  # the server shuts its kernels down, and so their labs
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def prepare(src: pathlib.Path, dest: pathlib.Path, parameters: dict) -> pathlib.Path:
    """A copy of notebook `src` in `dest` with papermill's injected-parameters cell."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = load_notebook_node(str(src))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nb = parameterize_notebook(nb, parameters, kernel_name="python3", language="python")
    out = dest / src.name
    nbformat.write(nb, out)
    for extra in src.parent.glob("*.py"):  # helpers a notebook imports, if any
        shutil.copy(extra, dest)
    return out


def insert_after(path: pathlib.Path, marker: str, source: str) -> None:
    """Insert a code cell `source` after the first code cell of notebook `path` that
    contains `marker` (an error if none does)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    at = next((i for i, c in enumerate(nb.cells)
               if c.cell_type == "code" and marker in c.source), None)
    if at is None:
        raise ValueError(f"{path.name} has no code cell with {marker!r}")
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(source))
    nbformat.write(nb, path)


PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook on show
PROMPTS = f"() => [...document.querySelectorAll('{PANEL} .jp-CodeCell .jp-InputPrompt')]" \
          ".map(e => e.textContent.trim())"


def _menu(page, menu: str, item: str) -> None:
    page.click(f"li.lm-MenuBar-item:has-text('{menu}')")
    page.click(f"li.lm-Menu-item:has-text('{item}')")


def in_lab(page, lab: JupyterLab) -> bool:
    """Whether the page shows this JupyterLab already (its app loaded)."""
    return (page.url.startswith(lab.url("lab").split("?")[0])
            and page.locator("#jp-main-dock-panel").count() > 0)


def close_tabs(page) -> None:
    """File > Close All Tabs, discarding what a widget changed since the last save."""
    _menu(page, "File", "Close All Tabs")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        page.wait_for_timeout(200)
        discard = page.locator(".jp-Dialog button:has-text('Discard')")
        if discard.count():
            discard.first.click()
        elif not page.locator(".jp-Dialog").count() and not page.locator(PANEL).count():
            return
    raise TimeoutError("the notebook tabs did not close")


def open_notebook(page, lab: JupyterLab, name: str) -> str:
    """Open notebook `name`: in a fresh page, by its URL; in a page that shows the lab
    already, as a person does (File > Open from Path...), without loading JupyterLab again
    (close_tabs first). Returns the id of the kernel it settled on (kernel_settled)."""
    if in_lab(page, lab):
        _menu(page, "File", "Open from Path")
        page.fill(".jp-Dialog input", name)
        page.click(".jp-Dialog .jp-mod-accept")
    else:
        page.goto(lab.url(f"lab/tree/{name}", reset=True))
    page.wait_for_selector(f"{PANEL} .jp-CodeCell", timeout=60_000)
    return kernel_settled(page, lab, name)


# the notebook on show, when its kernel is ready: connected, idle, no input pending
# (window.jupyterapp: JupyterLab started with --LabApp.expose_app_in_browser)
KERNEL = """(name) => {
    const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    if (!panel || !panel.context || panel.context.path !== name) return null;
    const session = panel.sessionContext;
    const kernel = session && session.session && session.session.kernel;
    if (!session || !session.isReady || session.pendingInput || !kernel) return null;
    return kernel.connectionStatus === 'connected' && kernel.status === 'idle'
        ? kernel.id : null;
}"""


def kernel_settled(page, lab: JupyterLab, name: str, timeout_s: float = 120) -> str:
    """Wait until notebook `name`'s page has its kernel ready, and that kernel is the one
    the server's session for `name` runs, the same at two looks in a row: a Run All sent
    while the page still switches kernels ran its last cells in a new kernel (NameError)
    on a loaded machine. Answers a "Select Kernel" dialog. Returns the kernel's id."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if page.locator(".jp-Dialog .jp-mod-accept").count():  # "Select Kernel"
            page.click(".jp-Dialog .jp-mod-accept")
        kernel = page.evaluate(KERNEL, name)
        served = [s["kernel"]["id"] for s in lab.sessions() if s["path"] == name]
        if kernel is not None and served == [kernel]:
            if kernel == last:
                return kernel
            last = kernel
        else:
            last = None
        page.wait_for_timeout(200)
    raise TimeoutError(f"{name}: no settled kernel in {timeout_s:.0f} s (the page has "
                       f"{page.evaluate(KERNEL, name)}, the server "
                       f"{[s for s in lab.sessions() if s['path'] == name]})")


SETTLED = f"""() => !!document.querySelector('.jp-Dialog .jp-mod-accept')
    || !({PROMPTS})().some(p => p.includes('*'))"""


def _click_run_all(page) -> None:
    page.click("li.lm-MenuBar-item:has-text('Run')")
    page.click("li.lm-Menu-item:has-text('Run All Cells')")


def run_all(page, timeout_s: float) -> list[str]:
    """Run > Run All Cells; wait until every cell ran, or execution stopped at an error.
    A click the page swallowed (a dialog, a kernel still connecting) is made again."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout  # an optional dependency

    _click_run_all(page)
    clicked = time.monotonic()
    deadline, started, stopped_since = clicked + timeout_s, False, None
    while time.monotonic() < deadline:
        if page.locator(".jp-Dialog .jp-mod-accept").count():  # "Select Kernel"
            page.click(".jp-Dialog .jp-mod-accept")
        prompts = page.evaluate(PROMPTS)
        busy = any("*" in p for p in prompts)
        started = started or busy or all(p[1:-2].isdigit() for p in prompts)
        if not started and time.monotonic() - clicked > 8:
            _click_run_all(page)
            clicked = time.monotonic()
        if started and not busy:
            if all(p[1:-2].isdigit() for p in prompts):
                return prompts
            stopped_since = stopped_since or time.monotonic()
            if time.monotonic() - stopped_since > 3:
                return prompts
        else:
            stopped_since = None
        if busy:  # the page itself looks until no cell is queued or running, or a dialog
            left_ms = max(deadline - time.monotonic(), 0.001) * 1000  # 0: no limit
            with contextlib.suppress(PlaywrightTimeout):
                page.wait_for_function(SETTLED, polling=250, timeout=left_ms)
        else:
            page.wait_for_timeout(250)
    raise TimeoutError(f"Run All did not finish in {timeout_s:.0f} s: {page.evaluate(PROMPTS)}")


def save(page, path: pathlib.Path) -> dict:
    """Save the notebook from the page (Ctrl+S) and read what the file holds."""
    before = path.stat().st_mtime_ns
    page.click(f"{PANEL} .jp-InputPrompt >> nth=0")
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if path.stat().st_mtime_ns != before:
            try:
                return json.loads(path.read_text())
            except ValueError:  # still being written
                pass
        page.wait_for_timeout(200)
    raise TimeoutError(f"the page did not save {path.name}")


def plotly_figures(page) -> list[dict]:
    """Every plotly figure in the page: whether it drew its SVG, its size and title."""
    return page.evaluate("""() => [...document.querySelectorAll(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .js-plotly-plot')].map(e => ({
        svg: !!e.querySelector('.main-svg'), height: e.getBoundingClientRect().height,
        title: (e.querySelector('.gtitle') || {}).textContent || '',
        traces: (e.data || []).length}))""")
