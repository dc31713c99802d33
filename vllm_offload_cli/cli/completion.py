"""`vllm-offload completion SHELL`: the shell completion script, and where the man page is.

pip puts both under the environment's `share/` (a venv's, `~/.local`'s, /usr/local's),
where a system shell or man(1) finds them only for /usr/local. This prints what a venv
install needs to link or source, so nobody has to know where pip put it.
"""

from __future__ import annotations

import enum
import site
import sys
import sysconfig
from pathlib import Path

import click

from vllm_offload_cli.cli.common import Invocation, Out, Outcome, subcommand
from vllm_offload_cli.cli.params import EnumChoice
from vllm_offload_cli.core.base.errors import InvalidInputError, OperationFailedError


class Shell(str, enum.Enum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


# where the wheel installs each file under its data prefix (pyproject.toml), and the
# repository's copy (a source checkout)
INSTALLED: dict[Shell | str, tuple[str, str | None]] = {
    Shell.bash: ("share/bash-completion/completions/vllm-offload",
                 "completions/vllm-offload.bash"),
    Shell.zsh: ("share/zsh/site-functions/_vllm-offload", "completions/_vllm-offload"),
    Shell.fish: ("share/fish/vendor_completions.d/vllm-offload.fish",
                 "completions/vllm-offload.fish"),
    "man": ("share/man/man1/vllm-offload.1", None),  # MANPATH needs the man1/ layout
}
INSTALL_HINT = {
    Shell.bash: "vllm-offload completion bash > "
                "~/.local/share/bash-completion/completions/vllm-offload",
    Shell.zsh: "vllm-offload completion zsh > ~/.zfunc/_vllm-offload (with fpath+=~/.zfunc "
               "before compinit in ~/.zshrc)",
    Shell.fish: "vllm-offload completion fish > ~/.config/fish/completions/vllm-offload.fish",
}


def locate(what: Shell | str) -> Path | None:
    """The installed file: a source checkout's copy first, then the data prefixes."""
    installed, in_repo = INSTALLED[what]
    checkout = Path(__file__).resolve().parents[2]
    candidates = [checkout / in_repo] if in_repo and (checkout / "pyproject.toml").is_file() \
        else []
    prefixes = dict.fromkeys([sysconfig.get_path("data"), sys.prefix, site.getuserbase()])
    candidates += [Path(p) / installed for p in prefixes if p]
    return next((c for c in candidates if c.is_file()), None)


@subcommand("completion", help="Print the shell completion script; where the man page is.")
@click.argument("shell", type=EnumChoice(Shell), required=False)
@click.option("--manpath", is_flag=True, help="Print the directory to add to MANPATH for "
              "`man vllm-offload` (a venv install: export MANPATH=\"$(vllm-offload completion "
              "--manpath):\").")
def completion(inv: Invocation, shell: Shell | None, manpath: bool) -> Outcome:
    """Print the completion script for SHELL (bash, zsh or fish) on stdout, as installed
    with this package, for a venv install whose share/ no shell reads:

    vllm-offload completion bash > ~/.local/share/bash-completion/completions/vllm-offload

    vllm-offload completion zsh > ~/.zfunc/_vllm-offload (fpath+=~/.zfunc before compinit)

    vllm-offload completion fish > ~/.config/fish/completions/vllm-offload.fish

    With --manpath it prints the directory that holds man1/vllm-offload.1.
    """
    if (shell is None) == (not manpath):
        raise InvalidInputError("give a SHELL (bash, zsh or fish) or --manpath", code="usage")
    what: Shell | str = "man" if shell is None else shell
    path = locate(what)
    if path is None:
        raise OperationFailedError(
            f"the installed {'man page' if shell is None else f'{shell.value} completion'} "
            f"was not found under {sys.prefix}/share: install the package from a wheel or "
            "a checkout (pip install .), which puts it there", code="not_installed")
    if shell is None:
        where = path.parent.parent
        return Outcome(data={"manpath": str(where), "path": str(path)},
                       render=lambda out: out.print(str(where)))
    text = path.read_text()

    def render(out: Out) -> None:
        out.file.write(text)

    return Outcome(data={"shell": shell.value, "path": str(path),
                         "install": INSTALL_HINT[shell]}, render=render)
