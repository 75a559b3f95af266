"""Engines beyond the local launcher, for real: MPI (Open MPI's mpiexec), SSH (sshd in
network namespaces) and Slurm (slurmctld + slurmd + munged), all started here and ended
by pid (tests/hosts.py). Ranks on different hosts meet over the veths: master_addr is
rank 0's host address, never loopback. These tests need root and Debian's packages
(.ci/run installs them); they skip, saying what is missing, elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
from hosts import Hosts, Slurm, skip_reason
from pids import alive, wait_gone

import tplab
from tplab.lab import joining

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]
ROOT_MPI = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def need(*tools):
    reason = skip_reason(*tools)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def hosts():
    need("ip", "sshd", "ssh", "ssh-keygen")
    h = Hosts(2).start()
    try:
        h.start_sshd()
        yield h
    finally:
        h.stop()


def sum_of_ranks_and_where():
    """On a rank: an all-reduce of rank+1, and the address this rank reaches rank 0 from."""
    import os

    import torch
    import torch.distributed as dist

    from tplab.rank.network import route_source

    x = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    return {"sum": x.item(), "from": route_source(os.environ["MASTER_ADDR"]),
            "gloo": os.environ.get("GLOO_SOCKET_IFNAME"), "pid": os.getpid()}


def listening(pids) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening IPv4/IPv6 TCP socket of these processes,
    each seen from its own network namespace (/proc/PID/net/tcp; psutil reads the
    caller's namespace)."""
    import ipaddress
    import socket
    import struct

    out = []
    for pid in pids:
        try:
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1]
                      for fd in os.listdir(f"/proc/{pid}/fd")
                      if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
        except OSError:
            continue
        for table, width in (("tcp", 8), ("tcp6", 32)):
            try:
                with open(f"/proc/{pid}/net/{table}") as f:
                    rows = f.read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                cols = row.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hex_ip, hex_port = cols[1].split(":")
                raw = bytes.fromhex(hex_ip)
                raw = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0])
                               for i in range(0, len(raw), 4))
                ip = socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, raw)
                mapped = ipaddress.ip_address(ip)
                if getattr(mapped, "ipv4_mapped", None):
                    ip = str(mapped.ipv4_mapped)
                out.append((pid, ip, int(hex_port, 16)))
    return out


def mpi_options(h: Hosts) -> dict:
    hostfile = os.path.join(h.tmp, "hostfile")
    with open(hostfile, "w") as f:
        f.write("".join(f"{a} slots=2\n" for a in h.addresses))
    net = f"{h.subnet}.0/24"
    return {"config": {"MPILauncher": {"mpi_args": [
        "--hostfile", hostfile, "--mca", "plm_rsh_agent", f"ssh -F {h.ssh_config}",
        "--mca", "oob_tcp_if_include", net,
        # tplab's ranks talk through gloo; MPI's own TCP transport would listen on every
        # interface (Open MPI 4 binds it to 0.0.0.0), so only shared memory and self here.
        "--mca", "btl", "self,vader"]}}}


@pytest.mark.parametrize(("said", "fix"), [
    ("ModuleNotFoundError: No module named 'mpi4py'", 'pip install "tplab[mpi]"'),
    ("mpiexec has detected an attempt to run as root.", "OMPI_ALLOW_RUN_AS_ROOT=1"),
    ("There are not enough slots available in the system", "--oversubscribe"),
    ("root@node2: Permission denied (publickey).", "ssh HOST true"),
    ("ModuleNotFoundError: No module named 'tplab'", "pip install tplab"),
    ("sbatch: error: invalid partition specified: gpu", "SlurmEngineSetLauncher"),
])
def test_engine_errors_come_with_their_fix(said, fix):
    from tplab.lab.engines import hint_for

    assert fix in hint_for(f"some line\n{said}\nanother line")


def test_an_unknown_error_gets_no_made_up_fix():
    from tplab.lab.engines import hint_for

    assert hint_for("ValueError: something only the user's code says") == ""


def test_mpi_engine_failure_is_reported_within_10_s_with_the_fix(tmp_path, monkeypatch):
    """The engines die at once (here: mpi4py cannot be imported, as without tplab[mpi]):
    the lab says so within 10 s of their failing, with the engines' own error and the fix."""
    need("mpiexec")
    shadow = tmp_path / "mpi4py"
    shadow.mkdir()
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'mpi4py'\", name='mpi4py')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    for k, v in ROOT_MPI.items():
        monkeypatch.setenv(k, v)
    # The bound is on the lab's noticing, from the moment mpiexec (the engines' launcher)
    # exits; under load, starting the controller and the engines alone can pass 10 s. An
    # mpiexec first on PATH runs the real one and notes when it exited (watching for it
    # by polling missed one that lived less than a poll).
    exits = tmp_path / "mpiexec-exits"
    wrapper = tmp_path / "bin" / "mpiexec"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\n"{shutil.which("mpiexec")}" "$@"\nrc=$?\n'
                       f'date +%s.%N >> "{exits}"\nexit $rc\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(tplab.LabError) as info:
        tplab.launch(2, engines="mpi", cluster_options={
            "config": {"MPILauncher": {"mpi_args": ["--oversubscribe"]}}})
    reported = time.time()
    text = str(info.value)
    assert exits.exists(), "mpiexec was started and exited"
    took = reported - float(exits.read_text().split()[-1])  # the launch's, after --version's
    assert took < 10, f"reported {took:.1f} s after mpiexec exited"
    assert "ModuleNotFoundError: No module named 'mpi4py'" in text, text
    assert 'pip install "tplab[mpi]"' in text, text
    state = text.rsplit("logs: ", 1)[1].split("/profile/log")[0]
    assert not os.path.exists(state), "the failed lab's state folder is removed"
    left = [p.pid for p in psutil.process_iter(["environ"])
            if (p.info["environ"] or {}).get("TPLAB_STATE_DIR") == state]
    assert wait_gone(left, 5) == [], "the failed lab's processes are ended"


def say_where():
    import os

    print(f"rank {os.environ['RANK']} on {os.environ['GLOO_SOCKET_IFNAME']}")


KERNEL = r"""
import json, signal, sys, time, traceback
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # as tests/conftest.py: the stop button
    signal.signal(signal.SIGINT, signal.default_int_handler)
import tplab
h = json.loads(sys.argv[1])
lab = tplab.launch(2, engines="ssh", ip=h["controller"], cluster_options={"config": {
    "SSHEngineSetLauncher": {"engines": {a: 1 for a in h["addresses"]}},
    "SSHLauncher": {"ssh_cmd": ["ssh", "-F", h["ssh_config"]],
                    "scp_cmd": ["scp", "-F", h["ssh_config"]]}}})
sys.path.insert(0, h["tests"])
from test_engines import check_faults_keep_output, check_live, sum_of_ranks_and_where
got = {"first": lab.run(sum_of_ranks_and_where)}
try:  # the live output checks, on this lab (their own lab would be one more ssh start)
    check_live(lab)
    check_faults_keep_output(lab)
except BaseException:
    got["failed"] = traceback.format_exc()
got.update(results=lab.run(sum_of_ranks_and_where), pids=lab.pids,
           master_addr=lab.master_addr)
print("\nLAB " + json.dumps(got), flush=True)
time.sleep(600)
"""


def kernel_report(kernel) -> dict:
    """The kernel's one `LAB {json}` line (what the ranks printed came before it)."""
    for line in kernel.stdout:
        if line.startswith("LAB "):
            return json.loads(line[4:])
    raise AssertionError(f"the kernel failed to start the lab (exit status {kernel.wait()})")


@pytest.mark.timeout(300)  # one ssh lab for both claims: the start, three of them, the kill
def test_ssh_ranks_on_two_hosts_stream_live_and_end_when_the_kernel_is_killed(hosts):
    """ipyparallel's ssh launcher puts one rank on each host; output of the ranks there
    arrives while the cell runs (check_live), and none is lost on a hang, a cell timeout,
    an interrupt or a crash (check_faults_keep_output), in a notebook kernel's lab. When
    that kernel is SIGKILLed, the controller ends (owner watch) and the remote engines
    notice the missing heartbeat: every process on every host is gone within 30 s."""
    spec = {"controller": hosts.controller, "addresses": hosts.addresses,
            "ssh_config": hosts.ssh_config, "tests": os.path.dirname(__file__)}
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, json.dumps(spec)],
                              stdout=subprocess.PIPE, text=True)
    try:
        got = kernel_report(kernel)
        assert "failed" not in got, got["failed"]
        assert {r["from"] for r in got["first"]} == set(hosts.addresses)
        assert [r["sum"] for r in got["results"]] == [3.0, 3.0]
        assert sorted(r["from"] for r in got["results"]) == sorted(hosts.addresses)
        assert got["master_addr"] in hosts.addresses
        on_hosts = [p for ns in hosts.names for p in hosts.ns_pids(ns)]
        assert {r["pid"] for r in got["results"]} <= set(on_hosts)
    finally:
        kernel.send_signal(signal.SIGKILL)
        kernel.wait()
    everything = sorted(set(got["pids"]) | set(on_hosts))
    assert alive(everything), "the lab's processes were running before the kill"
    killed = time.monotonic()
    left = wait_gone(everything, 30)
    assert left == [], hosts.leftovers()
    assert hosts.leftovers() == {}
    # tplab's heartbeat watch (10 s of silence), not ipyparallel's (50 misses of 0.6 s)
    assert time.monotonic() - killed < 25


def test_ssh_engine_failure_is_reported_with_its_output_and_the_fix(hosts):
    """An engine that exits on its host before it registers (here: as without tplab there)
    is reported by the launcher's wait on the host, with the engine's own error and the
    fix, not at the end of the start's time limit (a minute at least)."""
    fail = [sys.executable, "-c", "raise ModuleNotFoundError(\"No module named 'tplab'\")"]
    started = time.monotonic()
    with pytest.raises(tplab.LabError) as info:
        tplab.launch(2, engines="ssh", ip=hosts.controller, cluster_options={"config": {
            "SSHEngineSetLauncher": {"engines": {a: 1 for a in hosts.addresses},
                                     "engine_cmd": fail},
            "SSHLauncher": {"ssh_cmd": ["ssh", "-F", hosts.ssh_config],
                            "scp_cmd": ["scp", "-F", hosts.ssh_config]}}})
    text = str(info.value)
    # seen exited, or (a look a moment earlier) still running with its fatal error printed
    assert re.search(r"the engine on \S+ (\(remote pid \d+\) exited before it registered|"
                     r"failed)", text), text
    assert "ModuleNotFoundError: No module named 'tplab'" in text, text
    assert "Fix: install tplab" in text, text
    assert time.monotonic() - started < joining.MIN_START_S, text
    deadline = time.monotonic() + 10  # the launcher's wait loops end with their engines
    while hosts.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hosts.leftovers() == {}


@pytest.fixture(scope="module")
def slurm():
    need("slurmctld", "slurmd", "munged", "sbatch")
    cluster = Slurm(cpus=4).start()
    try:
        yield cluster
    finally:
        cluster.stop()
    assert cluster.left_running() == [], "a Slurm process outlived the cluster (slurmstepd?)"


# --- live output from ranks elsewhere (tplab/rank/output_relay.py) -------------------------------


class Arrivals:
    """A stdout/stderr that notes when each line arrives (seconds since `start`)."""

    def __init__(self):
        self.start = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self.partial = ""

    def write(self, text: str) -> int:
        now = time.monotonic() - self.start
        *lines, self.partial = (self.partial + text).split("\n")
        self.lines += [(now, line) for line in lines]
        return len(text)

    def flush(self) -> None:
        pass

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def ticks(start: float):
    """Line i at wall time start + 0.6 i on every rank (a cell reaches ranks on other hosts
    at moments tens of ms apart: more than the grouping window, WINDOW_S)."""
    import time

    for i in range(3):
        time.sleep(max(0.0, start + 0.6 * i - time.time()))
        print(f"tick {i}", flush=True)


def then_hang():
    import torch
    import torch.distributed as dist

    print(f"rank {dist.get_rank()} before the hang", flush=True)
    x = torch.ones(1)
    if dist.get_rank() == 0:
        dist.all_reduce(x)  # the others broadcast: these can never match
    else:
        dist.broadcast(x, src=1)


def then_sleep():
    import time

    print("working", flush=True)
    time.sleep(60)


def last_words():
    import os

    import torch.distributed as dist

    if dist.get_rank() == 1:
        print("last words", flush=True)
        os._exit(3)
    return 0


def shown(fn, *args, error=None, **kwargs) -> Arrivals:
    """What the notebook's stdout gets while lab.run(fn) runs (raising `error`, if given)."""
    out, old = Arrivals(), sys.stdout
    sys.stdout = out
    try:
        if error is None:
            fn(*args, **kwargs)
        else:
            with pytest.raises(error):
                fn(*args, **kwargs)
    finally:
        sys.stdout = old
    out.ended = time.monotonic() - out.start
    return out


def ranks_that_said(out: Arrivals, said: str) -> set[int]:
    """The ranks whose labelled lines (`[ranks 0-3] x`, `[ranks 1,3] x`, `[rank 2] x`) say
    `said`: a cell reaches ranks on other hosts tens of ms apart, so lines printed at its
    start may come grouped in parts, as local ranks' would with such a lag."""
    found: set[int] = set()
    for _, line in out.lines:
        label, _, text = line.partition("] ")
        if text != said:
            continue
        for span in label.split(" ", 1)[1].split(","):
            first, _, last = span.partition("-")
            found.update(range(int(first), int(last or first) + 1))
    return found


def check_live(lab) -> None:
    """Output of ranks elsewhere arrives while the cell runs, grouped and labelled as local
    ranks' output."""
    n = lab.world_size
    label = f"[ranks 0-{n - 1}]" if n > 2 else "[ranks 0,1]"
    # The ticks' start must be ahead of the cell's arrival on every rank: a cell first on
    # fresh ranks also sends them sys.path (seen 0.7 s late under load), so not this one.
    lab.run(os.getpid)
    out = shown(lab.run, ticks, time.time() + 1.0)
    got = {line: t for t, line in out.lines}
    assert [line for _, line in out.lines] == [f"{label} tick {i}" for i in range(3)], out.lines
    assert got[f"{label} tick 0"] < out.ended - 1.0, (got, out.ended)  # live, not at the end
    assert got[f"{label} tick 1"] - got[f"{label} tick 0"] > 0.4, got


def check_faults_keep_output(lab) -> None:
    """No output of ranks elsewhere is lost on a hang, a cell timeout, an interrupt or a
    crash, and the lab goes on after each. The default run checks this over ssh (the
    transport mpiexec uses too); Slurm's and MPI's are extended: each restart through them
    is the slowest start of this file."""
    import _thread
    import threading

    n = lab.world_size
    out = shown(lab.run, then_hang, error=tplab.CollectiveHang)
    assert all(f"[rank {r}] rank {r} before the hang" in out.text() for r in range(n)), out.lines
    out = shown(lab.run, then_sleep, cell_timeout=2, error=tplab.CellTimeout)
    assert ranks_that_said(out, "working") == set(range(n)), out.lines

    timer = threading.Timer(2.0, _thread.interrupt_main)  # the stop button
    timer.start()
    out = shown(lab.run, then_sleep, error=KeyboardInterrupt)
    assert ranks_that_said(out, "working") == set(range(n)), out.lines
    assert lab.run(lambda: 1) == [1] * n  # the lab goes on

    with pytest.raises(tplab.RankDied) as died:
        lab.run(last_words)
    text = str(died.value)
    assert "rank 1 exited" in text, text
    assert "last words" in text.split("last output of rank 1 ---", 1)[1], text
    assert lab.run(lambda: 2) == [2] * n  # restarted


@pytest.fixture(scope="module")
def mpi_lab(hosts):
    """One lab of 4 mpi ranks over the two hosts (a start through mpiexec and ssh is the
    slowest of this file), for the two tests below, in this order: the live-output test,
    then test_mpi_ranks_on_two_hosts, which ends with the lab's shutdown."""
    need("mpiexec")
    pytest.importorskip("mpi4py", reason='engines="mpi" needs mpi4py: pip install "tplab[mpi]"')
    with pytest.MonkeyPatch.context() as mp:  # mpiexec reads them again at every restart
        for k, v in ROOT_MPI.items():
            mp.setenv(k, v)
        lab = tplab.launch(4, engines="mpi", ip=hosts.controller,
                           cluster_options=mpi_options(hosts))
        try:
            yield lab
        finally:
            lab.shutdown()


def test_mpi_ranks_on_two_hosts_stream_live(hosts, mpi_lab):
    lab = mpi_lab
    assert {r["from"] for r in lab.run(sum_of_ranks_and_where)} == set(hosts.addresses)
    check_live(lab)


@pytest.mark.extended
def test_mpi_ranks_keep_their_output_through_faults(hosts, mpi_lab):
    check_faults_keep_output(mpi_lab)


def test_mpi_ranks_on_two_hosts(hosts, mpi_lab, capsys):
    """mpiexec with a hostfile over two hosts: 4 ranks meet over the veths; the store and
    gloo listen on the hosts' addresses only; only signed messages reach the hub; what the
    ranks print reaches the notebook; restart()
    replaces the ranks; after shutdown() nothing is left on either host. (The lab is the
    one the live-output test above used: this test comes after it, and shuts it down.)"""
    lab = mpi_lab
    try:
        results = lab.run(sum_of_ranks_and_where)
        assert [r["sum"] for r in results] == [10.0] * 4
        assert lab.master_addr in hosts.addresses  # rank 0's host, not loopback
        assert sorted(r["from"] for r in results) == sorted(hosts.addresses * 2)
        assert {r["gloo"] for r in results} == {"eth0"}
        rank_pids = [r["pid"] for r in results]
        where = {r["pid"]: r["from"] for r in results}
        socks = listening(rank_pids)
        assert (rank_pids[0], lab.master_addr, lab.master_port) in socks  # the store
        for pid, ip, _ in socks:  # gloo on the host's address; ipyparallel on its loopback
            assert ip in (where[pid], "127.0.0.1"), (pid, ip, socks)
        hub = [p for p in lab.pids if "tplab.rank.entry controller" in " ".join(
            psutil.Process(p).cmdline())]  # the controller and its schedulers
        hub_ips = {ip for _, ip, _ in listening(hub)}
        assert hosts.controller in hub_ips and hub_ips <= {hosts.controller, "127.0.0.1"}, \
            hub_ips
        check_only_signed_messages_run(lab)
        capsys.readouterr()
        lab.run(say_where)  # what ranks elsewhere print reaches the notebook, by rank
        shown = "".join(capsys.readouterr())
        assert all(f"rank {r} on eth0" in shown for r in range(4)), shown
        lab.restart()  # the old ranks end on their hosts, new ones start through mpiexec
        again = lab.run(sum_of_ranks_and_where)
        assert [r["sum"] for r in again] == [10.0] * 4
        assert wait_gone(rank_pids, 10) == []
        rank_pids = [r["pid"] for r in again]
    finally:
        lab.shutdown()
    assert wait_gone(rank_pids, 10) == []
    deadline = time.monotonic() + 10  # the engines' nannies tell the (gone) hub first
    while hosts.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hosts.leftovers() == {}


def check_only_signed_messages_run(lab) -> None:
    """A client with the wrong HMAC key gets no answer from the hub and runs nothing; with
    the lab's key the same steps run code (so the check itself could pass)."""
    import ipyparallel as ipp

    path = os.path.join(lab.state_dir, "profile", "security", "ipcontroller-tplab-client.json")
    with open(path) as f:
        info = json.load(f)
    marker = os.path.join(lab.state_dir, "ran-by-a-stranger")
    with pytest.raises(TimeoutError):
        ipp.Client(dict(info, key="0123-not-the-key"), timeout=3)
    assert not os.path.exists(marker)
    client = ipp.Client(info, timeout=10)
    try:
        client[:].execute(f"open({marker!r}, 'w').close()").get(timeout=30)
    finally:
        client.close()
    assert os.path.exists(marker)




@pytest.fixture(scope="module")
def slurm_lab(slurm):
    """One lab of 4 ranks in one Slurm job, for the three tests below, in this order: the
    live-output test, (extended) the faults test, then
    test_slurm_runs_four_ranks_and_cancels_its_job, which ends with the lab's shutdown."""
    env = dict(os.environ)
    with pytest.MonkeyPatch.context() as mp:  # sbatch, squeue, scancel read SLURM_CONF
        for k, v in slurm.env.items():
            mp.setenv(k, v)
        lab = tplab.launch(4, engines="slurm")
        try:
            yield lab
        finally:
            lab.shutdown()
            os.environ.clear()
            os.environ.update(env)


def test_slurm_ranks_stream_live(slurm_lab):
    check_live(slurm_lab)


@pytest.mark.extended
def test_slurm_ranks_keep_their_output_through_faults(slurm_lab):
    check_faults_keep_output(slurm_lab)


def test_slurm_runs_four_ranks_and_cancels_its_job(slurm, slurm_lab):
    """A job Slurm refuses is said at once, with the fix; 4 ranks in one running job sum
    their ranks; shutdown() cancels the job and its processes end. (The lab is the one the
    live-output test above used: this test comes after it, and shuts it down.)"""
    started = time.monotonic()
    with pytest.raises(tplab.LabError) as info:  # a job Slurm refuses: said at once
        tplab.launch(2, engines="slurm", cluster_options={
            "config": {"SlurmEngineSetLauncher": {"queue": "no-such-partition"}}})
    assert time.monotonic() - started < 10
    assert "invalid partition" in str(info.value).lower(), info.value
    assert "Fix: Slurm refused the job" in str(info.value), info.value
    lab = slurm_lab
    try:
        results = lab.run(sum_of_ranks_and_where)
        assert [r["sum"] for r in results] == [10.0] * 4
        jobs = slurm.jobs()  # (after the extended faults test, its restarts' jobs may still
        # be COMPLETING: one job runs)
        assert len([j for j in jobs if j.endswith("RUNNING")]) == 1, jobs
    finally:
        lab.shutdown()
    pids = [r["pid"] for r in results]
    assert not os.path.exists("slurm_engine.sbatch"), "the batch script stays in the lab's folder"
    # a cancelled job stays COMPLETING until slurmd has ended its processes: seconds, and
    # (seen with the suite in 3 workers on 2 loaded cores) more than 10 under load
    deadline = time.monotonic() + 60
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert slurm.jobs() == [], "shutdown() cancels the job"
    assert wait_gone(pids, 30) == []
