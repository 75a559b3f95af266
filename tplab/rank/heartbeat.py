"""The controller's heartbeat, paced: quick while engines register, slow once they all answer.

ipyparallel's hub registers an engine only after the engine has answered a heartbeat ping,
so a lab pings often (every FAST_MS) to start quickly (docs/DESIGN.md, "Facts measured
here"). Pinging that often for the rest of the lab's life costs an idle lab of 4 ranks about
6% of a core (the monitor and every engine wake ten times a second), and a test suite or a
workshop laptop keeps labs open for long. `pace()` changes ipyparallel's `HeartMonitor` in
the controller process (its heart monitor is a forked child, so the change goes with it):

- it pings every FAST_MS while anything changes: at start, when an engine connects to the
  pong socket (a zmq monitor event: a restart, engines on other hosts starting later), when
  a new engine answers, and while an engine misses pings (a dead one is then declared dead
  after `max_heartmonitor_misses` quick pings, as before);
- after SETTLED_BEATS quick beats with every known engine answering, it pings every SLOW_MS.

The hub tells engines the configured `HeartMonitor.period`; the lab configures SLOW_MS, so an
engine's own check of the pings (every period + 0.5 s) never misses a ping of either pace.
"""

from __future__ import annotations

FAST_MS = 100
SLOW_MS = 1000
SETTLED_BEATS = 20  # quick beats with nothing changing (2 s) before the slow pace


def pace() -> None:
    """Make ipyparallel's HeartMonitor ping at FAST_MS while engines come and go, SLOW_MS
    once every engine answers (call in the controller process, before it starts)."""
    # deferred: the controller's process alone loads ipyparallel's controller and zmq
    import zmq
    from ipyparallel.controller.heartmonitor import HeartMonitor
    from zmq.eventloop.zmqstream import ZMQStream

    if getattr(HeartMonitor, "tplab_paced", False):
        return
    start, beat = HeartMonitor.start, HeartMonitor.beat

    def quicken(monitor, reschedule: bool) -> None:
        """The quick pace from the next beat on (within a beat: tornado's PeriodicCallback
        schedules the next beat after it returns), or, from outside a beat, from now."""
        monitor.tplab_steady = 0
        if monitor.caller.callback_time != FAST_MS:
            monitor.caller.callback_time = FAST_MS
            if reschedule:
                monitor.caller.stop()
                monitor.caller.start()

    def paced_start(self) -> None:
        start(self)
        quicken(self, reschedule=True)
        events = self.pong_stream.socket.get_monitor_socket(zmq.EVENT_ACCEPTED)
        self.tplab_events = ZMQStream(events, self.loop)
        self.tplab_events.on_recv(lambda _message: quicken(self, reschedule=True))

    def paced_beat(self) -> None:
        changing = bool(self.responses ^ self.hearts) or bool(self.on_probation)
        beat(self)
        if changing:
            quicken(self, reschedule=False)
            return
        self.tplab_steady = getattr(self, "tplab_steady", 0) + 1
        if self.tplab_steady >= SETTLED_BEATS and self.caller.callback_time != SLOW_MS:
            self.caller.callback_time = SLOW_MS  # from the next beat on

    HeartMonitor.start, HeartMonitor.beat = paced_start, paced_beat
    HeartMonitor.tplab_paced = True
