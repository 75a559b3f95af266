"""Nothing is left behind, and everything listens on loopback: checked by pid."""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys

import psutil
import pytest
from pids import alive, wait_gone

import tplab


@pytest.fixture(scope="module")
def own_lab():
    """A lab of this module's own (these tests end it)."""
    lab = tplab.launch(2)
    yield lab
    lab.shutdown()


def test_listening_sockets_are_on_loopback(own_lab):
    listening = []
    for pid in own_lab.pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        listening += [(pid, c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN]
    assert listening, "the lab should listen somewhere (controller, store)"
    assert {ip for _, ip in listening} <= {"127.0.0.1"}, listening


def test_state_is_private_to_the_owner(own_lab):
    state = own_lab.state_dir
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    security = os.path.join(state, "profile", "security")
    files = [os.path.join(security, f) for f in os.listdir(security)]
    assert any(f.endswith(".json") for f in files)
    for f in files:
        assert stat.S_IMODE(os.stat(f).st_mode) & 0o077 == 0, f


def test_restart_replaces_ranks_and_keeps_settings(own_lab):
    before = list(own_lab.rank_pids)
    own_lab.execute("x = 1")
    took = own_lab.restart()
    assert took > 0
    assert set(before).isdisjoint(own_lab.rank_pids)
    assert wait_gone(before, 5) == []
    assert own_lab.execute("'x' in dir()") == [False, False]
    assert own_lab.run(lambda: world_size) == [2, 2]  # noqa: F821


def test_shutdown_leaves_no_process(own_lab):
    pids = own_lab.pids
    assert len(pids) >= 3  # controller + 2 ranks at least
    own_lab.shutdown()
    assert wait_gone(pids, 5) == []
    assert not os.path.exists(own_lab.state_dir)
    with pytest.raises(tplab.LabError, match="shut down"):
        own_lab.run(lambda: 1)


OWNER = """
import json, sys, time
import tplab
lab = tplab.launch({n})
print(json.dumps(lab.pids), flush=True)
print(lab.state_dir, flush=True)
time.sleep(600)
"""


# World 2: the forced kernel restart below is this claim at world 2 (Jupyter SIGKILLs the
# kernel's process group, which holds no lab process: the kernel is a SIGKILLed owner, and
# the same assertions run there). World 4 in the extended run: twice the ranks.
@pytest.mark.parametrize("world_size", [pytest.param(4, marks=pytest.mark.extended)])
def test_processes_exit_when_the_owner_is_sigkilled(world_size, tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER.format(n=world_size)],
                             stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        pids = json.loads(owner.stdout.readline())
        state_dir = owner.stdout.readline().strip()
        assert os.path.isdir(state_dir)
        assert len(pids) >= world_size + 1
        assert alive(pids) == sorted(pids)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert wait_gone(pids, 10) == [], "lab processes outlived their owner by 10 s"
        assert not os.path.exists(state_dir), "the lab's state folder outlived its owner"
    finally:
        owner.kill()


def lab_in_kernel(kc) -> tuple[int, str, list[int]]:
    """Start a lab of 2 in the kernel: (the kernel's pid, the lab's state folder, the pids
    of its processes)."""
    outputs: list = []
    reply = kc.execute_interactive(
        "import json, os, tplab\nlab = tplab.launch(2)\n"
        "print(json.dumps([os.getpid(), lab.state_dir, lab.pids]))",
        timeout=120, output_hook=lambda msg: outputs.append(msg))
    assert reply["content"]["status"] == "ok"
    text = "".join(m["content"].get("text", "") for m in outputs
                   if m["msg_type"] == "stream")
    return tuple(json.loads(text.strip().splitlines()[-1]))


def free_ports_below_the_ephemeral_range(n: int) -> list[int]:
    """n loopback ports free now, below the kernel's ephemeral range (so no connection and
    no port-0 bind is given one)."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0]) \
        if os.path.exists("/proc/sys/net/ipv4/ip_local_port_range") else 32768
    found: list[int] = []
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise RuntimeError(f"fewer than {n} free ports below {low}")


def test_kernel_restart_ends_the_lab(tmp_path):
    """A Jupyter kernel that starts a lab, then is restarted politely; the new kernel
    starts a lab, then is restarted at once (its process group SIGKILLed, as Jupyter does
    when the kernel does not answer): no lab process survives either (one kernel for both:
    each costs seconds). The forced restart is test_processes_exit_when_the_owner_is_sigkilled
    at world 2: no lab process is in the kernel's group, so the SIGKILL ends the owner only,
    and the lab's processes and state folder go by its owner watch."""
    from jupyter_client.manager import KernelManager

    # A restarted kernel binds its old ports again. Jupyter picks them in the ephemeral
    # range, where any process's outgoing connection or port-0 bind (the other test worker's
    # labs) can take one in the moment between the old kernel's exit and the new one's bind
    # (CI saw "Address already in use"): take free ports below that range instead.
    km = KernelManager(kernel_name="python3", **dict(zip(
        ("shell_port", "iopub_port", "stdin_port", "hb_port", "control_port"),
        free_ports_below_the_ephemeral_range(5), strict=True)))
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        for now in (False, True):
            kernel, state_dir, pids = lab_in_kernel(kc)
            assert os.path.isdir(state_dir)
            assert len(pids) >= 2 + 1
            assert alive(pids) == sorted(pids)
            assert os.getpgid(kernel) not in {os.getpgid(p) for p in pids}
            km.restart_kernel(now=now)
            assert wait_gone(pids, 10) == [], f"lab processes outlived restart_kernel(now={now})"
            if now:
                assert not os.path.exists(state_dir), "the lab's state folder outlived its owner"
            kc.wait_for_ready(timeout=120)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def died_on_rank_1(lab) -> str:
    """The RankDied text of a cell in which rank 1 exits (no traceback kept: it would hold
    the lab)."""
    with pytest.raises(tplab.RankDied) as info:
        lab.execute("import os\nif rank == 1:\n    os._exit(7)\ndist.barrier()")
    return str(info.value)


def test_ranks_started_without_the_fork_server_and_a_garbage_collected_lab(capfd):
    """fork=False: ipyparallel's own launcher starts each rank (with its nanny); the lab
    works and reports a death (without the nanny's log lines). Then the lab is dropped,
    not shut down: garbage collected, it ends every process, nannies too (one lab for
    both claims: each lab started costs seconds of CPU)."""
    lab = tplab.launch(2, fork=False)
    try:
        assert lab.execute("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()") \
            == [3.0, 3.0]
        text = died_on_rank_1(lab)
        assert "rank 1 exited with status 7" in text
        assert "KernelNanny" not in text
        assert "KernelNanny" not in capfd.readouterr().err
        assert lab.execute("rank") == [0, 1]
        pids = lab.pids
        assert len(pids) >= 5  # the controller, and 2 ranks with their nannies at least
    except BaseException:
        lab.shutdown()
        raise
    del lab
    gc.collect()
    assert wait_gone(pids, 10) == []
