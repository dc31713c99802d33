"""Commands run as another user (nobody), from a copy of the code that user can read.

The checkout under test may be private (a clone under /root, or in a
`mktemp -d` folder of mode 0700): another user can neither open a helper
script there nor import the package from it, nor, often, run the virtual
environment's interpreter. `prepared` copies what such commands need into a
fresh directory of mode 0755: the package under test, tests/helpers, and the
distributions the node-local commands import (click, rich, psutil,
prometheus_client and what they require; never torch). It then picks an
interpreter of this Python version that the user can run, proved by running
it as that user. `OtherUser.command` runs an argv there as that user, with
only the copy on the import path (`-S`: no site-packages of anyone else).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

import vllm_offload_cli

NOBODY = 65534
HELPERS = Path(__file__).parent
# What `gc`, `inspect` and the core import; their requirements are followed.
DISTRIBUTIONS = ("click", "rich", "psutil", "prometheus_client")
_PROBE = ("import sys, psutil, vllm_offload_cli.cli.app, vllm_offload_cli.core.region.fsguard; "
          "print(*sys.version_info[:2])")


@dataclass(frozen=True)
class OtherUser:
    """A user id, the copy it runs from (`home`) and an interpreter it can run."""

    uid: int
    home: Path
    python: str

    def command(self, *argv: str) -> list[str]:
        """`argv` as this user (no groups), in `home`, with only the copy on the path."""
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
                "env", f"--chdir={self.home}", f"PYTHONPATH={self.home}:{self.home / 'site'}",
                "PYTHONNOUSERSITE=1", "PYTHONDONTWRITEBYTECODE=1", *argv]

    def python_command(self, *args: str) -> list[str]:
        return self.command(self.python, "-S", *args)

    def cli(self, *args: str) -> list[str]:
        """`python -m vllm_offload_cli ARGS`, of the package under test, as this user."""
        return self.python_command("-m", "vllm_offload_cli", *args)

    def helper(self, name: str) -> str:
        """The copy of tests/helpers/NAME that this user can read."""
        return str(self.home / "helpers" / name)


def _closure(names: tuple[str, ...]) -> list[importlib.metadata.Distribution]:
    """The installed distributions `names` and everything they require (no extras)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in found:
            continue
        found[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def _copy_distribution(dist: importlib.metadata.Distribution, site: Path) -> None:
    if dist.files is None:
        raise LookupError(f"{dist.metadata['Name']} lists no files (no RECORD)")
    for rel in dist.files:
        if rel.parts[0] == ".." or "__pycache__" in rel.parts:
            continue  # scripts in bin/, byte code
        source = Path(str(dist.locate_file(rel)))
        if source.is_file():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, site / rel)


def _open_to_all(root: Path) -> None:
    """Directories 0755, files 0644: the checkout's own modes may be private (umask 077)."""
    os.chmod(root, 0o755)
    for directory, subdirs, files in os.walk(root):
        for name in subdirs:
            os.chmod(os.path.join(directory, name), 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), stat.S_IRUSR | stat.S_IWUSR
                     | stat.S_IRGRP | stat.S_IROTH)


def _interpreters() -> list[str]:
    """Interpreters of this Python version, most likely the one we run first."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [getattr(sys, "_base_executable", None), sys.executable,
                  os.path.realpath(sys.executable), shutil.which(version),
                  f"/usr/bin/{version}", f"/usr/local/bin/{version}"]
    seen: list[str] = []
    for c in candidates:
        if c and c not in seen and os.path.isfile(c):
            seen.append(c)
    return seen


def _pick_python(user: OtherUser) -> tuple[str | None, list[str]]:
    """The first interpreter that, run as `user`, imports the copied package; else why not."""
    want = f"{sys.version_info[0]} {sys.version_info[1]}"
    tried: list[str] = []
    for python in _interpreters():
        probe = subprocess.run(user.command(python, "-S", "-c", _PROBE), capture_output=True,
                               text=True, timeout=60, check=False)
        if probe.returncode == 0 and probe.stdout.strip() == want:
            return python, tried
        last = (probe.stderr.strip().splitlines() or [probe.stdout.strip()])[-1]
        tried.append(f"{python}: {last}")
    return None, tried


@contextmanager
def prepared(uid: int = NOBODY) -> Iterator[OtherUser | str]:
    """Yield an `OtherUser` ready to run commands as `uid`, or the reason there is none.

    Needs root (setpriv changes the uid). The copy is removed afterwards.
    """
    if shutil.which("setpriv") is None:
        yield "setpriv is not installed"
        return
    home = Path(tempfile.mkdtemp(prefix="vllm-offload-test-user-"))
    try:
        package = Path(vllm_offload_cli.__file__).parent
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(package, home / package.name, ignore=ignore)
        shutil.copytree(HELPERS, home / "helpers", ignore=ignore)
        site = home / "site"
        site.mkdir()
        for dist in _closure(DISTRIBUTIONS):
            _copy_distribution(dist, site)
        _open_to_all(home)
        python, tried = _pick_python(OtherUser(uid, home, ""))
        if python is None:
            yield (f"no Python {sys.version_info[0]}.{sys.version_info[1]} that uid {uid} "
                   f"can run from a copy in {home}: " + "; ".join(tried))
        else:
            yield OtherUser(uid, home, python)
    finally:
        shutil.rmtree(home, ignore_errors=True)
