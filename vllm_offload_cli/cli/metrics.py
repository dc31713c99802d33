"""node_exporter textfile output, shared by `inspect` and `gc`.

prometheus_client does the exposition format and the atomic write (temp file
and rename in the target directory); it is imported only when asked for.
"""

from __future__ import annotations

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
    from prometheus_client import generate_latest, write_to_textfile

    if output is None:
        sys.stdout.write(generate_latest(registry).decode())
        sys.stdout.flush()
        return
    if not output.parent.is_dir():
        raise InvalidInputError(f"cannot write {output}: directory {output.parent} does not "
                                "exist", path=str(output), code="bad_output")
    try:
        write_to_textfile(str(output), registry)
    except OSError as exc:
        raise OperationFailedError(f"cannot write {output}: {exc.strerror}",
                                   path=str(output)) from exc
