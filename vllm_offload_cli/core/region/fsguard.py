"""Region files in a world-writable directory, handled without trusting them: opened with
no O_CREAT and no link followed, judged by `fstat` of the descriptor (never by a second
lookup), locked with flock, and asked of the kernel whether anyone else has them open."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import pwd
import signal
import stat
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from vllm_offload_cli.core.base import errors
from vllm_offload_cli.core.base.deadline import poll_until
from vllm_offload_cli.core.base.problems import Problem
from vllm_offload_cli.core.system.files import UNTRUSTED_OPEN_FLAGS, FileId


class EveryUid:
    """The type of EVERY_UID: a file of any owner counts (root looking at every user's)."""

    def __repr__(self) -> str:
        return "EVERY_UID"


EVERY_UID = EveryUid()
# Whose files count as ours: these uids, EVERY_UID, or None (the caller's euid alone).
AllowedUids = Collection[int] | EveryUid | None


def uid_allowed(uid: int, allowed_uids: AllowedUids) -> bool:
    if isinstance(allowed_uids, EveryUid):
        return True
    return uid in ((os.geteuid(),) if allowed_uids is None else allowed_uids)


def inspection_uids() -> AllowedUids:
    """Owners a reader accepts: root looks at every user's regions as legitimate."""
    return EVERY_UID if os.geteuid() == 0 else None


def stat_problems(
    st: os.stat_result,
    *,
    allowed_uids: AllowedUids = None,
    expected_size: int | None = None,
    expect_linked: bool = True,
) -> list[Problem]:
    """Everything that makes a file unsafe to treat as one of our regions."""
    if stat.S_ISLNK(st.st_mode):
        return [Problem("symlink", "is a symbolic link; region names are never followed")]
    if not stat.S_ISREG(st.st_mode):
        return [Problem("not_regular_file", "is not a regular file")]
    problems = []
    uids = (os.geteuid(),) if allowed_uids is None else allowed_uids
    if not isinstance(uids, EveryUid) and st.st_uid not in uids:
        expected = " or ".join(str(u) for u in sorted(uids))
        problems.append(Problem("foreign_owner", f"is owned by uid {st.st_uid}, not {expected}"))
    if st.st_mode & 0o077:
        problems.append(Problem("unsafe_mode", f"has mode {stat.S_IMODE(st.st_mode):04o}; "
                                "group/other permission bits must be clear (expected 0600)"))
    if expect_linked and st.st_nlink != 1:
        problems.append(Problem(
            "link_count", f"has {st.st_nlink} hard links; a region must have exactly one"))
    if expected_size is not None and st.st_size != expected_size:
        problems.append(Problem(
            "size_mismatch", f"is {st.st_size} bytes; its geometry needs {expected_size}"))
    return problems


def raise_if_unsafe(
    st: os.stat_result,
    path: str,
    *,
    engine_id: str | None = None,
    allowed_uids: AllowedUids = None,
    expected_size: int | None = None,
) -> None:
    """Turn the first problem of `stat_problems` into an UnsafeRegionError."""
    if problems := stat_problems(st, allowed_uids=allowed_uids, expected_size=expected_size):
        code, message = problems[0].code, problems[0].message
        raise errors.UnsafeRegionError(
            f"{path} {message}; refusing to use it{_HINTS.get(code, '')}", path=path,
            engine_id=engine_id, code=code)


_HINTS = {
    "foreign_owner": " (another user may have planted it; check who owns it)",
    "unsafe_mode": " (fix with chmod 600 if it is yours)",
    "size_mismatch": (
        " (a leftover from an engine with another geometry? `vllm-offload inspect` shows it, "
        "`vllm-offload gc` removes it once nothing uses it)"
    ),
}


class LeaseWait:
    """How long opens may wait out other processes' leases (O_NONBLOCK makes open() fail
    with EAGAIN then), all together: one budget per run, as anyone may lease their own
    files, and a wait per file would let them set how long a run takes."""

    def __init__(self, seconds: float = 5.0) -> None:
        self.seconds = seconds
        self.left = seconds

    def open(self, path: str, flags: int) -> int | None:
        """A descriptor, or None when the file stayed leased past what is left."""
        def attempt() -> int | None:
            try:
                return os.open(path, flags)
            except BlockingIOError:
                return None
        began = time.monotonic()
        try:
            return poll_until(attempt, max(self.left, 0.0), backoff=(0.002, 0.002))
        finally:
            self.left -= time.monotonic() - began


_NOT_REGULAR = ("not_regular_file", " is not a regular file")
_DENIED = ("foreign_owner", ": permission denied; it belongs to someone else")
_REFUSED_OPENS = {errno.ELOOP: ("symlink", " is a symbolic link; region names are never followed"),
                  errno.EISDIR: _NOT_REGULAR, errno.ENXIO: _NOT_REGULAR,
                  errno.EACCES: _DENIED, errno.EPERM: _DENIED}


def open_existing(path: str, flags: int = os.O_RDONLY, *, engine_id: str | None = None,
                  lease_wait: LeaseWait | None = None) -> int:
    """Open an existing name, no O_CREAT, no link followed; a lease is waited out within
    `lease_wait` (the caller's budget for all its opens; by default 5 s for this one)."""
    wait = LeaseWait() if lease_wait is None else lease_wait
    try:
        fd = wait.open(path, flags | UNTRUSTED_OPEN_FLAGS)
    except FileNotFoundError:
        raise errors.RegionNotFoundError(f"{path} does not exist", path=path,
                                         engine_id=engine_id) from None
    except OSError as exc:
        if exc.errno in _REFUSED_OPENS:
            code, what = _REFUSED_OPENS[exc.errno]
            raise errors.UnsafeRegionError(f"{path}{what}", path=path, engine_id=engine_id,
                                           code=code) from None
        raise errors.OperationFailedError(f"cannot open {path}: {exc.strerror}", path=path,
                                          engine_id=engine_id) from exc
    if fd is None:
        raise errors.RegionBusyError(f"{path} stayed leased by another process for "
                                     f"{wait.seconds:g} s (a stuck garbage collection?)",
                                     path=path, engine_id=engine_id)
    return fd


def create_exclusive(path: str, flags: int = os.O_RDWR, *, engine_id: str | None = None
                     ) -> int:
    """open(O_CREAT|O_EXCL|O_NOFOLLOW, 0600): FileExistsError when the name is taken;
    a filesystem out of space or inodes is InsufficientSpaceError saying which."""
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                       0o600)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise no_space(path, exc, engine_id=engine_id) from None


def no_space(path: str, exc: OSError, *, engine_id: str | None = None
             ) -> errors.InsufficientSpaceError:
    """ENOSPC/EDQUOT as a refusal that says whether bytes or inodes ran out."""
    directory = os.path.dirname(path) or "."
    why = exc.strerror or "no space left"
    with contextlib.suppress(OSError):
        if (vfs := os.statvfs(directory)).f_files and vfs.f_ffree == 0:
            why = (f"{directory} has no free inodes left ({vfs.f_files} in all; the tmpfs "
                   "nr_inodes limit): remove leftovers with `vllm-offload gc`, or remount it "
                   "with a larger nr_inodes")
    return errors.InsufficientSpaceError(f"cannot create {path}: {why}", path=path,
                                         engine_id=engine_id, code="no_space")


def same_file_at(path: str, fd: int) -> bool:
    """True when `path` still names the inode open as `fd` (no link followed)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return FileId.of(st) == FileId.of(os.fstat(fd))


def unlink_if_same(path: str, fd: int, *, private_fd: int | None = None) -> bool:
    """Unlink `path` only if it names the inode open as `fd`; True when it did. With
    `private_fd` (this user's `private_dir`) it cannot be raced: the name is renamed into
    that directory, where only this user and root can rename it again, checked there and
    unlinked; anything else caught is linked back, never over a newer file."""
    if not same_file_at(path, fd):
        return False
    if private_fd is None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True
    want = FileId.of(os.fstat(fd))
    moved = f"unlink.{os.getpid()}.{os.urandom(8).hex()}"  # what secrets.token_hex reads
    try:
        os.rename(path, moved, dst_dir_fd=private_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.EXDEV):
            raise
        return False  # the name (or the private directory) went, or a mount is over it
    st = os.stat(moved, dir_fd=private_fd, follow_symlinks=False)
    if FileId.of(st) == want:
        os.unlink(moved, dir_fd=private_fd)
        return True
    _put_back(moved, path, private_fd, st)
    return False


def _put_back(moved: str, path: str, private_fd: int, st: os.stat_result) -> None:
    """Return a file the rename caught by mistake, never over a newer one."""
    try:
        if stat.S_ISDIR(st.st_mode):  # no hard links to directories
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, "name taken")
            os.rename(moved, path, src_dir_fd=private_fd)
            return
        os.link(moved, path, src_dir_fd=private_fd, follow_symlinks=False)
        os.unlink(moved, dir_fd=private_fd)
    except FileExistsError:
        raise OSError(errno.EEXIST, f"{path} was renamed while it was being removed and its "
                      f"name was taken again; the file caught is kept in this user's "
                      f"private directory as {moved}") from None


def private_dir_name(uid: int | None = None) -> str:
    """{shm_dir}/.vllm-offload-{uid}, 0700: this user's start-up lock, where removals are
    checked."""
    return f".vllm-offload-{os.geteuid() if uid is None else uid}"


@functools.lru_cache(maxsize=256)
def user_name(uid: int) -> str | None:
    """The account name of `uid`, None when it has none (cached: a table asks for a few)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def user_text(uid: int) -> str:
    """'uid 65534 (nobody)'."""
    name = user_name(uid)
    return f"uid {uid}" if name is None else f"uid {uid} ({name})"


def private_dir(shm_dir: str | os.PathLike[str]) -> int:
    """A descriptor of this user's private directory in `shm_dir`, made if needed: owned
    by this user, mode 0700, on the shm filesystem; else a squatted name, refused."""
    shm = os.fspath(shm_dir)
    name = private_dir_name()
    path = os.path.join(shm, name)
    dfd = os.open(shm, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.mkdir(name, 0o700, dir_fd=dfd)
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise no_space(path, exc) from None
            raise errors.OperationFailedError(f"cannot make {path}: {exc.strerror}",
                                              path=path) from None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | UNTRUSTED_OPEN_FLAGS, dir_fd=dfd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            raise _squatted(path, os.stat(name, dir_fd=dfd, follow_symlinks=False)) from None
        st = os.fstat(fd)
        if (st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077
                or st.st_dev != os.fstat(dfd).st_dev):
            os.close(fd)
            raise _squatted(path, st)
        return fd
    finally:
        os.close(dfd)


def _squatted(path: str, st: os.stat_result) -> errors.UnsafeRegionError:
    what = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else
            "not a directory" if not stat.S_ISDIR(st.st_mode) else
            f"mode {stat.S_IMODE(st.st_mode):04o}, not 0700" if st.st_uid == os.geteuid()
            else "a directory")
    return errors.UnsafeRegionError(
        f"{path} is {what} owned by {user_text(st.st_uid)}; this user's private directory "
        "(start-up lock, checked removals) must be its own, mode 0700: another user squats "
        "the name. Check and remove it as root", path=path, code="squatted")


# -- flock: a LOCK_SH held for life makes "can anyone take LOCK_EX?" a liveness test that
# needs no process scan, cannot be fooled by pid reuse, and ends even with SIGKILL. -----

def try_lock(fd: int, operation: int = fcntl.LOCK_EX) -> bool:
    """flock(fd, operation) without waiting; False when another holder is in the way."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def lock_waiting(fd: int, operation: int, *, timeout: float,
                 timed_out: Callable[[], Exception]) -> None:
    """flock(fd, operation) polled, not blocking in the kernel; `timed_out()` at `timeout`."""
    if poll_until(lambda: try_lock(fd, operation) or None, timeout) is None:
        raise timed_out()


def lock_shared(fd: int, *, timeout: float, path: str = "") -> None:
    """Take LOCK_SH, waiting out a brief exclusive holder such as a gc probe."""
    lock_waiting(fd, fcntl.LOCK_SH, timeout=timeout, timed_out=lambda: errors.RegionTimeoutError(
        f"{path} stayed exclusively locked for {timeout:.0f} s; "
        "is a garbage collection stuck on it?", path=path))


# -- Is a file open anywhere else? Asked of the kernel, not of /proc. A write lease
# (F_SETLEASE, F_WRLCK) is granted only when the caller's descriptor is the file's sole
# open description (a mapping or a descriptor parked in a socket keeps one), so it proves
# that no process, in any PID namespace, has the file open or mapped; a /proc scan sees
# only what it may inspect. Only the owner or CAP_LEASE gets one, else the answer is
# "cannot tell". A lease break signals SIGURG (F_SETSIG), whose default is to ignore it,
# instead of the fatal SIGIO; leases are held for moments. -------------------------------

# A refused lease is retried this long: another gc's or inspect's probe holds its
# descriptor for microseconds, a real user for as long as it lives.
_RETRY_SECONDS = 0.15
# for a probe that only labels or sorts (inspect; gc's first pass, which re-scans /proc
# for a refusal): the removal itself asks again with the patient default
QUICK_RETRY = 0.02


@dataclass(frozen=True)
class OpenersVerdict:
    """The answer for one file: `sole` True (only ours), False (open elsewhere),
    None (cannot tell), with `why` when it cannot tell."""

    sole: bool | None
    why: str = ""


def _try_lease(fd: int, retry: float) -> OpenersVerdict:
    fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)  # a lease break must not kill us

    def attempt() -> OpenersVerdict | None:
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            return OpenersVerdict(True)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                return OpenersVerdict(None, "not the file's owner and no CAP_LEASE")
            if exc.errno != errno.EAGAIN:
                return OpenersVerdict(None, f"lease refused: {exc.strerror}"
                                      " (fs.leases-enable=0?)")
        return None
    return poll_until(attempt, retry, backoff=(0.005, 0.05)) or OpenersVerdict(False)


@contextlib.contextmanager
def sole_opener(fds: list[int], *, retry: float = _RETRY_SECONDS
                ) -> Iterator[OpenersVerdict]:
    """Hold write leases on every fd for the block; the verdict is True only if every
    file is open nowhere else. Open each file once, read-only, and nowhere else while in
    the block: our own second open would wait on our own lease."""
    taken: list[int] = []
    try:
        verdict = OpenersVerdict(True)
        for fd in fds:
            if (verdict := _try_lease(fd, retry)).sole is not True:
                break
            taken.append(fd)
        yield verdict
    finally:
        for fd in taken:
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            except OSError as exc:
                if exc.errno != errno.EBADF:  # the caller closed it: no lease left
                    raise


def still_sole(fd: int) -> bool:
    """Under a granted lease: False once another process started to open the file (a
    pending break reports the lease's target type, not F_WRLCK)."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_WRLCK
    except OSError:
        return False


def probe(fd: int, *, retry: float = _RETRY_SECONDS) -> OpenersVerdict:
    """One probe, lease released at once: for readers that change nothing."""
    with sole_opener([fd], retry=retry) as verdict:
        return verdict
