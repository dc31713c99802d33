"""Known failures, each carrying the path, engine_id and pid it concerns, and its exit
status: the CLI prints one line and exits with it; anything else stays a bug."""

from __future__ import annotations

from typing import ClassVar

from vllm_offload_cli.core.base.exit_status import ExitStatus


class OffloadError(Exception):
    """Base class of every failure the toolkit reports to users."""

    code = "error"
    exit_status: ClassVar[ExitStatus] = ExitStatus.FAILED

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        engine_id: str | None = None,
        pid: int | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.engine_id = engine_id
        self.pid = pid
        if code is not None:
            self.code = code


class InvalidInputError(OffloadError, ValueError):
    """An argument is malformed: engine_id, size, geometry, device list."""

    code = "invalid_input"
    exit_status = ExitStatus.USAGE


class SlotOverflowError(InvalidInputError, AssertionError):
    """A view would run past this worker's slot (or the row): an AssertionError too,
    because vLLM's own class asserts there and its callers expect that type."""

    code = "slot_overflow"


class RegionNotFoundError(OffloadError, LookupError):
    """No region with that engine_id exists in the shm directory."""

    code = "not_found"
    exit_status = ExitStatus.USAGE


class RegionBusyError(OffloadError):
    """The name is taken, or the region is held by a live process."""

    code = "busy"
    exit_status = ExitStatus.BUSY


class InsufficientSpaceError(OffloadError):
    """tmpfs, the cgroup or the host does not have room for the region."""

    code = "no_space"
    exit_status = ExitStatus.NO_SPACE


class UnsafeRegionError(OffloadError):
    """A file fails the safety checks: symlink, owner, mode, links, size."""

    code = "unsafe"
    exit_status = ExitStatus.UNSAFE


class RegionTimeoutError(OffloadError, TimeoutError):
    """A wait on another process ran out (`timeout` is the command's own --timeout)."""

    code = "wait_timeout"


class OperationFailedError(OffloadError):
    """A system call failed for a reason that is not the caller's input."""

    code = "failed"


class DeviceUnavailableError(InsufficientSpaceError):
    """The requested accelerator is absent: like no space, the host lacks the memory."""

    code = "no_device"


class MissingExtraError(InvalidInputError):
    """A needed extra is not installed (nothing failed); the message ends with `pip install`."""

    code = "extra_not_installed"

    def __init__(self, message: str, *, install: str) -> None:
        super().__init__(message)
        self.install = install
