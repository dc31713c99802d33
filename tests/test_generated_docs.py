"""The man page and completions are generated from the command tree: no drift allowed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_offload_cli.cli.gendocs import README, outputs, readme_with_exit_status
from vllm_offload_cli.core.base.exit_status import ExitStatus

ROOT = Path(__file__).resolve().parents[1]
FIX = "regenerate with `python -m vllm_offload_cli.cli.gendocs` from the repository root"


@pytest.mark.parametrize(("rel", "text"), sorted(outputs().items()))
def test_committed_copy_is_current(rel: str, text: str) -> None:
    committed = (ROOT / rel).read_text()
    assert committed == text, f"{rel} is out of date; {FIX}"


def test_readme_exit_status_table_is_current() -> None:
    readme = (ROOT / README).read_text()
    assert readme == readme_with_exit_status(readme), f"{README}'s exit-status table is out " \
        f"of date; {FIX}"
    for status in ExitStatus:
        assert f"\n| {status.value} | {status.meaning} |\n" in readme


def test_man_page_exit_status_is_the_enum() -> None:
    man = (ROOT / "man" / "vllm-offload.1").read_text()
    section = man.split(".SH EXIT STATUS\n", 1)[1].split(".SH ", 1)[0]
    entries = section.split(".PP\n", 1)[0].split(".TP\n")[1:]
    assert [tuple(e.strip().split("\n")) for e in entries] == [
        (f".B {s.value}", s.meaning.replace("-", "\\-")) for s in ExitStatus]


def test_every_command_is_documented() -> None:
    from vllm_offload_cli.cli.app import app

    man = (ROOT / "man" / "vllm-offload.1").read_text()
    bash = (ROOT / "completions" / "vllm-offload.bash").read_text()
    for command in app.registered_commands:
        if command.hidden:
            continue
        assert f".SS {command.name}" in man.replace("\\-", "-")
        assert f"    {command.name})" in bash
    for group in app.registered_groups:  # `fleet` and its own commands
        assert group.typer_instance is not None
        for command in group.typer_instance.registered_commands:
            name = f"{group.name} {command.name}"
            assert f'    "{name}")' in bash
            if not command.hidden:
                assert f".SS {name}" in man.replace("\\-", "-")


@pytest.mark.parametrize(("shell", "rel", "check"), [
    ("bash", "completions/vllm-offload.bash", ["bash", "-n"]),
    ("zsh", "completions/_vllm-offload", ["zsh", "-n"]),
    ("fish", "completions/vllm-offload.fish", ["fish", "--no-execute"]),
])
def test_completion_scripts_parse(shell: str, rel: str, check: list[str]) -> None:
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    subprocess.run([*check, str(ROOT / rel)], check=True)


def test_bash_completes_commands_options_and_engine_ids(tmp_path: Path) -> None:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    (tmp_path / "vllm_offload_abc_dp1.mmap").touch()
    script = f"""
source {ROOT / "completions/vllm-offload.bash"}
export VLLM_OFFLOAD_SHM_DIR={tmp_path}
COMP_WORDS=(vllm-offload ins); COMP_CWORD=1; _vllm_offload; echo "${{COMPREPLY[*]}}"
COMP_WORDS=(vllm-offload inspect --form); COMP_CWORD=2; _vllm_offload; echo "${{COMPREPLY[*]}}"
COMP_WORDS=(vllm-offload inspect ""); COMP_CWORD=2; _vllm_offload; echo "${{COMPREPLY[*]}}"
COMP_WORDS=(vllm-offload fleet ins); COMP_CWORD=2; _vllm_offload; echo "${{COMPREPLY[*]}}"
COMP_WORDS=(vllm-offload fleet gc --add); COMP_CWORD=3; _vllm_offload; echo "${{COMPREPLY[*]}}"
COMP_WORDS=(vllm-offload fleet inspect ""); COMP_CWORD=3; _vllm_offload; echo "${{COMPREPLY[*]}}"
"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["inspect", "--format", "abc_dp1", "inspect", "--address", "abc_dp1"]
