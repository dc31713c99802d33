"""A region user that is hard to see: for the blind-spot tests (stdlib only).

Usage: sneaky_holder.py PATH HOW [--via-link ALIAS] [--non-dumpable]
HOW:
  map        map the file, touch its first page, close the descriptor
  map-quiet  map the file without touching it (like the issue's reproducer)
  fd         keep only an open descriptor
--via-link ALIAS  open the file through a new hard link ALIAS, then remove ALIAS
--non-dumpable    prctl(PR_SET_DUMPABLE, 0) first: /proc/PID/{maps,fd} become
                  unreadable to every other user of the same uid

Runs with any interpreter (also /usr/bin/python3 as user nobody), prints
"ready PID" once it holds the file, then waits for stdin to close.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

PR_SET_DUMPABLE = 4


def main() -> None:
    path, how = sys.argv[1], sys.argv[2]
    rest = sys.argv[3:]
    alias = rest[rest.index("--via-link") + 1] if "--via-link" in rest else None
    if "--non-dumpable" in rest:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise SystemExit(f"prctl: {os.strerror(ctypes.get_errno())}")
    name = path
    if alias is not None:
        os.link(path, alias)
        name = alias
    fd = os.open(name, os.O_RDWR)
    if alias is not None:
        os.unlink(alias)  # from now on no name of ours shows the region's name
    mapped = None
    if how in ("map", "map-quiet"):
        mapped = mmap.mmap(fd, os.fstat(fd).st_size)
        if how == "map":
            mapped[0] = mapped[0]
        os.close(fd)
    elif how != "fd":
        raise SystemExit(f"unknown HOW {how}")
    print(f"ready {os.getpid()}", flush=True)
    sys.stdin.read()
    if mapped is not None:
        mapped.close()


if __name__ == "__main__":
    main()
