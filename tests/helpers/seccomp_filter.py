"""Run a command under the seccomp filter a systemd unit's `SystemCallFilter=` lines make.

systemd builds the filter itself; here the same set is computed from the unit's own
lines (groups expanded by `systemd-analyze syscall-filter`, the lines applied in
order as systemd does: in allow-list mode a plain line adds, a `~` line removes)
and loaded with libseccomp through ctypes (libseccomp.so.2 ships with systemd on
every Debian and Ubuntu host). Syscalls outside the set fail with the unit's
`SystemCallErrorNumber=`, as under systemd.

As a script: `seccomp_filter.py ALLOWED_FILE ERRNO -- ARGV...` loads the filter
(one syscall name per line in ALLOWED_FILE) and execs ARGV under it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

SCMP_ACT_ALLOW = 0x7FFF0000


def _scmp_act_errno(number: int) -> int:
    return 0x00050000 | (number & 0xFFFF)


@functools.cache
def expand(item: str) -> frozenset[str]:
    """A syscall name, or every syscall of a `@group` (nested groups followed)."""
    if not item.startswith("@"):
        return frozenset({item})
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None
    out = subprocess.run([analyze, "syscall-filter", "--no-pager", item], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    names: set[str] = set()
    for line in out.splitlines()[1:]:
        word = line.strip()
        if not word or word.startswith("#"):
            continue
        names |= expand(word)
    return frozenset(names)


def unit_filter(unit_text: str) -> tuple[set[str], int]:
    """(allowed syscalls, errno) of a unit: its SystemCallFilter= lines in order."""
    allowed: set[str] | None = None
    number = errno.EPERM
    for line in unit_text.splitlines():
        key, _, value = line.partition("=")
        if key == "SystemCallErrorNumber":
            number = getattr(errno, value.strip())
        if key != "SystemCallFilter":
            continue
        invert = value.startswith("~")
        items = value.removeprefix("~").split()
        if allowed is None:
            assert not invert, "the shipped units use an allow-list"
            allowed = set(expand("@default"))  # systemd adds it to every allow-list
        for item in items:
            if invert:
                allowed -= expand(item)
            else:
                allowed |= expand(item)
    assert allowed is not None, "the unit has no SystemCallFilter="
    return allowed, number


def available() -> str | None:
    """Why this cannot run here, or None when it can."""
    if shutil.which("systemd-analyze") is None:
        return "needs systemd-analyze (systemd) to expand the unit's syscall groups"
    try:
        ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return "needs libseccomp.so.2"
    return None


def command(argv: list[str], allowed: set[str], number: int, workdir: Path) -> list[str]:
    """`argv` run under the filter allowing `allowed` (the list is written into workdir)."""
    listing = workdir / "allowed-syscalls"
    listing.write_text("\n".join(sorted(allowed)) + "\n")
    return [sys.executable, __file__, str(listing), str(number), "--", *argv]


def _load(allowed: list[str], number: int) -> None:
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                     ctypes.c_uint]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_scmp_act_errno(number))
    assert ctx
    for name in allowed:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:  # not a syscall of this architecture (e.g. a 32-bit *_time64)
            continue
        rc = lib.seccomp_rule_add(ctx, SCMP_ACT_ALLOW, nr, 0)
        assert rc == 0, (name, rc)
    rc = lib.seccomp_load(ctx)
    assert rc == 0, rc


if __name__ == "__main__":
    listing, num, sep, *argv = sys.argv[1:]
    assert sep == "--" and argv
    _load(Path(listing).read_text().split(), int(num))
    os.execvp(argv[0], argv)
