"""Which worker ids name a worker of this machine that is gone (flowloop/workerids.py):
the hostname is not enough, the tag of this boot and pid namespace must match too
(tests/acceptance/test_same_hostname.py: the same with real processes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from flowloop.workerids import host_tag, new_worker_id, owner_is_dead_here


def a_dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_gone_worker_of_this_machine_is_dead_here() -> None:
    assert owner_is_dead_here(f"{socket.gethostname()}:{a_dead_pid()}:abcdef:{host_tag()}")


def test_a_same_named_machine_or_an_untagged_id_is_not_judged() -> None:
    pid = a_dead_pid()
    other = "0" * 8 if host_tag() != "0" * 8 else "1" * 8
    assert not owner_is_dead_here(f"{socket.gethostname()}:{pid}:abcdef:{other}")
    assert not owner_is_dead_here(f"{socket.gethostname()}:{pid}:abcdef")
    assert not owner_is_dead_here(f"elsewhere:{pid}:abcdef:{host_tag()}")


def test_a_live_worker_and_this_one_are_not_dead() -> None:
    mine = new_worker_id()
    assert mine.split(":")[1] == str(os.getpid()) and mine.endswith(host_tag())
    assert not owner_is_dead_here(mine)
    parent = f"{socket.gethostname()}:{os.getppid()}:abcdef:{host_tag()}"
    assert not owner_is_dead_here(parent)
