"""What a /proc scan cannot see: a holder found proves a region in use, none found proves
nothing unless /proc showed every process that could use it.

Host-wide blind spots (a PID namespace not the host's, a foreign /proc, `hidepid=`,
`subset=pid`) hide any number of processes; a waiver covers the namespace case only.
A hidden process (`HiddenProcess`: maps or descriptors unreadable) matters only for
files it could open. Callers say `unknown` unless region.fsguard.probe proves no other opener.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from vllm_offload_cli.core.base.problems import Problem
from vllm_offload_cli.core.system import mounts, procfs

# The initial PID namespace's inode number (PROC_PID_INIT_INO, fixed since Linux 3.8).
PROC_PID_INIT_INO = 0xEFFFFFFC

# CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER (chmod), CAP_SETUID: open any file
_OPEN_ANY_CAPS = (1 << 1) | (1 << 2) | (1 << 3) | (1 << 7)

PID_NAMESPACE = "pid_namespace"
FOREIGN_PROC = "proc_foreign_namespace"
HIDEPID = "proc_hidepid"
PROC_SUBSET = "proc_subset"
HIDDEN_HOLDERS = "hidden_holders"


@dataclass(frozen=True)
class HiddenProcess:
    """A process whose maps or descriptors we could not read."""

    pid: int
    uids: frozenset[int] | None  # real, effective, saved; None: unreadable
    open_any: bool  # holds a capability that bypasses file permissions

    def could_open(self, owner: int | None, mode: int | None) -> bool:
        return (self.uids is None or self.open_any or owner is None or mode is None
                or owner in self.uids or bool(mode & 0o077))


@dataclass(frozen=True)
class Visibility:
    """Everything that may hide a holder from this run's /proc scans."""

    blind_spots: tuple[Problem, ...]  # reasons the whole /proc view is incomplete
    hidden: tuple[HiddenProcess, ...]
    namespace_waived: bool = False

    @property
    def effective(self) -> tuple[Problem, ...]:
        """Host-wide blind spots left after the operator's namespace waiver."""
        return tuple(b for b in self.blind_spots
                     if not (b.code == PID_NAMESPACE and self.namespace_waived))

    @property
    def blind(self) -> bool:
        return bool(self.effective)

    def could_hide(self, owner: int | None, mode: int | None) -> tuple[int, ...]:
        """Pids of hidden processes that could open a file of this owner and mode."""
        return tuple(h.pid for h in self.hidden if h.could_open(owner, mode))

    def to_dict(self) -> dict[str, object]:
        return {
            "complete": not self.blind and not self.hidden,
            "blind_spots": [b.to_dict() for b in self.effective],
            "waived": [b.code for b in self.blind_spots if b not in self.effective],
            "uninspectable_pids": [h.pid for h in self.hidden],
        }


def namespace_blind_spots() -> list[Problem]:
    """Are we, and is /proc, in the host's initial PID namespace?"""
    if not procfs.proc_shows_self():
        return [Problem(FOREIGN_PROC, "/proc is mounted from another PID namespace than "
                          "this process's, so it does not show the processes that matter")]
    if procfs.pid_namespace_inode() == PROC_PID_INIT_INO:
        return []
    return [Problem(PID_NAMESPACE, "this process runs in a PID namespace that is not the "
                      "host's (a container without hostPID?), so processes outside it that "
                      "map a region are invisible")]


def mount_blind_spots(table: list[mounts.Mount], groups: Collection[int]) -> list[Problem]:
    """hidepid hides processes we may not ptrace; subset=pid hides /proc/locks. What
    counts is the proc mount that path lookups of /proc see."""
    top = mounts.top_mount_at(procfs.PROC, table)
    if top is None or top.fstype != "proc":
        return []  # nothing there, or something else mounted over /proc
    hidepid, gid = top.options.get("hidepid"), top.options.get("gid")
    spots = []
    if hidepid not in (None, "0", "off") and not (gid and gid.isdigit() and int(gid) in groups):
        spots.append(Problem(HIDEPID, f"/proc is mounted with hidepid={hidepid}, so "
                               "processes this user may not inspect are hidden or unreadable"))
    if top.options.get("subset") == "pid":
        spots.append(Problem(PROC_SUBSET, "/proc is mounted with subset=pid, which hides "
                               "/proc/locks (who holds a region's lock)"))
    return spots


def host_blind_spots() -> list[Problem]:
    """Every host-wide blind spot of this process, read afresh."""
    groups = {os.getegid(), *os.getgroups()}
    return namespace_blind_spots() + mount_blind_spots(mounts.mounts(), groups)


def hidden_process(pid: int) -> HiddenProcess | None:
    """Who a process runs as, and whether it may open any file (None: it is gone).
    Unreadable owner or capabilities count as "could open it"."""
    ids = procfs.credentials(pid)
    if ids is procfs.GONE:
        return None
    if isinstance(ids, procfs.Unreadable):
        return HiddenProcess(pid, None, True)
    return HiddenProcess(pid, ids[0], bool(ids[1] & _OPEN_ANY_CAPS))


class MayOpen:
    """Whether a process could have opened a file of this owner and mode by itself (the
    rule that makes a hidden process matter): the processes a search for its holders
    must read. `seen` keeps each credential read, so `assess` does not read it again."""

    def __init__(self, owner: int, mode: int) -> None:
        self.owner, self.mode = owner, mode
        self.seen: dict[int, HiddenProcess | None] = {}

    def __call__(self, pid: int) -> bool:
        h = self.seen[pid] = hidden_process(pid)
        return h is not None and h.could_open(self.owner, self.mode)


def assess(denied_pids: Iterable[int], *, namespace_waived: bool = False,
           seen: Mapping[int, HiddenProcess | None] | None = None) -> Visibility:
    """This run's visibility, from the pids a scan could not read (and credentials
    already read by `MayOpen`)."""
    seen = seen or {}
    hidden = (seen[p] if p in seen else hidden_process(p) for p in sorted(set(denied_pids)))
    return Visibility(tuple(host_blind_spots()), tuple(h for h in hidden if h is not None),
                      namespace_waived)


def advice(spots: Iterable[Problem]) -> str:
    """What an operator can do about these blind spots."""
    codes = {b.code for b in spots}
    tips = []
    if codes & {PID_NAMESPACE, FOREIGN_PROC}:
        tips.append("run it in the host's PID namespace (Kubernetes: hostPID: true; docker: "
                    "--pid=host), or pass --shm-private-to-namespace if this shm directory "
                    "is used only inside this namespace")
    if HIDEPID in codes:
        tips.append("run it as root with CAP_SYS_PTRACE on a /proc without hidepid (systemd: "
                    "no ProtectProc=), or in the group named by /proc's gid= option")
    if PROC_SUBSET in codes:
        tips.append("mount /proc without subset=pid (systemd: no ProcSubset=pid)")
    return "; ".join(tips)
