"""The `vllm-offload` command tree and its entry point.

Subcommands are resolved by name, on demand: `vllm-offload inspect --json`
imports the inspect module and nothing of create, benchmark or the fleet, and
`--version` imports none of them. `--help` and the generated docs resolve them
all. Subcommand modules never import this one, so imports run one way.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any

import typer

# typer >= 0.29 vendors click; these are its classes
from typer._click import Command, Context
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
from typer.core import TyperGroup, _main
from typer.exceptions import Abort

from vllm_offload_cli import __version__
from vllm_offload_cli.cli.common import envelope, print_json
from vllm_offload_cli.cli.params import tidy
from vllm_offload_cli.core.base.exit_status import ExitStatus
from vllm_offload_cli.core.base.text import printable

# name -> (module under vllm_offload_cli.cli, attribute): a Subcommand or a Typer group
COMMANDS: dict[str, tuple[str, str]] = {
    "benchmark": ("benchmark", "benchmark_cmd"),
    "create": ("create", "create"),
    "garbage-collect": ("gc", "garbage_collect"),
    "gc": ("gc", "garbage_collect"),
    "inspect": ("inspect", "inspect_cmd"),
    "preflight": ("preflight", "preflight"),
    "verify-rank-layout": ("verify", "verify_rank_layout"),
    "fleet": ("fleet", "fleet_app"),
}


def _build(name: str) -> Command:
    module_name, attribute = COMMANDS[name]
    module = importlib.import_module(f"vllm_offload_cli.cli.{module_name}")
    target = getattr(module, attribute)
    holder = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    if isinstance(target, typer.Typer):
        holder.add_typer(target, name=name)
    else:
        target.register(holder)
        holder.callback()(lambda: None)  # a group even with one command
    return tidy(typer.main.get_group(holder).commands[name])


class _LazyCommands(Mapping[str, Command]):
    """Subcommands by name, each imported the first time it is looked up."""

    def __init__(self) -> None:
        self._built: dict[str, Command] = {}

    def __getitem__(self, name: str) -> Command:
        if name not in COMMANDS:
            raise KeyError(name)
        if name not in self._built:
            self._built[name] = _build(name)
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(COMMANDS)

    def __len__(self) -> int:
        return len(COMMANDS)


class EnvelopeGroup(TyperGroup):
    """Lazy subcommands; usage errors honour `--json` and print one `Error:` line otherwise."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        tidy(self)  # before the subcommands are attached: each is tidied when built
        self.commands = _LazyCommands()  # type: ignore[assignment]

    def list_commands(self, ctx: Context) -> list[str]:
        return list(COMMANDS)

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             windows_expand_args: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        try:
            code = _main(self, args=argv, prog_name=prog_name or "vllm-offload",
                         complete_var=complete_var, standalone_mode=False,
                         rich_markup_mode=self.rich_markup_mode, **extra)
        except NoArgsIsHelpError as exc:  # bare `vllm-offload`: the help, as a usage error
            sys.stdout.write(exc.ctx.get_help() if exc.ctx is not None else "")
            code = ExitStatus.USAGE
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
    invoke_without_command=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")
                       ] = False,
) -> None:
    """Inspect, verify, benchmark and safely reclaim vLLM's KV offload regions."""
    if not version:
        if ctx.invoked_subcommand is None:
            raise UsageError("Missing command.", ctx)
        return
    if ctx.invoked_subcommand is not None:
        raise UsageError("--version takes no command or argument", ctx)
    sys.stdout.write(f"vllm-offload {__version__}\n")


def root_command() -> Command:
    """The click command tree (subcommands still resolved on demand)."""
    return typer.main.get_command(app)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    app(args=argv, prog_name="vllm-offload")


