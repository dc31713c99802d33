"""Opening names in a world-writable directory without trusting them.

Every existing region is opened without O_CREAT, with O_NOFOLLOW, and judged
by `fstat` of the descriptor (never by a second lookup of the name): a regular
file, owned by an allowed uid, no group/other bits, one link, the exact size.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Collection

from vllm_offload_cli.core.base.errors import (
    OperationFailedError,
    RegionBusyError,
    RegionNotFoundError,
    UnsafeRegionError,
)
from vllm_offload_cli.core.base.problems import Problem
from vllm_offload_cli.core.system.files import UNTRUSTED_OPEN_FLAGS, FileId

OPEN_EXISTING_FLAGS = UNTRUSTED_OPEN_FLAGS


def default_allowed_uids() -> frozenset[int]:
    return frozenset({os.geteuid()})


class _EveryUid(frozenset[int]):
    """Matches any owner: root inspecting other users' regions legitimately."""

    def __contains__(self, item: object) -> bool:
        return True


EVERY_UID: frozenset[int] = _EveryUid()


def inspection_uids(allowed_uids: Collection[int] | None) -> Collection[int] | None:
    """Owners a reader accepts: root looks at every user's regions as legitimate."""
    if allowed_uids is None and os.geteuid() == 0:
        return EVERY_UID
    return allowed_uids


def stat_problems(
    st: os.stat_result,
    *,
    allowed_uids: Collection[int] | None = None,
    expected_size: int | None = None,
    expect_linked: bool = True,
) -> list[Problem]:
    """Everything that makes a file unsafe to treat as one of our regions."""
    problems: list[Problem] = []
    if stat.S_ISLNK(st.st_mode):
        return [Problem("symlink", "is a symbolic link; region names are never followed")]
    if not stat.S_ISREG(st.st_mode):
        return [Problem("not_regular_file", "is not a regular file")]
    uids = default_allowed_uids() if allowed_uids is None else allowed_uids
    if st.st_uid not in uids:
        expected = " or ".join(str(u) for u in sorted(uids))
        problems.append(Problem("foreign_owner", f"is owned by uid {st.st_uid}, not {expected}"))
    if st.st_mode & 0o077:
        problems.append(Problem(
            "unsafe_mode",
            f"has mode {stat.S_IMODE(st.st_mode):04o}; group/other permission bits must be "
            "clear (expected 0600)",
        ))
    if expect_linked and st.st_nlink != 1:
        problems.append(Problem(
            "link_count", f"has {st.st_nlink} hard links; a region must have exactly one",
        ))
    if expected_size is not None and st.st_size != expected_size:
        problems.append(Problem(
            "size_mismatch", f"is {st.st_size} bytes; its geometry needs {expected_size}",
        ))
    return problems


def raise_if_unsafe(
    st: os.stat_result,
    path: str,
    *,
    engine_id: str | None = None,
    allowed_uids: Collection[int] | None = None,
    expected_size: int | None = None,
) -> None:
    """Turn the first problem of `stat_problems` into an UnsafeRegionError."""
    problems = stat_problems(st, allowed_uids=allowed_uids, expected_size=expected_size)
    if problems:
        first = problems[0]
        hint = _HINTS.get(first.code, "")
        raise UnsafeRegionError(f"{path} {first.message}; refusing to use it{hint}",
                                path=path, engine_id=engine_id, code=first.code)


_HINTS = {
    "foreign_owner": " (another user may have planted it; check who owns it)",
    "unsafe_mode": " (fix with chmod 600 if it is yours)",
    "size_mismatch": (
        " (a leftover from an engine with another geometry? `vllm-offload inspect` shows it, "
        "`vllm-offload gc` removes it once nothing uses it)"
    ),
}


# O_NONBLOCK (so a FIFO named like a region cannot hang us) also makes open()
# fail with EAGAIN instead of waiting while another process holds a lease on
# the file: gc holds one for moments while it proves a region unused.
_LEASE_WAIT_SECONDS = 5.0


def _open_waiting_out_leases(path: str, flags: int) -> int:
    deadline = time.monotonic() + _LEASE_WAIT_SECONDS
    while True:
        try:
            return os.open(path, flags)
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.002)


def open_existing(path: str, flags: int = os.O_RDONLY, *, engine_id: str | None = None) -> int:
    """Open an existing name without creating it and without following a link."""
    try:
        return _open_waiting_out_leases(path, flags | OPEN_EXISTING_FLAGS)
    except BlockingIOError:
        raise RegionBusyError(f"{path} stayed leased by another process for "
                              f"{_LEASE_WAIT_SECONDS:.0f} s (a stuck garbage collection?)",
                              path=path, engine_id=engine_id) from None
    except FileNotFoundError:
        raise RegionNotFoundError(f"{path} does not exist", path=path,
                                  engine_id=engine_id) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeRegionError(
                f"{path} is a symbolic link; region names are never followed",
                path=path, engine_id=engine_id, code="symlink",
            ) from None
        if exc.errno in (errno.EISDIR, errno.ENXIO):
            raise UnsafeRegionError(f"{path} is not a regular file", path=path,
                                    engine_id=engine_id, code="not_regular_file") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise UnsafeRegionError(f"{path}: permission denied; it belongs to someone else",
                                    path=path, engine_id=engine_id,
                                    code="foreign_owner") from None
        raise OperationFailedError(f"cannot open {path}: {exc.strerror}", path=path,
                                   engine_id=engine_id) from exc


def same_file_at(path: str, fd: int) -> bool:
    """True when `path` still names the inode open as `fd` (no link followed)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return FileId.of(st) == FileId.of(os.fstat(fd))


def unlink_if_same(path: str, fd: int) -> bool:
    """Unlink `path` only if it still names the inode open as `fd`."""
    if not same_file_at(path, fd):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
