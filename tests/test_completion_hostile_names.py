"""Shell completion in a directory of hostile names: any local user names files in /dev/shm,
and root completes `vllm-offload inspect <TAB>` there. Each shell (bash, zsh, fish) completes
for real in such a directory: no name runs as code, and only names that pass the engine-id
rules are offered (issue 40, item 1)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.region_files import private_shm_dir

ROOT = Path(__file__).resolve().parents[1]
VALID = ["-rf", "a.b-c", "good_dp0"]  # "-rf" passes the rules: offered, as data


def _hostile_names(shm: Path) -> list[str]:
    """Region-shaped names whose middle is shell code, a glob, a quote or a line break; each
    piece of code would create a file in the shell's working directory."""
    sl = "${HOME:0:1}"  # a '/' without writing one: names cannot hold '/'
    sourced = f"$(.${{IFS}}{sl}{sl.join(shm.parts[1:])}{sl}p)"  # sources shm/p
    middles = [
        "$(touch pwned-dollar)", "`touch pwned-tick`", "${IFS}$(touch${IFS}pwned-ifs)",
        "$((1))$(touch pwned-arith)", "x;touch pwned-semi;", "x|touch pwned-pipe",
        "x&&touch pwned-and", "*", "a?", "[ab]", "{a,b}", "~root", "ev\nil", "it's",
        '"q"', "back\\slash", "tab\there", "sp ace", "..", ".", "", "é", "x" * 201,
        sourced,
    ]
    return [f"vllm_offload_{m}.mmap" for m in middles]


@pytest.fixture
def hostile() -> Iterator[tuple[Path, Path]]:
    """(shm dir full of hostile names and two valid ones, the shells' empty working dir)."""
    with private_shm_dir() as shm:
        cwd = shm / "cwd"
        cwd.mkdir()
        (shm / "home").mkdir()  # a shell's own files (fish's ~/.config) go there, not in cwd
        (cwd / "decoy-a").touch()  # an unquoted glob in cwd would expand to these
        (cwd / "decoy-b").touch()
        (shm / "p").write_text("touch pwned-sourced\n")
        made = 0
        for name in _hostile_names(shm):
            try:
                (shm / name).touch()
                made += 1
            except OSError:  # over NAME_MAX: the name cannot exist, so it cannot attack
                continue
        assert made >= 24
        for valid in VALID:
            (shm / f"vllm_offload_{valid}.mmap").touch()
        yield shm, cwd
        assert sorted(p.name for p in cwd.iterdir()) == ["decoy-a", "decoy-b"], \
            "a completion ran a file name as code"
        assert not list(shm.glob("pwned*"))


def _shell(shell: str) -> None:
    if shutil.which(shell) is None:
        from tests.conftest import require_root

        require_root(f"{shell} is not installed", granted=False)


def _env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": str(home), "LC_ALL": "C.UTF-8"}


def test_bash_offers_only_valid_ids_and_runs_no_name(hostile: tuple[Path, Path]) -> None:
    _shell("bash")
    shm, cwd = hostile
    script = f"""
source {ROOT / "completions/vllm-offload.bash"}
for line in "inspect" "gc" "verify-rank-layout" "--shm-dir {shm} inspect"; do
    read -ra COMP_WORDS <<< "vllm-offload $line"
    [[ $line == --* ]] || COMP_WORDS=(vllm-offload --shm-dir "{shm}" $line)
    COMP_WORDS+=(""); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1))
    _vllm_offload
    printf '%s\\0' "${{COMPREPLY[@]}}"; printf '\\n'
done
COMP_WORDS=(vllm-offload --shm-dir "{shm}" inspect g); COMP_CWORD=4; _vllm_offload
printf '%s\\0' "${{COMPREPLY[@]}}"; printf '\\n'
"""
    run = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], cwd=cwd,
                         capture_output=True, text=True, env=_env(shm / "home"), timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.split("\n")[:5]
    for line in lines[:4]:
        assert sorted(line.split("\0")[:-1]) == VALID, (line, run.stderr)
    assert lines[4].split("\0")[:-1] == ["good_dp0"]


def test_bash_file_and_dir_values_are_never_split_or_globbed(tmp_path: Path) -> None:
    _shell("bash")
    (tmp_path / "*").mkdir()
    (tmp_path / "two words").mkdir()
    (tmp_path / "$(touch pwned)").mkdir()
    script = f"""
source {ROOT / "completions/vllm-offload.bash"}
COMP_WORDS=(vllm-offload --shm-dir ""); COMP_CWORD=2; _vllm_offload
printf '%s\\0' "${{COMPREPLY[@]}}"
"""
    run = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], cwd=tmp_path,
                         capture_output=True, text=True, env=_env(tmp_path), timeout=60)
    assert sorted(run.stdout.split("\0")[:-1]) == ["$(touch pwned)", "*", "two words"]
    assert not (tmp_path / "pwned").exists()


def test_zsh_offers_only_valid_ids_and_runs_no_name(hostile: tuple[Path, Path]) -> None:
    _shell("zsh")
    shm, cwd = hostile
    # the completion's own lister, fed the line as zsh's completion system would
    script = (f"source {ROOT / 'completions/_vllm-offload'} 2>/dev/null; "
              f"_vllm_offload_line=(vllm-offload --shm-dir {shm} inspect ''); "
              "print -rN -- ${(f)\"$(_vllm_offload_ids)\"}")
    run = subprocess.run(["zsh", "-f", "-c", script], cwd=cwd, capture_output=True,
                         text=True, env=_env(shm / "home"), timeout=60)
    assert sorted(run.stdout.split("\0")[:-1]) == VALID, run.stderr


def test_zsh_completion_system_offers_only_valid_ids(hostile: tuple[Path, Path]) -> None:
    """A real <TAB> in an interactive zsh (compinit, _arguments, _describe), driven by zpty:
    the listing it draws holds the valid ids and nothing else."""
    _shell("zsh")
    shm, cwd = hostile
    setup = (f"fpath=({ROOT / 'completions'} $fpath); autoload -U compinit; compinit -u -D; "
             "zstyle ':completion:*' list-prompt ''; setopt autolist; PS1='> '")
    script = rf"""
zmodload zsh/zpty
zpty z zsh -f -i
zpty -w z {_zsh_quote(setup)}
zpty -w z 'echo READY'
sleep 1
zpty -wn z $'vllm-offload --shm-dir {shm} inspect 	'
sleep 2
zpty -wn z $'\C-d'
sleep 1
out=""
while zpty -rt z chunk 2>/dev/null; do out+=$chunk; done
zpty -d z
print -r -- "$out"
"""
    run = subprocess.run(["zsh", "-f", "-c", script], cwd=cwd, capture_output=True,
                         text=True, env=_env(shm / "home"), timeout=60)
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|[\r\x07\x08]", " ", run.stdout)
    listing = screen.rsplit("READY", 1)[-1].split(f"{shm} inspect", 1)[-1]
    shown = set(listing.split()) - {"vllm-offload", "--shm-dir", str(shm), "inspect", ">"}
    assert shown == set(VALID), (shown, listing[-2000:])


def _zsh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def test_fish_offers_only_valid_ids_and_runs_no_name(hostile: tuple[Path, Path]) -> None:
    _shell("fish")
    shm, cwd = hostile
    source = f"source {ROOT / 'completions/vllm-offload.fish'}"
    for line in (f"vllm-offload inspect --shm-dir {shm} ",
                 f"vllm-offload --shm-dir {shm} gc ",
                 f"vllm-offload --shm-dir={shm} verify-rank-layout "):
        run = subprocess.run(["fish", "--no-config", "-c", f"{source}; complete -C '{line}'"],
                             cwd=cwd, capture_output=True, text=True, env=_env(shm / "home"),
                             timeout=60)
        assert sorted(c.split("\t")[0] for c in run.stdout.splitlines()) == VALID, run.stderr
