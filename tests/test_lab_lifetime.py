"""Issue 38 items 23-25: a lab does not outlive its cell, its kernel or its dead owner.

The kernel is driven as JupyterLab drives it (jupyter_client's KernelManager: execute
requests, then "Shut Down Kernel" = shutdown_kernel), with IPython and Jupyter state and
$TMPDIR in this test's temporary folder. Nothing waits a fixed time: every wait polls
with a generous bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
from jupyter_client import KernelManager
from pids import alive, wait_gone

from tplab.rank.entry import STATE_DIR_ENV, owner_alive, owner_token

BOUND_S = 90   # generous: the machine may be loaded


def poll(condition, seconds: float = BOUND_S) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


class Kernel:
    """A kernel in `tmp`, as JupyterLab starts it; `run` returns (stdout, stderr)."""

    def __init__(self, tmp):
        self.tmpdir = tmp / "tmp"
        work = tmp / "work"
        for d in (self.tmpdir, work, tmp / "ipython", tmp / "jupyter"):
            d.mkdir()
        env = dict(os.environ, TMPDIR=str(self.tmpdir), IPYTHONDIR=str(tmp / "ipython"),
                   JUPYTER_CONFIG_DIR=str(tmp / "jupyter" / "config"),
                   JUPYTER_DATA_DIR=str(tmp / "jupyter" / "data"),
                   JUPYTER_RUNTIME_DIR=str(tmp / "jupyter" / "runtime"))
        self.km = KernelManager(kernel_name="python3",
                                connection_file=str(tmp / "jupyter" / "kernel.json"))
        self.km.start_kernel(cwd=str(work), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str) -> tuple[str, str]:
        streams: dict[str, str] = {"stdout": "", "stderr": ""}

        def hook(msg):
            if msg["msg_type"] == "stream":
                streams[msg["content"]["name"]] += msg["content"]["text"]
            elif msg["msg_type"] == "error":
                streams["stderr"] += "\n".join(msg["content"]["traceback"])

        reply = self.kc.execute_interactive(code, timeout=300, output_hook=hook)
        assert reply["content"]["status"] == "ok", streams["stderr"]
        return streams["stdout"], streams["stderr"]

    def labs_folders(self) -> list[str]:
        return sorted(p for p in os.listdir(self.tmpdir) if p.startswith("tplab-"))

    def close(self) -> None:
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=True)


@pytest.fixture
def kernel(tmp_path):
    k = Kernel(tmp_path)
    yield k
    k.close()


LAUNCH = "lab = tplab.launch(world_size)\nlab"   # the notebooks' launch cell
PIDS = "print(json.dumps(lab.pids))"


@pytest.mark.slow
def test_a_rerun_launch_cell_ends_the_lab_only_the_output_history_holds(kernel):
    """A rerun launch cell ends the lab only Out[] holds; a second lab a name holds runs;
    then closing the kernel with a lab running leaves nothing."""
    kernel.run("import json, tplab\nworld_size = 2")
    kernel.run(LAUNCH)
    first = json.loads(kernel.run(PIDS)[0])
    assert alive(first) == sorted(first)
    _, said = kernel.run(LAUNCH)              # the same cell again
    second = json.loads(kernel.run(PIDS)[0])
    assert "ended an earlier lab (world_size 2) that no name refers to" in said, said
    assert "Out[" in said
    assert wait_gone(first, BOUND_S) == [], "the first lab outlived its re-run cell"
    assert alive(second) == sorted(second)
    assert len(kernel.labs_folders()) == 1
    # a second lab on purpose (a name holds each): both run, and a line says so
    _, said = kernel.run("other = tplab.launch(world_size)")
    assert ("two labs are running in this kernel: lab (world_size 2) is still running "
            "too; lab.shutdown() ends it") in said, said
    assert alive(second) == sorted(second)
    kernel.run("other.shutdown()")
    assert kernel.run("print(lab.closed, other.closed)")[0].split() == ["False", "True"]
    # closing the kernel (JupyterLab's "Shut Down Kernel") with a lab running leaves
    # nothing: no process, no state folder (here, not in a kernel of its own: each costs
    # seconds of CPU to start a lab in)
    kernel.km.shutdown_kernel(now=False)
    assert wait_gone(second, BOUND_S) == []
    assert poll(lambda: not kernel.labs_folders()), kernel.labs_folders()


@pytest.mark.slow
def test_a_kernel_killed_in_its_cleanup_leaves_no_state_folder(kernel):
    """jupyter_client SIGTERMs a kernel 2.5 s into its shutdown; under load the lab's
    cleanup takes longer. Here the kernel dies at the worst moment, deterministically:
    right after the last process it started is ended (so no owner watch is left to remove
    the folder)."""
    kernel.run("import json, os, signal, tplab\nfrom tplab.lab import processes\n"
               "lab = tplab.launch(2)\nlab")
    pids = json.loads(kernel.run(PIDS)[0])
    state = kernel.run("print(lab.state_dir)")[0].strip()
    assert os.path.isdir(state) and kernel.labs_folders() == [os.path.basename(state)]
    # the kernel is SIGKILLed as soon as none of the processes it started is running (what
    # it needs is bound now: IPython clears the notebook's names before the lab's cleanup)
    kernel.run("import psutil\n"
               "def dies_midway(*args, real=processes.kill_trees, os=os, psutil=psutil,\n"
               "                sig=signal.SIGKILL, **kwargs):\n"
               "    gone = real(*args, **kwargs)\n"
               "    if all(c.status() == psutil.STATUS_ZOMBIE\n"
               "           for c in psutil.Process().children(recursive=True)):\n"
               "        os.kill(os.getpid(), sig)\n"
               "    return gone\n"
               "processes.kill_trees = dies_midway")
    kernel.km.shutdown_kernel(now=False)         # JupyterLab's "Shut Down Kernel"
    assert wait_gone(pids, BOUND_S) == []
    assert poll(lambda: not kernel.labs_folders()), kernel.labs_folders()


def test_a_zombie_owner_is_gone_and_its_lab_folder_goes(tmp_path):
    """A dead kernel its parent has not reaped keeps its pid and start time: its state
    ("Z") says it is gone. This test is the parent and does not reap it until the end."""
    owner = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    state = tmp_path / "tplab-zombie"
    state.mkdir()
    (state / "engine-0.out").write_text("a rank's output")
    token = owner_token(owner.pid)
    watcher = None
    try:
        assert owner_alive(token)
        watcher = subprocess.Popen(
            [sys.executable, "-c", f"from tplab.rank.entry import watch_owner\n"
                                   f"watch_owner({token!r})"],
            env=dict(os.environ, **{STATE_DIR_ENV: str(state)}),
            start_new_session=True)   # it ends its own process group: only itself
        owner.stdin.close()           # the owner exits; nobody reaps it: a zombie
        assert poll(lambda: psutil.Process(owner.pid).status() == psutil.STATUS_ZOMBIE)
        assert not owner_alive(token)
        assert poll(lambda: watcher.poll() is not None), "the watch outlived a zombie owner"
        assert not state.exists()
    finally:
        owner.wait()
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
            watcher.wait()
