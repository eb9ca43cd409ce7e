"""The engine process's pipes have room for many steps of events: a front end a few steps behind in reading must
not stall the engine loop's blocking send (the H200's HTTP runs at concurrency 1024 spent 8-14% of the engine loop
in sends and command handling)."""

import multiprocessing
import os
import threading

import pytest

pytest.importorskip("fastapi")

from piecegraph.server.remote import PIPE_BYTES, ProcessEngineLoop, widen  # noqa: E402

fcntl = pytest.importorskip("fcntl")
linux = pytest.mark.skipif(not hasattr(fcntl, "F_GETPIPE_SZ"), reason="pipe sizes are Linux-only")


def _steps_of_events(n_steps=60, rows=256):
    """What an engine sends a front end per step at high concurrency: (id, new ids, reason, error, refused) rows."""
    return [("events", [(f"req-{i}", [i % 50_000], None, None, False) for i in range(rows)],
             {"used": 1, "total": 2}, []) for _ in range(n_steps)]


def _sends_without_a_reader(widened):
    recv, send = multiprocessing.Pipe(duplex=False)
    if widened:
        widen(send)
    done = threading.Event()

    def write(messages):
        for message in messages:
            send.send(message)
        done.set()

    messages = _steps_of_events()
    thread = threading.Thread(target=write, args=(messages,), daemon=True)
    thread.start()
    finished = done.wait(2.0)
    # Read every message, not "until done": the writer may still be between its last send and done.set(), and a
    # recv() after the last message would block for good (that race hung a CI run).
    for _ in messages:
        recv.recv()
    thread.join(timeout=10.0)
    assert not thread.is_alive()
    return finished


@linux
def test_a_widened_pipe_takes_many_steps_unread_where_a_plain_one_blocks():
    max_size = int(open("/proc/sys/fs/pipe-max-size").read())
    if max_size < PIPE_BYTES:
        pytest.skip(f"this machine caps pipes at {max_size} bytes")
    assert not _sends_without_a_reader(widened=False)  # 64 KiB: the writer waits for the reader
    assert _sends_without_a_reader(widened=True)


@linux
def test_the_engine_process_pipes_are_widened():
    loop = ProcessEngineLoop(os.getpid, frontends=2)  # not started: only its pipes are looked at
    ends = [loop._cmd_send, *(cmd for cmd, _ in loop.peer_channels)]
    ends += [ev for _, ev in loop._child_ends]
    for conn in ends:
        assert fcntl.fcntl(conn.fileno(), fcntl.F_GETPIPE_SZ) >= min(
            PIPE_BYTES, int(open("/proc/sys/fs/pipe-max-size").read()))
