"""Worker ids, and whether an id names a worker of this machine that is gone.

A worker id is ``HOST:PID:RANDOM:TAG``. ``TAG`` names where the pid means something: this
kernel's boot (``/proc/sys/kernel/random/boot_id``) and pid namespace (its inode) — a
hostname alone does not (cloned VMs, containers given one ``hostname:``). A worker judged
gone here has its leases expired at once instead of after the lease; judging by the
hostname alone, a live worker of a same-named machine had its runs taken over in the
middle of their steps at every recovery sweep (fault audit). An id without the tag (an
older worker's, one given with ``--worker-id``) is never judged gone: its leases run out.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import uuid


@functools.cache
def host_tag() -> str:
    """8 hex digits naming this boot of this machine and this pid namespace."""
    parts = []
    for read in (_boot_id, _pid_namespace):
        try:
            parts.append(read())
        except OSError:  # not Linux: the hostname is all there is
            parts.append("")
    return hashlib.sha256(":".join(parts).encode()).hexdigest()[:8]


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as handle:
        return handle.read().strip()


def _pid_namespace() -> str:
    return str(os.stat("/proc/self/ns/pid").st_ino)


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}:{host_tag()}"


def owner_is_dead_here(owner: str) -> bool:
    """A worker of this machine (and pid namespace) whose process is gone: its leases
    need not run out first."""
    parts = owner.split(":")
    if len(parts) != 4:
        return False
    host, pid_text, _, tag = parts
    if host != socket.gethostname() or tag != host_tag() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
