"""The idle engine process polls its command pipes for a while after its last step (``--engine-idle-spin-ms``)
and then sleeps in the kernel: a request that comes within the window is taken without a wake-up, and a server
left idle costs no CPU."""

import queue
import threading
import time
from multiprocessing import Pipe

import pytest

pytest.importorskip("fastapi")

from piecegraph.server.engine_child import PipeInbox  # noqa: E402


class _Loop:
    def __init__(self):
        self.aborted = []

    def abort_id(self, rid):
        self.aborted.append(rid)


def _idle_wait(inbox, timeout):
    """CPU and wall seconds of one idle ``get`` that finds nothing."""
    cpu, wall = time.thread_time(), time.monotonic()
    with pytest.raises(queue.Empty):
        inbox.get(timeout)
    return time.thread_time() - cpu, time.monotonic() - wall


def test_the_idle_engine_polls_within_its_window_then_sleeps():
    recv, send = Pipe(duplex=False)
    inbox = PipeInbox([recv], idle_spin_s=0.25)
    inbox.loop = _Loop()
    with pytest.raises(queue.Empty):
        inbox.get_nowait()  # a busy loop looks between steps: the window starts now
    cpu, wall = _idle_wait(inbox, 0.5)
    assert wall >= 0.45 and cpu >= 0.08, (cpu, wall)  # ~0.25 s polling (less CPU on a loaded machine), then asleep
    cpu, wall = _idle_wait(inbox, 0.3)  # the window is over: it sleeps the whole wait
    assert wall >= 0.25 and cpu < 0.05, (cpu, wall)
    with pytest.raises(queue.Empty):
        inbox.get_nowait()
    timer = threading.Timer(0.05, send.send, (("abort", "req-1"),))
    timer.start()
    assert inbox.get(2.0) == ("wake", None) and inbox.loop.aborted == ["req-1"]  # taken while it polls
    timer.join()


def test_without_a_window_the_idle_engine_only_sleeps():
    recv, _ = Pipe(duplex=False)
    inbox = PipeInbox([recv])
    with pytest.raises(queue.Empty):
        inbox.get_nowait()
    cpu, wall = _idle_wait(inbox, 0.3)
    assert wall >= 0.25 and cpu < 0.05, (cpu, wall)
