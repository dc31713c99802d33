"""The `vllm-offload` command tree and its entry point.

Subcommand modules build their commands; this module adds them to the app, so
imports run one way. None of them imports torch at module level, so `--help`
stays fast.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer

# typer >= 0.29 vendors click; these are its exception classes
from typer._click.exceptions import ClickException, UsageError
from typer.core import TyperGroup, _main
from typer.exceptions import Abort

from vllm_offload_cli import __version__
from vllm_offload_cli.cli import benchmark, create, fleet, gc, inspect, preflight, verify
from vllm_offload_cli.cli.common import envelope, print_json
from vllm_offload_cli.core.base.exit_status import ExitStatus
from vllm_offload_cli.core.base.text import printable


class EnvelopeGroup(TyperGroup):
    """Usage errors honour `--json` too, and print one `Error:` line otherwise."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        try:
            code = _main(self, args=argv, prog_name=prog_name or "vllm-offload",
                         complete_var=complete_var, standalone_mode=False,
                         rich_markup_mode=self.rich_markup_mode, **extra)
        except ClickException as exc:
            code = ExitStatus.USAGE if isinstance(exc, UsageError) else exc.exit_code
            _report_usage_error(exc, argv, code)
        except Abort:
            code = ExitStatus.INTERRUPTED
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


def _report_usage_error(exc: ClickException, argv: list[str], code: int) -> None:
    message = exc.format_message()
    if "--json" in argv:
        command = next((a for a in argv if not a.startswith("-")), "")
        print_json(envelope(command, ok=False, exit_code=code, data={},
                            errors=[{"code": "usage", "message": message}], warnings=[]))
        return
    ctx = getattr(exc, "ctx", None)
    hint = ""
    if ctx is not None:
        hint = f"\nTry '{ctx.command_path} --help' for help."
    sys.stderr.write(f"Error: {printable(message)}{hint}\n")


app = typer.Typer(
    cls=EnvelopeGroup,
    name="vllm-offload",
    help="Inspect, verify, benchmark and safely reclaim vLLM's shared-memory KV-cache "
    "offload regions (/dev/shm/vllm_offload_*.mmap).",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vllm-offload {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Inspect, verify, benchmark and safely reclaim vLLM's KV offload regions."""


for _command in (benchmark.benchmark_cmd, create.create, gc.garbage_collect,
                 inspect.inspect_cmd, preflight.preflight, verify.verify_rank_layout):
    _command.register(app)
app.add_typer(fleet.fleet_app, name="fleet")


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    app(args=argv, prog_name="vllm-offload")
