"""The `vllm-offload` command tree. Subcommands load on demand (click's lazy-loading group
pattern): `inspect --json` imports nothing of create, benchmark or fleet, `--version` none."""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Sequence
from typing import Any

import click

from vllm_offload_cli import __version__
from vllm_offload_cli.cli.common import ALIASES, common_params, envelope, print_json
from vllm_offload_cli.core.base.exit_status import ExitStatus
from vllm_offload_cli.core.base.text import printable

# name -> (module under vllm_offload_cli.cli, attribute): its click command or group
COMMANDS: dict[str, tuple[str, str]] = {
    "benchmark": ("benchmark", "benchmark_cmd"),
    "create": ("create", "create"),
    "garbage-collect": ("gc", "garbage_collect"),
    "inspect": ("inspect", "inspect_cmd"),
    "preflight": ("preflight", "preflight"),
    "verify-rank-layout": ("verify", "verify_rank_layout"),
    "fleet": ("fleet", "fleet_app"),
    "completion": ("completion", "completion"),
}


class CommandLine(click.Group):
    """Lazy subcommands; usage errors honour `--json` and print one `Error:` line otherwise."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if (name := ALIASES.get(cmd_name, cmd_name)) not in COMMANDS:
            return None
        module_name, attribute = COMMANDS[name]
        module = importlib.import_module(f"vllm_offload_cli.cli.{module_name}")
        if not gc.isenabled():  # __main__'s, while the tree loaded: that lives until exit,
            gc.freeze()  # so no collection need walk it
            gc.enable()
        command: click.Command = getattr(module, attribute)
        return command

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True,
             **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        try:
            code = super().main(argv, prog_name or "vllm-offload", complete_var,
                                standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # bare: the help, a usage error
            sys.stdout.write(exc.format_message() + "\n")
            code = ExitStatus.USAGE
        except click.ClickException as exc:
            code = ExitStatus.USAGE if isinstance(exc, click.UsageError) else exc.exit_code
            _report_usage_error(exc, argv, code)
        except click.Abort:
            code = ExitStatus.INTERRUPTED
        code = int(code) if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


def _report_usage_error(exc: click.ClickException, argv: list[str], code: int) -> None:
    message = exc.format_message()
    ctx = getattr(exc, "ctx", None)
    if "--json" in argv:  # the envelope names the command as typed: `fleet inspect`
        command = " ".join(ctx.command_path.split()[1:]) if ctx and ctx.parent else next(
            (a for a in argv if a in COMMANDS or a in ALIASES), "")
        print_json(envelope(command, ok=False, exit_code=code, data={},
                            errors=[{"code": "usage", "message": message}], warnings=[]))
        return
    hint = "" if ctx is None else f"\nTry '{ctx.command_path} --help' for help."
    sys.stderr.write(f"Error: {printable(message)}{hint}\n")


def _root(version: bool, **_common: Any) -> None:
    """--version alone, or a command (whose run reads the common options given here)."""
    ctx = click.get_current_context()
    if not version and ctx.invoked_subcommand is None:
        raise click.UsageError("Missing command.", ctx)
    if version and ctx.invoked_subcommand is not None:
        raise click.UsageError("--version takes no command or argument", ctx)
    if version:
        sys.stdout.write(f"vllm-offload {__version__}\n")


app = CommandLine(
    name="vllm-offload",
    help="Inspect, verify, benchmark and safely reclaim vLLM's shared-memory KV-cache "
    "offload regions (/dev/shm/vllm_offload_*.mmap). The common options --shm-dir, --json, "
    "-v and -q may come before the command name as well as after it.",
    callback=_root,
    params=[click.Option(["--version"], is_flag=True, help="Print the version and exit."),
            *common_params()],
    no_args_is_help=True,
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)


def main(argv: Sequence[str] | None = None) -> None:
    app.main(args=argv, prog_name="vllm-offload")
