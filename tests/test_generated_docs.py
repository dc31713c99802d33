"""The man page and completions are generated from the command tree: no drift allowed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tools.gendocs import README, outputs, readme_with_exit_status
from vllm_offload_cli.core.base.exit_status import ExitStatus

ROOT = Path(__file__).resolve().parents[1]
FIX = "regenerate with `python -m tools.gendocs` from the repository root"


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
    found = [e.strip().split("\n", 1) for e in entries]  # filled: lines under 80 bytes
    assert [(head, " ".join(text.split("\n"))) for head, text in found] == [
        (f".B {s.value}", s.meaning.replace("-", "\\-")) for s in ExitStatus]


def test_every_command_is_documented() -> None:
    import click

    from vllm_offload_cli.cli.app import app

    man = (ROOT / "man" / "vllm-offload.1").read_text().replace("\\-", "-")
    bash = (ROOT / "completions" / "vllm-offload.bash").read_text()
    root = app
    ctx = click.Context(root)
    for name in root.list_commands(ctx):
        command = root.get_command(ctx, name)
        assert command is not None
        subs = command.commands if isinstance(command, click.Group) else {}
        if not command.hidden:
            assert f".SS {name}" in man
        assert f"    {name})" in bash or subs
        for sub_name, sub in subs.items():  # `fleet` and its own commands
            assert f'    "{name} {sub_name}")' in bash
            if not sub.hidden:
                assert f".SS {name} {sub_name}" in man


def test_man_page_has_the_operator_sections() -> None:
    man = (ROOT / "man" / "vllm-offload.1").read_text().replace("\\-", "-")
    for section in ("SYNOPSIS", "DEFAULTS", "JSON OUTPUT", "EXIT STATUS", "ENVIRONMENT",
                    "FILES"):
        assert f"\n.SH {section}\n" in man
    assert "Default: 60s." in man, "gc's --min-age default is stated"
    assert "[ENGINE_ID]" in man and "see the man page" not in man
    assert ".SS inspect\n.TP\n\\fBshm_dir\\fR" in man, "a JSON data reference per command"


def test_man_page_is_clean_for_mandoc() -> None:
    if shutil.which("mandoc") is None:
        pytest.skip("mandoc is not installed")
    lint = subprocess.run(["mandoc", "-T", "lint", "-W", "warning",
                           str(ROOT / "man" / "vllm-offload.1")], capture_output=True, text=True)
    assert lint.returncode == 0 and lint.stdout + lint.stderr == "", lint.stdout + lint.stderr


def test_fish_offers_only_the_allowed_values() -> None:
    fish = (ROOT / "completions" / "vllm-offload.fish").read_text()
    formats = [line for line in fish.splitlines() if "-l format" in line]
    assert formats and all("-x -a 'table json prometheus'" in line for line in formats)
    assert not [line for line in fish.splitlines() if " -r -a " in line]
    # a repeatable choice too (list[Enum]): its values, not free text
    patterns = [line for line in fish.splitlines() if "-l pattern" in line]
    assert patterns and all("-x -a 'contiguous device-scattered scattered'" in line
                            for line in patterns)


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


def _documented(command: str, prefix: str = "") -> set[str]:
    from tools.datadoc import DATA

    names = set()
    for key, _ in DATA[command]:
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix):]
        if "." in rest.split(",")[0]:
            continue
        names |= {n.strip().removesuffix("[]") for n in rest.split(",")}
    return names


def test_json_reference_names_every_data_key(cli: Any, shm_dir: Path) -> None:
    """The man page's JSON reference covers what the commands really print."""
    where = ("--shm-dir", str(shm_dir), "--json")
    made = cli("create", "doc", "--world-size", "1", "--cpu-page-size", "4KiB",
               "--num-blocks", "2", *where)
    seen = {"create": made, "inspect": cli("inspect", *where),
            "verify-rank-layout": cli("verify-rank-layout", "doc", *where),
            "preflight": cli("preflight", "doc2", "--size", "4KiB", *where)}
    for command, result in seen.items():
        assert result.exit_code == 0, result.stdout + result.stderr
        assert set(result.json["data"]) - {"released_by", "removed"} <= _documented(command)
    plan = cli("verify-rank-layout", "--world-size", "2", "--json")
    assert set(plan.json["data"]) <= _documented("verify-rank-layout")
    region = seen["inspect"].json["data"]["regions"][0]
    assert set(region) <= _documented("inspect", "regions[].")


def _help_strings() -> list[tuple[str, int, str]]:
    """(file, line, text) of every command docstring and `help=` text in the CLI's source."""
    import ast

    found = []
    for path in sorted((ROOT / "vllm_offload_cli" / "cli").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            texts: list[ast.AST] = []
            if isinstance(node, ast.FunctionDef) and node.decorator_list:
                texts = node.body[:1]
            elif isinstance(node, ast.Call):
                texts = [k.value for k in node.keywords if k.arg == "help"]
                if getattr(node.func, "id", None) == "_fleet_command":
                    texts += node.args[2:3]  # the fleet command's help
            for t in texts:
                for c in ast.walk(t):
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        found.append((path.name, c.lineno, c.value))
    return found


def test_help_text_takes_exit_statuses_from_the_enum() -> None:
    """A number typed in help text can contradict ExitStatus: help names `{NAME}`."""
    import re

    typed = [(f, line, m.group()) for f, line, text in _help_strings()
             for m in re.finditer(r"\b[Ee]xit(?:s| status:?| code)? \d+", text)]
    assert typed == []
    datadoc = (ROOT / "tools" / "datadoc.py").read_text()  # the man page's JSON reference
    assert re.findall(r"\b[Ee]xit(?:s| status:?| code)? \d+", datadoc) == []
    man = (ROOT / "man" / "vllm-offload.1").read_text()
    assert [s.name for s in ExitStatus if f"{{{s.name}}}" in man] == []  # every one filled


def _section(man: str, name: str) -> str:
    return man.split(f"\n.SH {name}\n", 1)[1].split("\n.SH ", 1)[0]


def test_environment_names_every_variable_the_code_reads() -> None:
    import re

    read = set()
    for path in (ROOT / "vllm_offload_cli").rglob("*.py"):
        text = path.read_text()
        read |= set(re.findall(r'^[A-Z_]*ENV\w* = "([A-Z][A-Z0-9_]*[A-Z0-9])"', text, re.M))
        read |= set(re.findall(r'(?:environ\.get|environ\.setdefault|getenv|environ)\W+'
                               r'"([A-Z][A-Z0-9_]*[A-Z0-9])"', text))
    assert {"VLLM_OFFLOAD_SHM_DIR", "VLLM_OFFLOAD_STRICT", "OMP_WAIT_POLICY"} <= read
    man = (ROOT / "man" / "vllm-offload.1").read_text()
    environment = _section(man, "ENVIRONMENT").replace("\\-", "-")
    assert [name for name in sorted(read) if f".B {name}\n" not in environment] == []


def test_files_examples_and_see_also_say_what_an_operator_needs() -> None:
    man = (ROOT / "man" / "vllm-offload.1").read_text().replace("\\-", "-")
    assert "/dev/shm/.vllm-offload-{uid}/startup.lock" in _section(man, "FILES")
    examples = _section(man, "EXAMPLES")
    assert "vllm-offload gc --dry-run" in examples and "vllm-offload completion bash" in examples
    see_also = _section(man, "SEE ALSO")
    for page in ("\\fBlsof\\fR(8)", "\\fBfuser\\fR(1)", "\\fBsystemd-tmpfiles\\fR(8)"):
        assert page in see_also


def _bash(script: str, shm_dir: Path) -> list[str]:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    run = (f"source {ROOT / 'completions/vllm-offload.bash'}\n"
           f"export VLLM_OFFLOAD_SHM_DIR={shm_dir}\n") + "\n".join(
        f'COMP_WORDS=({line}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); _vllm_offload; '
        'echo "${COMPREPLY[*]}"' for line in script.strip().splitlines())
    return subprocess.run(["bash", "-c", run], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def test_bash_lists_every_command_and_completes_from_the_lines_shm_dir(tmp_path: Path
                                                                       ) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "vllm_offload_there.mmap").touch()
    (tmp_path / "vllm_offload_here.mmap").touch()
    out = _bash(f"""
vllm-offload g
vllm-offload inspect --shm-dir {other} ""
vllm-offload --shm-dir {other} inspect ""
vllm-offload gc --shm-dir={other} ""
vllm-offload inspect ""
vllm-offload verify-rank-layout --rank-source ""
vllm-offload fleet verify-rank-layout --rank-source l
""", tmp_path)
    assert out[0].split() == ["garbage-collect", "gc"]
    assert out[1:4] == ["there"] * 3  # the line's --shm-dir, before or after the command
    assert out[4] == "here"  # else $VLLM_OFFLOAD_SHM_DIR
    assert out[5].split() == ["device-modulo", "logical", "device-index"]
    assert out[6] == "logical"


def test_zsh_completes_engine_ids_from_the_lines_shm_dir(tmp_path: Path) -> None:
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed")
    (tmp_path / "vllm_offload_z1.mmap").touch()
    script = (f"source {ROOT / 'completions/_vllm-offload'} 2>/dev/null; "
              f"_vllm_offload_line=(vllm-offload --shm-dir {tmp_path} inspect ''); "
              "_vllm_offload_ids")
    out = subprocess.run(["zsh", "-f", "-c", script], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert out.stdout.split() == ["z1"], out.stderr
    zsh = (ROOT / "completions" / "_vllm-offload").read_text()
    assert ":name:(device-modulo logical device-index)'" in zsh


def test_fish_completes_engine_ids_and_rank_sources(tmp_path: Path) -> None:
    if shutil.which("fish") is None:
        pytest.skip("fish is not installed")
    (tmp_path / "vllm_offload_f1.mmap").touch()
    source = f"source {ROOT / 'completions/vllm-offload.fish'}"

    def complete(line: str) -> list[str]:
        run = subprocess.run(["fish", "--no-config", "-c", f"{source}; complete -C '{line}'"],
                             capture_output=True, text=True, env={
                                 "PATH": os.environ["PATH"], "HOME": str(tmp_path)})
        return [c.split("\t")[0] for c in run.stdout.splitlines()]

    assert complete(f"vllm-offload inspect --shm-dir {tmp_path} ") == ["f1"]
    assert complete(f"vllm-offload --shm-dir {tmp_path} gc ") == ["f1"]
    # options before the command, as bash and zsh complete them
    assert complete("vllm-offload --j") == ["--json"]
    assert "inspect" in complete(f"vllm-offload --shm-dir {tmp_path} -v ")
    assert sorted(complete("vllm-offload verify-rank-layout --rank-source ")) == [
        "device-index", "device-modulo", "logical"]
