"""`vllm-offload completion SHELL`: the completion script, and where the man page is. pip
puts both in the environment's `share/`, read by a shell or man(1) only for /usr/local."""

from __future__ import annotations

import site
import sys
import sysconfig
from pathlib import Path

import click

from vllm_offload_cli.cli.common import Invocation, Outcome, subcommand
from vllm_offload_cli.core.base.errors import InvalidInputError, OperationFailedError

# where the wheel installs each file under its data prefix (pyproject.toml), the
# repository's copy (a source checkout), and how to install it for one user
INSTALLED: dict[str, tuple[str, str | None, str]] = {
    "bash": ("share/bash-completion/completions/vllm-offload", "completions/vllm-offload.bash",
             "vllm-offload completion bash > "
             "~/.local/share/bash-completion/completions/vllm-offload"),
    "zsh": ("share/zsh/site-functions/_vllm-offload", "completions/_vllm-offload",
            "vllm-offload completion zsh > ~/.zfunc/_vllm-offload (with fpath+=~/.zfunc "
            "before compinit in ~/.zshrc)"),
    "fish": ("share/fish/vendor_completions.d/vllm-offload.fish",
             "completions/vllm-offload.fish",
             "vllm-offload completion fish > ~/.config/fish/completions/vllm-offload.fish"),
    "man": ("share/man/man1/vllm-offload.1", None, ""),  # MANPATH needs the man1/ layout
}


def locate(what: str) -> Path | None:
    """The installed file: a source checkout's copy first, then the data prefixes."""
    installed, in_repo, _ = INSTALLED[what]
    checkout = Path(__file__).resolve().parents[2]
    candidates = [checkout / in_repo] if in_repo and (checkout / "pyproject.toml").is_file() \
        else []
    prefixes = dict.fromkeys([sysconfig.get_path("data"), sys.prefix, site.getuserbase()])
    candidates += [Path(p) / installed for p in prefixes if p]
    return next((c for c in candidates if c.is_file()), None)


@subcommand("completion", help="Print the shell completion script; where the man page is.")
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]), required=False)
@click.option("--manpath", is_flag=True, help="Print the directory to add to MANPATH for "
              "`man vllm-offload` (a venv install: export MANPATH=\"$(vllm-offload completion "
              "--manpath):\").")
def completion(inv: Invocation, shell: str | None, manpath: bool) -> Outcome:
    """Print the completion script for SHELL (bash, zsh or fish) on stdout, as installed
    with this package, for a venv install whose share/ no shell reads:

    vllm-offload completion bash > ~/.local/share/bash-completion/completions/vllm-offload

    vllm-offload completion zsh > ~/.zfunc/_vllm-offload (fpath+=~/.zfunc before compinit)

    vllm-offload completion fish > ~/.config/fish/completions/vllm-offload.fish

    With --manpath it prints the directory that holds man1/vllm-offload.1.
    """
    if (shell is None) == (not manpath):
        raise InvalidInputError("give a SHELL (bash, zsh or fish) or --manpath", code="usage")
    if (path := locate(shell or "man")) is None:
        raise OperationFailedError(
            f"the installed {'man page' if shell is None else f'{shell} completion'} "
            f"was not found under {sys.prefix}/share: install the package from a wheel or "
            "a checkout (pip install .), which puts it there", code="not_installed")
    if shell is None:
        where = path.parent.parent
        return Outcome(data={"manpath": str(where), "path": str(path)},
                       render=lambda out: out.print(str(where)))
    text = path.read_text()
    return Outcome(data={"shell": shell, "path": str(path), "install": INSTALLED[shell][2]},
                   render=lambda out: out.file.write(text))
