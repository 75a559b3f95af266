"""A workshop room on one machine (issue 22, item 11): several labs started at the same
moment all start and run an all-reduce, and are all shut; the start-up wait scales with
the machine's load and stretches while ranks make progress; when rank 0 does not join in
time the error says what the ranks were doing, where the store was and what to do."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import tplab
from tplab.lab import joining

LEARNER = textwrap.dedent("""
    import json, sys
    import tplab

    def all_reduce():
        import torch, torch.distributed as dist
        t = torch.zeros(()) + (dist.get_rank() + 1)
        dist.all_reduce(t)
        return float(t)

    with tplab.launch(int(sys.argv[1])) as lab:
        pids = lab.pids
        print(json.dumps({"sums": lab.run(all_reduce), "pids": pids}), flush=True)
""")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def room(tmp_path, labs: int, world_size: int) -> None:
    import json

    script = tmp_path / "learner.py"
    script.write_text(LEARNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(tplab.__file__)), os.environ.get("PYTHONPATH", "")])}
    started = [subprocess.Popen([sys.executable, str(script), str(world_size)], cwd=tmp_path,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True) for _ in range(labs)]
    outs = []
    try:
        for p in started:
            outs.append(p.communicate(timeout=600))
    finally:
        for p in started:
            if p.poll() is None:
                os.killpg(p.pid, 9)  # only the learners this test started, by group
                p.wait()
    n = world_size
    for p, (out, err) in zip(started, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got["sums"] == [n * (n + 1) / 2] * n
        deadline = time.monotonic() + 10
        while any(map(alive, got["pids"])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in got["pids"] if alive(pid)], "a lab left processes running"


@pytest.mark.slow
def test_a_room_of_three_labs_started_at_once_all_start(tmp_path):
    room(tmp_path, labs=3, world_size=2)


@pytest.mark.extended
@pytest.mark.parametrize("labs", [4, 6])
def test_a_bigger_room_all_start(tmp_path, labs):
    room(tmp_path, labs=labs, world_size=2)


def test_the_start_wait_scales_with_the_load():
    c = joining.cores()
    assert joining.start_limit_s(2, 60.0, load=0) == 60.0
    assert joining.start_limit_s(2, 90.0, load=0) == 90.0
    busy = joining.start_limit_s(2, 60.0, load=20 * c)
    assert busy == 8.0 * (2 + 20 * c) / c > 60.0
    assert joining.start_limit_s(64, 60.0, load=0) == max(60.0, 8.0 * 64 / c)


def test_the_start_wait_stretches_while_ranks_use_cpu():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)
        idle = joining.StartWait(0.5, lambda: [sleep.pid], window_s=0.5)
        busy = joining.StartWait(1.0, lambda: [spin.pid], window_s=3.0)
        while not idle.expired():
            assert idle.elapsed < 10, "an idle start never expired"
            time.sleep(0.05)
        # the limit, then the progress window; not the stretch (3 x the limit)
        assert 1.0 <= idle.elapsed < joining.MAX_STRETCH * 0.5
        while busy.elapsed < 1.3:
            time.sleep(0.05)
        assert not busy.expired()           # past its limit, but the rank uses CPU
        while not busy.expired():           # until three times the limit
            time.sleep(0.05)
        assert busy.elapsed >= joining.MAX_STRETCH * 1.0
    finally:
        for p in (spin, sleep):
            p.kill()
            p.wait()


def test_a_rank_that_did_not_join_is_described(tmp_path):
    from tplab.rank.entry import output_paths

    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while joining.process_state(stuck.pid) != "sleeping (waiting)":  # python started
            assert time.monotonic() < deadline
            time.sleep(0.05)
        out_file = output_paths(str(tmp_path), stuck.pid)[0]
        os.makedirs(os.path.dirname(out_file), exist_ok=True)
        with open(out_file, "w") as f:
            f.write("importing torch\nconnecting to the store\n")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]   # closed again: nothing listens there
        text = joining.join_report(0, [stuck.pid], str(tmp_path), "gloo", "127.0.0.1", port,
                                   75.0, 2)
    finally:
        stuck.kill()
        stuck.wait()
    assert text.startswith("rank 0 did not join the process group (gloo) within 75 s")
    assert f"127.0.0.1:{port} does not accept connections" in text
    assert f"rank 0 (pid {stuck.pid}): sleeping (waiting)" in text
    assert "Rank 0's last lines:\nimporting torch\nconnecting to the store" in text
    assert "tplab.launch(2, timeout=300)" in text and "profile/log" in text


class _Client:
    """What LabProcesses asks of an ipyparallel client while ranks start."""

    def __init__(self, ids, hub=()):
        self.ids, self.hub, self.closed = list(ids), list(hub) or list(ids), False

    def queue_status(self):
        return {**{i: {"queue": 0} for i in self.hub}, "unassigned": 0}

    def close(self):
        self.closed = True


def test_a_start_catches_up_with_engines_whose_registration_the_client_missed(tmp_path):
    # 32 ranks on 2 cores: the client, connected while engines registered, missed 2 of the
    # hub's notifications for good ("only 30 of 32 ranks started"). A new client learns
    # every registered engine from the hub.
    from types import SimpleNamespace

    from tplab.lab.cluster import LabProcesses
    from tplab.lab.transports import LocalTransport

    procs = LabProcesses(SimpleNamespace(transport=LocalTransport), str(tmp_path))
    missed = _Client(ids=[0, 1], hub=[0, 1, 2])
    procs.client = missed
    procs.cluster = SimpleNamespace(connect_client_sync=lambda: _Client(ids=[0, 1, 2]))
    procs.catch_up_with_the_hub()
    assert procs.client.ids == [0, 1, 2] and missed.closed
    current = procs.client
    procs.catch_up_with_the_hub()  # nothing missed: the same client
    assert procs.client is current and not current.closed
