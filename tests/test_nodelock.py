"""One agent per node (nodelock.py): the lock of a network namespace, its holder named to
whoever finds it taken, released with the process however it ends, never inherited."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ipvsproxy import __version__, nodelock
from ipvsproxy.nodelock import NodeBusy, hold, holder
from tests.support import eventually


def test_a_second_holder_is_refused_naming_the_first():
    with hold("run"):
        with pytest.raises(NodeBusy) as refused, hold("cleanup", advice="or --force"):
            pytest.fail("took a held lock")
        message = str(refused.value)
    assert f"pid {os.getpid()}" in message
    assert f"`ipvsproxy run`, version {__version__}" in message
    assert "started 20" in message
    assert "UTC" in message
    assert message.endswith("; or --force")
    assert f"@{nodelock.NAME}" in message


def test_the_lock_is_free_again_when_the_block_ends_even_by_an_error():
    with pytest.raises(RuntimeError), hold("run"):
        raise RuntimeError("boom")
    assert holder() is None
    with hold("run"):
        found = holder()
        assert found is not None
        assert found.described["command"] == "run"
    assert holder() is None


def test_kill_9_leaves_no_stale_lock():
    code = (
        "import sys, time\n"
        "from ipvsproxy import nodelock\n"
        f"nodelock.NAME = {nodelock.NAME!r}\n"
        "with nodelock.hold('run'):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"held\n"
        found = holder()
        assert found is not None
        assert found.pid == proc.pid
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert holder() is None
        with hold("run"):
            pass


def test_a_child_process_does_not_keep_the_lock():
    """iptables-restore or modprobe still running when the agent dies must not hold it."""
    with hold("run"):
        child = subprocess.Popen(["sleep", "30"])
    try:
        assert holder() is None
    finally:
        child.kill()
        child.wait()


def test_a_process_squatting_the_name_is_named_with_its_uid():
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind("\0" + nodelock.NAME)
    squatter.listen(1)
    try:
        started = time.monotonic()
        with pytest.raises(NodeBusy, match=rf"pid {os.getpid()}, uid {os.getuid()}, which did "
                           "not answer as ipvsproxy"), hold("run"):  # fmt: skip
            pytest.fail("took a squatted lock")
        assert time.monotonic() - started < nodelock.ANSWER_TIMEOUT + 1
    finally:
        squatter.close()


def test_the_holders_answer_is_bounded_and_many_askers_are_answered():
    with hold("run"):
        for _ in range(50):
            found = holder()
            assert found is not None
            assert found.described["pid"] == os.getpid()
    eventually(lambda: holder() is None, 5, "released")
