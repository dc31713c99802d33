"""The common options wherever people type them, and what a venv install needs to find.

`vllm-offload --shm-dir DIR --json inspect` is `vllm-offload inspect --shm-dir DIR
--json`; `vllm-offload completion` prints what pip put under the environment's share/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from region_files import region_file


def _regions(doc: dict[str, Any]) -> list[str]:
    return [r["engine_id"] for r in doc["data"]["regions"]]


def test_common_options_before_the_command_are_the_same_options(cli: Any,
                                                                 shm_dir: Path) -> None:
    region_file(shm_dir, "before")
    after = cli("inspect", "--shm-dir", str(shm_dir), "--json")
    before = cli("--shm-dir", str(shm_dir), "--json", "inspect")
    assert before.exit_code == after.exit_code == 0, before.stderr
    assert before.json["command"] == after.json["command"] == "inspect"
    assert _regions(before.json) == _regions(after.json) == ["before"]
    assert cli("--json", "gc", "--dry-run", "--shm-dir", str(shm_dir)).json["ok"] is True


def test_a_shm_dir_after_the_command_wins_over_one_before(cli: Any, shm_dir: Path) -> None:
    (shm_dir / "a").mkdir()
    (shm_dir / "b").mkdir()
    region_file(shm_dir / "b", "in_b")
    doc = cli("--shm-dir", str(shm_dir / "a"), "inspect", "--shm-dir", str(shm_dir / "b"),
              "--json").json
    assert _regions(doc) == ["in_b"]
    env = {"VLLM_OFFLOAD_SHM_DIR": str(shm_dir / "a")}  # typed beats the environment
    assert _regions(cli("--shm-dir", str(shm_dir / "b"), "inspect", "--json", env=env).json) \
        == ["in_b"]


@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_and_verbose_count_wherever_they_are(cli: Any, shm_dir: Path,
                                                   where: str) -> None:
    """-q silences a warning, -v adds the why-lines, before the command as after it."""
    region_file(shm_dir, "leak")
    args = ["inspect", "--shm-dir", str(shm_dir)]
    verbose = ["-v", *args] if where == "before" else [*args, "-v"]
    assert "leak: stale:" in cli(*verbose).stdout
    assert "leak: stale:" not in cli(*args).stdout


@pytest.mark.parametrize("argv", [
    ["--shm-dir", "{shm}", "inspect", "--json", "--bogus"],
    ["--json", "--shm-dir", "{shm}", "inspect", "--bogus"],
    ["inspect", "--shm-dir", "{shm}", "--json", "--bogus"],
])
def test_a_usage_error_envelope_names_the_command(cli: Any, shm_dir: Path,
                                                  argv: list[str]) -> None:
    result = cli(*(a.format(shm=shm_dir) for a in argv))
    assert result.exit_code == 2
    assert (result.json["command"], result.json["errors"][0]["code"]) == ("inspect", "usage")


def test_a_fleet_usage_error_names_the_fleet_command(cli: Any, shm_dir: Path) -> None:
    result = cli("--shm-dir", str(shm_dir), "fleet", "inspect", "--json", "--bogus")
    assert (result.exit_code, result.json["command"]) == (2, "fleet inspect")


# -- completion scripts and the man page for a venv install ------------------------------


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_the_installed_script(cli: Any, shell: str) -> None:
    doc = cli("completion", shell, "--json").json
    script = cli("completion", shell)
    assert script.exit_code == 0
    assert script.stdout == Path(doc["data"]["path"]).read_text()
    assert "vllm-offload" in script.stdout and shell in doc["data"]["install"]


def test_completion_manpath_is_a_directory_man_reads(cli: Any) -> None:
    result = cli("completion", "--manpath")
    assert result.exit_code == 0
    assert (Path(result.stdout.strip()) / "man1" / "vllm-offload.1").is_file()


def test_completion_wants_a_shell_or_manpath(cli: Any) -> None:
    assert cli("completion").exit_code == 2
    assert cli("completion", "tcsh").exit_code == 2
