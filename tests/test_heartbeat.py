"""The controller's heartbeat pace (tplab/rank/heartbeat.py): quick while engines come and
go, slow once every engine answers. The truth: ipyparallel's own HeartMonitor, beaten by
hand on real zmq sockets, and the pings a real lab's controller sends."""

from __future__ import annotations

import json
import os
import time

import pytest
import zmq
from ipyparallel.controller.heartmonitor import HeartMonitor
from tornado.ioloop import PeriodicCallback
from zmq.eventloop.zmqstream import ZMQStream

import tplab
from tplab.rank import heartbeat


@pytest.fixture
def monitor():
    """A HeartMonitor on inproc sockets, paced, its beats run by the test."""
    heartbeat.pace()
    context = zmq.Context()
    sockets = [context.socket(kind) for kind in (zmq.PUB, zmq.ROUTER, zmq.PUB)]
    for i, s in enumerate(sockets):
        s.bind(f"inproc://beat-{os.getpid()}-{i}")
    ping, pong, mon = (ZMQStream(s) for s in sockets)
    hm = HeartMonitor(ping_stream=ping, pong_stream=pong, monitor_stream=mon,
                      period=heartbeat.SLOW_MS)
    hm.caller = PeriodicCallback(lambda: None, heartbeat.FAST_MS)  # not started: beats by hand
    yield hm
    for s in (ping, pong, mon):
        s.close()
    context.term()


def beats(hm: HeartMonitor, n: int, answering: set) -> None:
    for _ in range(n):
        hm.responses = set(answering)
        hm.beat()


def test_the_pace_is_quick_while_engines_change_and_slow_once_all_answer(monitor):
    hm, fast, slow = monitor, heartbeat.FAST_MS, heartbeat.SLOW_MS
    beats(hm, 1, {b"a", b"b"})  # two engines answer their first ping: registered
    assert hm.hearts == {b"a", b"b"} and hm.caller.callback_time == fast
    beats(hm, heartbeat.SETTLED_BEATS - 1, {b"a", b"b"})
    assert hm.caller.callback_time == fast  # not yet settled
    beats(hm, 1, {b"a", b"b"})
    assert hm.caller.callback_time == slow
    beats(hm, 1, {b"a"})  # b misses a ping: quick again, so a dead one is found as before
    assert hm.caller.callback_time == fast and hm.on_probation == {b"b": 1}
    beats(hm, hm.max_heartmonitor_misses, {b"a"})
    assert hm.hearts == {b"a"}  # declared dead after the usual number of quick pings
    beats(hm, heartbeat.SETTLED_BEATS, {b"a"})
    assert hm.caller.callback_time == slow
    beats(hm, 1, {b"a", b"c"})  # a new engine (a restart): quick at once
    assert hm.caller.callback_time == fast and hm.hearts == {b"a", b"c"}


def test_a_running_labs_controller_pings_slowly_once_settled_and_its_engines_stay(tmp_path):
    """The pings a lab's hub sends, read from its heartbeat socket: about every SLOW_MS once
    the engines are in (load only makes them later), and the ranks still answer after."""
    lab = tplab.launch(2)
    try:
        profile = os.path.join(lab.state_dir, "profile", "security")
        connection = next(os.path.join(profile, f) for f in os.listdir(profile)
                          if f.endswith("engine.json"))
        with open(connection) as f:
            info = json.load(f)
        url = f"{info['interface']}:{info['hb_ping']}"
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(url)
        try:
            lifetimes = []
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if sub.poll(5000):
                    lifetimes.append(float(sub.recv_multipart()[-1]))
                gaps = [b - a for a, b in zip(lifetimes, lifetimes[1:], strict=False)]
                if len(gaps) >= 3 and min(gaps[-3:]) >= 0.9 * heartbeat.SLOW_MS / 1000:
                    break
            else:
                raise AssertionError(f"the hub never slowed: gaps {gaps[-10:]}")
        finally:
            sub.close()
        assert lab.run(sum, [1, 2]) == [3, 3]
    finally:
        lab.shutdown()
