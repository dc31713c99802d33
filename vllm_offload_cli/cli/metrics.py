"""node_exporter textfile output, shared by `inspect` and `gc`.

prometheus_client does the exposition format (imported only when asked for);
the atomic write is ours: its `write_to_textfile` opens a predictable
`PATH.PID.TID` with plain open(), which follows a symlink planted there.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_offload_cli.core.base.errors import InvalidInputError, OperationFailedError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


def new_registry() -> CollectorRegistry:
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()


def emit(registry: CollectorRegistry, output: Path | None) -> None:
    """Write atomically to `output`, or print to stdout when it is None."""
    from prometheus_client import generate_latest

    text = generate_latest(registry)
    if output is None:
        sys.stdout.write(text.decode())
        sys.stdout.flush()
        return
    if not output.parent.is_dir():
        raise InvalidInputError(f"cannot write {output}: directory {output.parent} does not "
                                "exist", path=str(output), code="bad_output")
    try:
        write_atomically(output, text)
    except OSError as exc:
        raise OperationFailedError(f"cannot write {output}: {exc.strerror}",
                                   path=str(output)) from exc


def write_atomically(output: Path, data: bytes) -> None:
    """A fresh file with an unguessable name beside `output` (O_EXCL|O_NOFOLLOW: nothing
    planted there is followed or reused), written, flushed, then renamed over it."""
    tmp = output.with_name(f".{output.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
            f.flush()
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, output)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
