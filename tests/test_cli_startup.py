"""Each run imports what its command needs: no other subcommand, no rich for a plain run.

Measured in benchmarks/cli_startup.py; here only which modules load, in a
fresh interpreter, so a stray top-level import fails a test instead of a
benchmark nobody reruns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = ("import sys, json, atexit; atexit.register(lambda: sys.stderr.write("
         "'\\nMODULES=' + json.dumps(sorted(sys.modules)) + '\\n')); "
         "from vllm_offload_cli.cli.app import main; main(sys.argv[1:])")
SUBCOMMANDS = {"benchmark", "completion", "create", "fleet", "gc", "inspect", "preflight",
               "verify"}


def _modules(*argv: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True,
                          text=True, timeout=60)
    line = proc.stderr.rsplit("MODULES=", 1)[1].splitlines()[0]
    return set(json.loads(line))


def _subcommands(modules: set[str]) -> set[str]:
    return {m.rsplit(".", 1)[1] for m in modules
            if m.startswith("vllm_offload_cli.cli.")} & SUBCOMMANDS


@pytest.mark.parametrize(("argv", "own"), [
    (["--version"], set()),
    (["inspect", "--json"], {"inspect"}),
    (["garbage-collect", "--dry-run", "--json"], {"gc"}),
    (["gc", "--dry-run", "--json"], {"gc"}),
    (["verify-rank-layout", "--world-size", "2", "--json"], {"verify"}),
    # text for people is plain text too: rich only draws a terminal's progress bar
    (["inspect"], {"inspect"}),
    (["inspect", "-v", "--wide"], {"inspect"}),
    (["gc", "--dry-run"], {"gc"}),
    (["verify-rank-layout", "--world-size", "2"], {"verify"}),
    (["inspect", "--help"], {"inspect"}),
])
def test_a_command_imports_only_itself(argv: list[str], own: set[str],
                                       shm_dir: Path) -> None:
    extra = ["--shm-dir", str(shm_dir)] if own & {"inspect", "gc"} else []
    modules = _modules(*argv, *extra)
    assert _subcommands(modules) == own
    assert not {"rich", "pydantic", "typer", "torch"} & {m.split(".")[0] for m in modules}
    assert "vllm_offload_cli.core.region.shared_region" not in modules


def test_help_lists_every_command_without_rich_or_torch() -> None:
    modules = _modules("--help")
    assert not {"rich", "pydantic", "typer", "torch", "ray"} & {m.split(".")[0]
                                                                for m in modules}


def test_help_still_lists_every_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "vllm_offload_cli", "--help"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stderr
    for name in ("benchmark", "create", "garbage-collect", "inspect", "preflight",
                 "verify-rank-layout", "fleet"):
        assert f" {name} " in proc.stdout
    assert "<bool>" not in proc.stdout and "<int>" not in proc.stdout


@pytest.mark.parametrize("command", ["benchmark", "create", "garbage-collect", "inspect",
                                     "preflight", "verify-rank-layout", "fleet inspect",
                                     "fleet garbage-collect"])
def test_help_names_values_as_a_system_tool_does(command: str) -> None:
    """Metavars say what a value is (SIZE, N, DIR, DURATION), never a Python type."""
    proc = subprocess.run([sys.executable, "-m", "vllm_offload_cli", *command.split(),
                           "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    for python_type in ("<bool>", "<int>", "<str>", "<float>", "<list[", "<path>"):
        assert python_type not in proc.stdout.lower(), (command, python_type)


def test_version_is_a_plain_flag() -> None:
    ok = subprocess.run([sys.executable, "-m", "vllm_offload_cli", "--version"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("vllm-offload ")
    bad = subprocess.run([sys.executable, "-m", "vllm_offload_cli", "--version", "true"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
