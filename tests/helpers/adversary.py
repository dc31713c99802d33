"""Another user's tricks against our commands, for the adversarial tests (stdlib only).

Runs with any interpreter (/usr/bin/python3 as user nobody). Usage:
  adversary.py unlinked DIR ENGINE_ID fd|map   make the region file, hold it (descriptor
                                               or mapping only), unlink its name
  adversary.py fifo-flip DIR ENGINE_ID         hold an unlinked region at one descriptor
                                               and flip another between it and a FIFO
                                               that has no writer, forever
  adversary.py flock PATH                      hold LOCK_EX on PATH (a directory too)
  adversary.py lease DIR N                     N region files lease0..., each under a
                                               write lease, taken again whenever broken
  adversary.py segment DIR ENGINE_ID           hold open a segment .mmap.1 of ENGINE_ID
  adversary.py files DIR PREFIX N SIZE [MTIME] N region files PREFIX0..., ftruncate'd to
                                               SIZE (one page written if SIZE > 0, in the
                                               middle), mtime set to MTIME if given; exit
  adversary.py held DIR PREFIX N               N unlinked region files held open
Prints "ready PID" once the trick is in place, then keeps it until stdin closes.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import resource
import signal
import sys
import threading
import time


def _region(directory: str, engine_id: str) -> int:
    path = os.path.join(directory, f"vllm_offload_{engine_id}.mmap")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 8192)
    os.unlink(path)
    return fd


def _wait_for_stdin_close(stop: threading.Event | None = None) -> None:
    print(f"ready {os.getpid()}", flush=True)
    sys.stdin.read()
    if stop is not None:
        stop.set()


def main() -> None:
    how = sys.argv[1]
    if how == "unlinked":
        directory, engine_id, kind = sys.argv[2:5]
        fd = _region(directory, engine_id)
        mapped = None
        if kind == "map":
            mapped = mmap.mmap(fd, 8192)
            os.close(fd)  # Python's mmap keeps its own descriptor: drop that too
            _close_mmap_dups()
        _wait_for_stdin_close()
        if mapped is not None:
            mapped.close()
    elif how == "fifo-flip":
        directory, engine_id = sys.argv[2:4]
        fd = _region(directory, engine_id)
        fifo = os.path.join(directory, f"fifo-{os.getpid()}")
        os.mkfifo(fifo, 0o600)
        ffd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        os.unlink(fifo)
        flip = os.dup(fd)
        stop = threading.Event()
        threading.Thread(target=_wait_for_stdin_close, args=(stop,), daemon=True).start()
        while not stop.is_set():
            os.dup2(fd, flip)
            os.dup2(ffd, flip)
    elif how == "flock":
        fd = os.open(sys.argv[2], os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        _wait_for_stdin_close()
    elif how == "lease":
        _leases(sys.argv[2], int(sys.argv[3]))
    elif how == "segment":
        directory, engine_id = sys.argv[2:4]
        path = os.path.join(directory, f"vllm_offload_{engine_id}.mmap.1")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, 8192)
        _wait_for_stdin_close()
    elif how == "files":
        directory, prefix, count, size = sys.argv[2], sys.argv[3], int(sys.argv[4]), \
            int(sys.argv[5])
        mtime = float(sys.argv[6]) if len(sys.argv) > 6 else None
        for i in range(count):
            path = os.path.join(directory, f"vllm_offload_{prefix}{i}.mmap")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            if size:
                os.ftruncate(fd, size)
                os.pwrite(fd, b"x", size // 2)
            os.close(fd)
            if mtime is not None:
                os.utime(path, (mtime, mtime))
        print(f"ready {os.getpid()}", flush=True)
    elif how == "held":
        directory, prefix, count = sys.argv[2], sys.argv[3], int(sys.argv[4])
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        held = []
        for i in range(count):
            path = os.path.join(directory, f"vllm_offload_{prefix}{i}.mmap")
            held.append(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
            os.unlink(path)
        _wait_for_stdin_close()
    else:
        raise SystemExit(f"unknown trick {how}")


def _leases(directory: str, count: int) -> None:
    """Write leases on region files of our own: every open by anyone else waits (or, with
    O_NONBLOCK, fails with EAGAIN) until the lease is broken; taken again at once."""
    signal.signal(signal.SIGIO, signal.SIG_IGN)  # a lease break must not kill us
    fds = []
    for i in range(count):
        path = os.path.join(directory, f"vllm_offload_lease{i}.mmap")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, 8192)
        os.close(fd)
        fds.append(os.open(path, os.O_RDONLY))
    stop = threading.Event()
    for fd in fds:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    threading.Thread(target=_wait_for_stdin_close, args=(stop,), daemon=True).start()
    while not stop.is_set():
        for fd in fds:
            try:
                if fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_WRLCK:
                    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
                    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            except OSError:
                pass
        time.sleep(0.05)


def _close_mmap_dups() -> None:
    """Close every descriptor but the standard ones: only the mapping holds the file."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                if os.readlink(f"/proc/self/fd/{fd}").endswith("(deleted)"):
                    os.close(fd)
            except OSError:
                pass


if __name__ == "__main__":
    main()
