"""What every subcommand shares: common options, value types, the JSON envelope, the error
boundary. A subcommand is `(inv, **its_options) -> Outcome` under click's option decorators
(`subcommand()` adds the rest); rich loads only for a terminal's progress bars and warnings."""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import click
from click.core import ParameterSource

from vllm_offload_cli.core.base import errors
from vllm_offload_cli.core.base.exit_status import ExitStatus, with_statuses
from vllm_offload_cli.core.base.text import json_safe, printable

if TYPE_CHECKING:  # rich loads only when something is rendered for people
    from rich.console import Console

SCHEMA_VERSION = 1
SHM_DIR_ENV = "VLLM_OFFLOAD_SHM_DIR"


def text_table(headers: Sequence[str], rows: Iterable[Sequence[str]], *,
               right: Iterable[int] = ()) -> str:
    """A table as `ps` prints one: a line per row, never cut; cells already `printable`."""
    lines = [list(headers), *(list(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    aligned = set(right)
    return "\n".join("  ".join(c.rjust(w) if i in aligned else c.ljust(w)
                               for i, (c, w) in enumerate(zip(line, widths, strict=True))
                               ).rstrip() for line in lines)


@dataclass(frozen=True)
class Out:
    """Text for people, control characters as `\\xNN`: names come from other users."""

    file: TextIO

    def print(self, text: str) -> None:
        self.file.write("".join(printable(line) + "\n" for line in text.split("\n")))
        self.file.flush()


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """A command's result: `data` for the envelope, `render` for people."""

    data: dict[str, Any]
    exit_code: ExitStatus = ExitStatus.SUCCESS
    errors: list[dict[str, str]] = field(default_factory=list)
    render: Callable[[Out], object] | None = None


class _Diagnostics(logging.Handler):
    """Core log lines on stderr from `shown` up, escaped; warnings also in the envelope."""

    def __init__(self, warnings: list[dict[str, str]], shown: int) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        self.warnings, self.shown = warnings, shown

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.warnings.append({"code": getattr(record, "code", "warning"),
                                  "message": record.getMessage()})
        if record.levelno >= self.shown:
            sys.stderr.write(printable(self.format(record)) + "\n")


@dataclass(kw_only=True)
class Invocation:
    """One run of one subcommand (not frozen: `inspect --format json` sets `json_output`)."""

    command: str
    shm_dir: Path
    json_output: bool
    verbosity: int
    warnings: list[dict[str, str]] = field(default_factory=list)

    @cached_property
    def out(self) -> Out:
        return Out(sys.stdout)

    @cached_property
    def err(self) -> Out:
        return Out(sys.stderr)

    @cached_property
    def terminal(self) -> Console:
        """stderr for rich: only our own text, `printable` before markup is escaped."""
        from rich.console import Console

        return Console(file=sys.stderr, stderr=True, highlight=False)

    def warn(self, code: str, message: str) -> None:
        self.warnings.append({"code": code, "message": message})
        if self.verbosity < 0:
            return
        if sys.stderr.isatty():
            from rich.markup import escape

            self.terminal.print(f"[yellow]Warning:[/] {escape(printable(message))}",
                                soft_wrap=True)
        else:
            sys.stderr.write(f"Warning: {printable(message)}\n")

    def info(self, message: str) -> None:
        if self.verbosity >= 1:
            sys.stderr.write(f"{printable(message)}\n")

    @contextmanager
    def progress(self, description: str, total: int) -> Iterator[Callable[[int, int], None]]:
        """A transient progress bar on stderr, none with --json; yields update(done, total)."""
        if self.verbosity < 0 or self.json_output or not sys.stderr.isatty():
            yield lambda done, total: None
            return
        from rich import progress as rp

        with rp.Progress("[progress.description]{task.description}", rp.BarColumn(),
                         rp.DownloadColumn(binary_units=True), rp.TransferSpeedColumn(),
                         rp.TimeRemainingColumn(), console=self.terminal, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda done, total: bar.update(task, completed=done, total=total)


def envelope(command: str, *, ok: bool, exit_code: int, data: dict[str, Any],
             errors: list[dict[str, str]], warnings: list[dict[str, str]]) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "command": command, "ok": ok,
            "exit_code": int(exit_code), "data": data, "errors": errors, "warnings": warnings}


def print_json(doc: dict[str, Any]) -> None:
    """Strict JSON: never NaN, no lone surrogate (a byte of a name that is not UTF-8
    becomes `\\xNN`). One line into a pipe, where the C encoder is several times faster."""
    indent = 2 if sys.stdout.isatty() else None
    payload = json.dumps(doc, indent=indent, sort_keys=False, allow_nan=False)
    if "\\ud" in payload:  # a lone surrogate (a name that is not UTF-8), or a pair: redo
        payload = json.dumps(json_safe(doc), indent=indent, sort_keys=False, allow_nan=False)
    sys.stdout.write(payload + "\n")
    sys.stdout.flush()


@contextmanager
def _logging_to(inv: Invocation) -> Iterator[None]:
    level = logging.CRITICAL + 1 if inv.verbosity <= -2 else \
        max(logging.DEBUG, logging.WARNING - 10 * inv.verbosity)
    logger = logging.getLogger("vllm_offload_cli")
    handler = _Diagnostics(inv.warnings, level)
    logger.addHandler(handler)
    logger.setLevel(min(level, logging.WARNING))
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)


def evaluate(inv: Invocation, body: Callable[[], Outcome]
             ) -> tuple[dict[str, Any], Outcome | None, Exception | None]:
    """(envelope, outcome or None, a bug outside the error hierarchy) of `body`; no output."""
    bug = None
    try:
        outcome = body()
    except errors.OffloadError as exc:
        code, message, status = exc.code, exc.message, exc.exit_status
    except KeyboardInterrupt:
        code, message, status = "interrupted", "interrupted", ExitStatus.INTERRUPTED
    except Exception as exc:  # a bug: the caller keeps the traceback
        code, message, status = "internal_error", f"{type(exc).__name__}: {exc}", ExitStatus.FAILED
        bug = exc
    else:
        return envelope(inv.command, ok=outcome.exit_code == ExitStatus.SUCCESS,
                        exit_code=outcome.exit_code, data=outcome.data, errors=outcome.errors,
                        warnings=inv.warnings), outcome, None
    return envelope(inv.command, ok=False, exit_code=status, data={}, warnings=inv.warnings,
                    errors=[{"code": code, "message": message}]), None, bug


def run_boundary(inv: Invocation, body: Callable[[], Outcome]) -> int:
    """The CLI's one error boundary: known errors become one line and an exit code."""
    with _logging_to(inv):
        doc, outcome, bug = evaluate(inv, body)
        if inv.json_output:
            print_json(doc)
        elif outcome is None and bug is None:
            sys.stderr.write(f"Error: {printable(doc['errors'][0]['message'])}\n")
        elif outcome is not None and outcome.render is not None:
            outcome.render(inv.out)
    if bug is not None:
        raise bug
    return int(doc["exit_code"])


# value types: read as `core.base.units` reads them; a bad value is click's usage error (2)
class Size(click.ParamType):  # type: ignore[type-arg]  # generic in newer click
    """Bytes: `4096`, `64KiB`, `1G` (powers of 1024), `1GB` (of 1000)."""

    name = "size"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return self.name.upper()

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, (int, float)):  # converted already
            return value
        from vllm_offload_cli.core.base import units  # not loaded for --version or --help

        parse = units.parse_duration if self.name == "duration" else units.parse_size
        try:
            return parse(str(value), what="")
        except errors.InvalidInputError as exc:
            self.fail(exc.message.strip(), param, ctx)


class Duration(Size):
    """Seconds: `90`, `90s`, `5m`, `2h`, `1h30m`; 0 is a time already up."""

    name = "duration"


class ParsedChoice(click.Choice):  # type: ignore[type-arg]
    """One of `choices`, read by the core's own parser (its leniency, its message)."""

    def __init__(self, choices: list[str], parse: Callable[[str], Any]) -> None:
        super().__init__(choices)
        self.parse = parse

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        try:
            return self.parse(str(value))
        except errors.InvalidInputError as exc:
            self.fail(exc.message, param, ctx)


COMMON = ("shm_dir", "json_output", "verbose", "quiet")
ALIASES = {"gc": "garbage-collect"}


class Group(click.Group):
    """A command group that also answers to the aliases (`gc` for `garbage-collect`)."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, ALIASES.get(cmd_name, cmd_name))


def output_params() -> list[click.Parameter]:
    """--json, -v and -q: every command has them, the fleet's included."""
    return [
        click.Option(["--json", "json_output"], is_flag=True, help="Print exactly one JSON "
                     "document on stdout, nothing else: the envelope with this command's data "
                     "(JSON OUTPUT in vllm-offload(1))."),
        click.Option(["--verbose", "-v"], count=True, show_default=False,
                     help="More diagnostics on stderr (repeatable)."),
        click.Option(["--quiet", "-q"], count=True, show_default=False,
                     help="Fewer diagnostics on stderr (repeatable)."),
    ]


def common_params() -> list[click.Parameter]:
    """--shm-dir, --json, -v and -q: accepted before the command name and after it."""
    return [click.Option(["--shm-dir", "shm_dir"], type=click.Path(file_okay=False,
                                                                   path_type=Path),
                         default=Path("/dev/shm"), envvar=SHM_DIR_ENV, show_envvar=True,
                         metavar="DIR", help="Directory that holds the regions."),
            *output_params()]


def run_command(command: str, values: dict[str, Any],
                body: Callable[[Invocation, Path | None], Outcome]) -> None:
    """Exit with the status of `body(inv, the --shm-dir given or None)` in the error boundary;
    the common options typed before the command name count too (a --shm-dir after wins)."""
    ctx = click.get_current_context()
    own = {name: values.pop(name) for name in COMMON if name in values}
    root = ctx.find_root()
    given = root.params if root is not ctx else {}
    shm_dir = own.get("shm_dir")
    typed = ParameterSource.COMMANDLINE
    if given and root.get_parameter_source("shm_dir") is typed \
            and ctx.get_parameter_source("shm_dir") is not typed:
        shm_dir = given["shm_dir"]
    verbosity = own["verbose"] + given.get("verbose", 0) - own["quiet"] - given.get("quiet", 0)
    inv = Invocation(command=command, shm_dir=shm_dir or Path("/dev/shm"), verbosity=verbosity,
                     json_output=bool(own["json_output"] or given.get("json_output")))
    ctx.exit(run_boundary(inv, lambda: body(inv, shm_dir)))


class Subcommand(click.Command):
    """A command with the common options, and the body the fleet runs on each node."""

    body: Callable[..., Outcome]  # fn(inv, **own_options): parse, call the core, describe

    def defaults(self) -> dict[str, Any]:
        """Each own option's value when it is not given, as the command line would pass it."""
        with self.make_context(str(self.name), []) as ctx:
            return {k: v for k, v in ctx.params.items() if k not in COMMON}


def subcommand(name: str, *, help: str | None = None
               ) -> Callable[[Callable[..., Outcome]], Subcommand]:
    """Make `fn(inv, **opts) -> Outcome` a subcommand: `help` is its line in the command
    list, the docstring its full help (exit statuses named `{NAME}`)."""

    def build(fn: Callable[..., Outcome]) -> Subcommand:
        fn.__doc__ = with_statuses(fn.__doc__ or "")
        cmd = click.command(name, cls=Subcommand, short_help=help)(fn)
        cmd.params.extend(common_params())
        cmd.body = fn
        cmd.callback = lambda **values: run_command(name, values, lambda inv, _: fn(inv, **values))
        return cmd

    return build


def shm_dir_checked(inv: Invocation) -> str:
    """The shm directory as a string, refusing one that does not exist."""
    if not inv.shm_dir.is_dir():
        raise errors.InvalidInputError(
            f"shm directory {inv.shm_dir} does not exist or is not a directory; pass "
            f"--shm-dir or set {SHM_DIR_ENV}", path=str(inv.shm_dir), code="bad_shm_dir")
    return os.fspath(inv.shm_dir)


def prefault_threads(asked: int | None) -> int:
    """Threads that pre-fault a region: as asked, else one per CPU up to 8."""
    return asked or max(1, min(8, os.cpu_count() or 1))


def warn_useless_waiver(inv: Invocation, waived: bool) -> None:
    """--shm-private-to-namespace outside a PID namespace is a misunderstanding: say so."""
    if not waived:
        return
    from vllm_offload_cli.core.host.visibility import PID_NAMESPACE, namespace_blind_spots

    if not any(b.code == PID_NAMESPACE for b in namespace_blind_spots()):
        inv.warn("waiver_unused", "--shm-private-to-namespace has no effect: this process "
                 "runs in the host's PID namespace")


def envelope_of(sub: Subcommand, options: Mapping[str, Any], *, shm_dir: Path,
                verbosity: int = -1) -> dict[str, Any]:
    """What `sub --json` would print (defaults for options not given); bugs go to stderr."""
    body, options = sub.body, {**sub.defaults(), **options}
    inv = Invocation(command=str(sub.name), shm_dir=shm_dir, json_output=True, verbosity=verbosity)
    with _logging_to(inv):
        doc, _, bug = evaluate(inv, lambda: body(inv, **options))
    if bug is not None:
        traceback.print_exception(type(bug), bug, bug.__traceback__, file=sys.stderr)
    return doc
