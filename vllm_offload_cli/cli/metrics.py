"""node_exporter textfiles of `inspect` and `gc`, written by us: prometheus_client's
`write_to_textfile` uses a predictable `PATH.PID.TID`, which follows a planted symlink."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from vllm_offload_cli.core.base import errors

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

# listed of each other owner, the rest summed: output grows with owners, not their files
LISTED_PER_OWNER = 32

_T = TypeVar("_T")


def per_owner(items: Iterable[_T], uid: Callable[[_T], int | None], everything: bool = False
              ) -> tuple[list[_T], dict[int | None, list[_T]]]:
    """(listed, the rest by owner): the caller's own, and the first of every other owner."""
    me, seen = os.geteuid(), Counter[int | None]()
    listed: list[_T] = []
    rest: dict[int | None, list[_T]] = {}
    for item in items:
        owner = uid(item)
        seen[owner] += 1
        if everything or owner == me or seen[owner] <= LISTED_PER_OWNER:
            listed.append(item)
        else:
            rest.setdefault(owner, []).append(item)
    return listed, rest


# a textfile of ours is a few KiB; a bigger one is not ours to parse
_PREVIOUS_MAX_BYTES = 1 << 20


def previous_totals(output: Path, names: Iterable[str]) -> dict[str, float]:
    """The `*_total` counters last written into `output`, read only from a small regular file
    of this user, not through a link; anything else restarts at 0 (a reset to increase())."""
    wanted = set(names)
    try:
        with open(os.open(output, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC),
                  "rb") as f:
            st = os.fstat(f.fileno())
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                    or st.st_size > _PREVIOUS_MAX_BYTES):
                return {}
            text = f.read(_PREVIOUS_MAX_BYTES).decode("utf-8", "replace")
    except OSError:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if f.type == "counter" and s.name in wanted and not s.labels
                and math.isfinite(s.value) and s.value >= 0}
    except ValueError:  # not the exposition format: start again
        return {}


def add_totals(registry: CollectorRegistry, totals: Mapping[str, tuple[str, float]]) -> None:
    """Counters `{name_total: (help, value)}` without `_created` samples (no process start)."""
    from prometheus_client.core import CounterMetricFamily

    class Totals:
        def collect(self) -> Iterable[CounterMetricFamily]:
            for name, (doc, value) in totals.items():
                yield CounterMetricFamily(name.removesuffix("_total"), doc, value=value)

    registry.register(Totals())


def _temp_name(output: Path) -> Path:
    # node_exporter reads only *.prom: a killed writer's leftover is never scraped;
    # os.urandom, not secrets (which loads hmac and OpenSSL into every gc and inspect)
    return output.parent / f".{output.name}.{os.urandom(8).hex()}.tmp"


def _bad_output(output: Path, why: str) -> errors.InvalidInputError:
    return errors.InvalidInputError(f"cannot write {output}: {why}", path=str(output),
                                    code="bad_output")


def check_writable(output: Path) -> None:
    """Refuse (exit 2) unless `output` can be written, as a regular file, not a link."""
    if not output.parent.is_dir():
        raise _bad_output(output, f"directory {output.parent} does not exist")
    try:
        if not stat.S_ISREG(os.lstat(output).st_mode):
            raise _bad_output(output, "it exists and is not a regular file")
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise _bad_output(output, exc.strerror or str(exc)) from exc
    probe = _temp_name(output)
    try:
        os.close(os.open(probe, _CREATE, 0o600))
    except OSError as exc:
        raise _bad_output(output, f"{exc.strerror} (creating a file in {output.parent})"
                          ) from exc
    with contextlib.suppress(OSError):
        os.unlink(probe)


def emit(registry: CollectorRegistry, output: Path | None) -> None:
    """Write atomically to `output`, or print to stdout when it is None."""
    from prometheus_client import generate_latest

    text = generate_latest(registry)
    if output is None:
        sys.stdout.write(text.decode())
        sys.stdout.flush()
        return
    if not output.parent.is_dir():
        raise _bad_output(output, f"directory {output.parent} does not exist")
    try:
        write_atomically(output, text)
    except OSError as exc:  # no room: exit 5, not "the operation failed"
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise (errors.InsufficientSpaceError if full else errors.OperationFailedError)(
            f"cannot write {output}: {exc.strerror}", path=str(output)) from exc


def write_atomically(output: Path, data: bytes) -> None:
    """Via a fresh file beside `output` (O_EXCL|O_NOFOLLOW: nothing planted is followed)."""
    tmp = _temp_name(output)
    fd = os.open(tmp, _CREATE, 0o644)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(fd, 0o644)  # node_exporter runs as its own user: it must read it
            os.fsync(fd)
        os.replace(tmp, output)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # ours: created O_EXCL above
        raise
