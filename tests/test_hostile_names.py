"""Names are matched exactly and shown escaped (issue 9, rows 4 and 5).

A file named `vllm_offload_pre.mmap\\n` is not region `pre`; a process whose
name holds terminal escape sequences must not reach the operator's terminal
with them, neither in tables nor in messages. JSON output keeps the raw
string (the encoder escapes control characters as \\u001b itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli_subprocess
from tests.region_files import region_file
from vllm_offload_cli.core.base.text import json_safe, printable, valid_unicode
from vllm_offload_cli.core.region.naming import (
    engine_id_problem,
    parse_manifest_filename,
    parse_region_filename,
)

EVIL = "\x1b[31mevil\x1b[0m"  # 13 bytes: fits the 15 of a process name


@pytest.mark.parametrize("name", [
    "vllm_offload_pre.mmap\n", "vllm_offload_pre.mmap.1\n", "vllm_offload_pre\n.mmap",
    "vllm_offload_pre.mmap\r", "vllm_offload_pre.mmap\x00", "\nvllm_offload_pre.mmap",
    "vllm_offload_pre.mmap.01", "vllm_offload_pre.mmap.",
])
def test_region_names_are_matched_exactly(name: str) -> None:
    assert parse_region_filename(name) is None


@pytest.mark.parametrize("name", ["vllm_offload_pre.manifest.json\n",
                                  "vllm_offload_pre\t.manifest.json"])
def test_manifest_names_are_matched_exactly(name: str) -> None:
    assert parse_manifest_filename(name) is None


@pytest.mark.parametrize("engine_id", ["pre\n", "pre\r", "\tpre", "pr\x1be", "pre\x00"])
def test_engine_ids_with_control_characters_are_refused(engine_id: str) -> None:
    assert engine_id_problem(engine_id) is not None


def test_trailing_newline_name_does_not_stand_for_a_persistent_region(
        cli: Any, shm_dir: Path) -> None:
    """Row 4: root's `gc --all-users` must keep the pre-provisioned region `pre`."""
    made = cli("create", "pre", "--shm-dir", str(shm_dir), "--world-size", "1",
               "--cpu-page-size", "4KiB", "--num-blocks", "4")
    assert made.exit_code == 0, made.stderr
    decoy = shm_dir / "vllm_offload_pre.mmap\n"
    decoy.write_bytes(b"\x01" * 4096)
    decoy.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(decoy, 65534, 65534)
        args = ("gc", "--all-users", "--min-age", "0", "--shm-dir", str(shm_dir), "--json")
    else:
        args = ("gc", "--min-age", "0", "--shm-dir", str(shm_dir), "--json")
    gc = cli(*args)
    assert gc.exit_code == 0, gc.stdout
    assert gc.json["data"]["removed"] == []
    assert [k["code"] for k in gc.json["data"]["kept"]] == ["persistent"]
    assert sorted(os.listdir(shm_dir)) == ["vllm_offload_pre.manifest.json",
                                           "vllm_offload_pre.mmap", "vllm_offload_pre.mmap\n"]
    found = cli("inspect", "--shm-dir", str(shm_dir), "--json").json["data"]["regions"]
    assert [(r["engine_id"], r["state"], r["problems"]) for r in found] == [
        ("pre", "persistent", [])]


def test_printable_escapes_every_control_character() -> None:
    assert printable(EVIL) == "\\x1b[31mevil\\x1b[0m"
    assert printable("a\nb\tc\x7f\x9b\u202e") == "a\\x0ab\\x09c\\x7f\\x9b\\u202e"
    assert printable("plain name-1.2_x [ok] \\ é") == "plain name-1.2_x [ok] \\ é"
    for code in [*range(0x20), *range(0x7f, 0xa0)]:
        assert printable(chr(code)) == f"\\x{code:02x}"


_MAPPER = """
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(15, ctypes.c_char_p(sys.argv[2].encode()), 0, 0, 0) == 0  # PR_SET_NAME
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, os.fstat(fd).st_size)
print("ready", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _mapper(argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    """A real process running _MAPPER, once it says it maps the region; killed after."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()

@pytest.fixture
def evil_holder(shm_dir: Path) -> Iterator[subprocess.Popen[str]]:
    """A real process named with ESC sequences, mapping region `held`."""
    path = region_file(shm_dir, "held")
    with _mapper([sys.executable, "-c", _MAPPER, str(path), EVIL]) as proc:
        with open(f"/proc/{proc.pid}/comm") as f:
            assert f.read().rstrip("\n") == EVIL
        yield proc


def test_process_names_reach_no_terminal_raw(cli: Any, shm_dir: Path,
                                             evil_holder: subprocess.Popen[str]) -> None:
    """Row 5: inspect's table and gc's reasons show the name escaped."""
    table = cli("inspect", "--wide", "--shm-dir", str(shm_dir))
    assert table.exit_code == 0
    assert "\x1b" not in table.stdout + table.stderr
    assert "\\x1b[31mevil\\x1b[0m" in table.stdout
    gc = cli("gc", "--min-age", "0", "--shm-dir", str(shm_dir))
    assert gc.exit_code == 0
    assert "\x1b" not in gc.stdout + gc.stderr
    assert f"pid {evil_holder.pid} (\\x1b[31mevil\\x1b[0m, fd+map)" in gc.stdout
    # JSON keeps the raw name; the encoder escapes it
    doc = cli("inspect", "--shm-dir", str(shm_dir), "--json")
    assert "\x1b" not in doc.stdout and "\\u001b[31mevil" in doc.stdout
    assert doc.json["data"]["regions"][0]["holders"][0]["name"] == EVIL


def test_real_subprocess_output_is_escaped(shm_dir: Path,
                                           evil_holder: subprocess.Popen[str]) -> None:
    """The same through a real terminal-less process: bytes on the pipes, not CliRunner's."""
    result = run_cli_subprocess("gc", "--min-age", "0", "--shm-dir", str(shm_dir), "-v")
    assert result.exit_code == 0, result.stderr
    assert "\x1b" not in result.stdout + result.stderr
    assert "\\x1b[31mevil" in result.stdout


def test_error_messages_escape_what_they_quote(cli: Any, shm_dir: Path) -> None:
    """Error and warning lines carry outside strings too: escaped on stderr."""
    bad = cli("inspect", f"x{EVIL}", "--shm-dir", str(shm_dir))
    assert bad.exit_code == 2
    assert bad.stderr.startswith("Error: ") and "\x1b" not in bad.stderr
    shm = shm_dir / f"dir{EVIL}"
    shm.mkdir()
    region_file(shm, "a")
    os.symlink("/etc/passwd", shm / "vllm_offload_b.mmap")
    (shm / "vllm_offload_b.manifest.json").write_text("{}")
    for args in (("inspect",), ("gc", "--min-age", "0"), ("create", "a", "--world-size", "1",
                                                       "--cpu-page-size", "4096",
                                                       "--num-blocks", "2")):
        result = cli(*args, "--shm-dir", str(shm))
        assert "\x1b" not in result.stdout + result.stderr, args
        assert "dir\\x1b[31mevil" in result.stdout + result.stderr, args


# -- issue 30, finding 10: text that is not UTF-8 ---------------------------------------

UNDECODABLE = b"\xff\xfe\x1b[31mx"  # a process name is bytes: any user can set these
SHOWN = "\\xff\\xfe\\x1b[31mx"


def _strict_json(text: str) -> Any:
    """Parse as a strict parser would: a lone surrogate (escaped or not) is refused."""
    doc = json.loads(text)
    json.dumps(doc, ensure_ascii=False).encode("utf-8")  # UnicodeEncodeError if one is
    return doc


def test_text_that_is_not_utf8_is_shown_as_its_bytes() -> None:
    name = UNDECODABLE.decode("utf-8", "surrogateescape")
    assert printable(name) == SHOWN
    assert printable("a\ud800b") == "a\\ud800b"  # a lone surrogate a JSON string made
    assert valid_unicode(name) == "\\xff\\xfe\x1b[31mx"  # controls stay: JSON escapes them
    assert json_safe({name: [name, 1, None]}) == {valid_unicode(name): [valid_unicode(name),
                                                                        1, None]}
    assert valid_unicode("plain é \U0001f600") == "plain é \U0001f600"


@pytest.fixture
def undecodable_holder(shm_dir: Path) -> Iterator[subprocess.Popen[str]]:
    """A real process whose name is not UTF-8, mapping region `held`."""
    path = region_file(shm_dir, "held")
    code = _MAPPER.replace("sys.argv[2].encode()", "bytes.fromhex(sys.argv[2])")
    with _mapper([sys.executable, "-c", code, str(path), UNDECODABLE.hex()]) as proc:
        yield proc


def test_a_process_name_that_is_not_utf8_crashes_no_output(
        shm_dir: Path, undecodable_holder: subprocess.Popen[str]) -> None:
    """Was UnicodeEncodeError in `inspect --wide` and in gc's text (after its removals)."""
    for args in (("inspect", "--wide"), ("gc", "--min-age", "0", "-v")):
        result = run_cli_subprocess(*args, "--shm-dir", str(shm_dir))
        assert result.exit_code == 0, result.stderr
        assert SHOWN in result.stdout and "\x1b" not in result.stdout + result.stderr
    result = run_cli_subprocess("inspect", "--json", "--shm-dir", str(shm_dir))
    assert result.exit_code == 0, result.stderr
    [holder] = _strict_json(result.stdout)["data"]["regions"][0]["holders"]
    assert holder["name"] == "\\xff\\xfe\x1b[31mx"


def test_a_manifest_string_with_a_lone_surrogate_crashes_no_output(shm_dir: Path) -> None:
    """A manifest is JSON any writer of the file chose: `\\ud800` parses to a string no
    encoder writes. verify-rank-layout crashed on it."""
    made = run_cli_subprocess("create", "sur", "--world-size", "2", "--cpu-page-size", "4KiB",
                              "--num-blocks", "2", "--shm-dir", str(shm_dir))
    assert made.exit_code == 0, made.stderr
    manifest = shm_dir / "vllm_offload_sur.manifest.json"
    text = manifest.read_text()
    assert '"rank_source": null' in text
    manifest.write_text(text.replace('"rank_source": null', '"rank_source": "lo\\ud800"'))
    shown = run_cli_subprocess("verify-rank-layout", "sur", "--shm-dir", str(shm_dir))
    assert shown.exit_code == 0, shown.stderr
    assert "lo\\ud800" in shown.stdout
    doc = run_cli_subprocess("verify-rank-layout", "sur", "--json", "--shm-dir", str(shm_dir))
    assert doc.exit_code == 0, doc.stderr
    assert _strict_json(doc.stdout)["data"]["rank_source"] == "lo\\ud800"
