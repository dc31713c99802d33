"""What the hook and `create` know of a vLLM, and what they do with a vLLM they do not
understand: stand-in source trees (tests/helpers/vllm_tree.py), no vLLM needed.

The release table itself is checked against the code of the real release in use
(VLLM_OFFLOAD_VLLM_SRC; .ci/run runs this file once per release of the matrix), and
tests/test_vllm_adapter.py checks it against what plain vLLM does.
"""

from __future__ import annotations

import ast
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_offload_cli.core.region.geometry import effective_segments, layout_of
from vllm_offload_cli.engine.vllm_rules import (
    CPU_SPEC_MODULE,
    DEVICE_MODULO,
    LOGICAL,
    REGION_CLASS,
    RELEASES,
    TIERING_SPEC_MODULE,
    RegionCall,
    UnsupportedVllm,
    read_rules,
    release_of,
)

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import vllm_tree

# The shapes of the three releases, as stand-ins (our code, their signatures).
SEGMENTED_033 = {"params": "barrier=None, *, creator_memory_check=None, populate_shard=None, "
                           "num_segments=1",
                 "call": "barrier=print, num_segments=_REGION_SEGMENTS, populate_shard=None",
                 "version": "0.33.0"}
ONE_FILE_032 = {"params": "barrier=None, *, creator_memory_check=None, "
                          "populate_only_on_creator=False",
                "call": "barrier=print", "version": "0.32.0"}
DEVICE_031 = {**ONE_FILE_032, "rank_line": vllm_tree.DEVICE_MODULO, "version": "0.31.0"}
UNKNOWN = {"params": "barrier=None, *, num_segments=1, segment_bytes=0",
           "call": "barrier=print", "version": "0.33.0"}


@pytest.mark.parametrize(("shape", "cpu", "layout"), [
    (SEGMENTED_033, RegionCall(segments=32, rank_source=LOGICAL, barrier=True), "segmented"),
    (ONE_FILE_032, RegionCall(segments=1, rank_source=LOGICAL, barrier=True), "single-file"),
    (DEVICE_031, RegionCall(segments=1, rank_source=DEVICE_MODULO, barrier=True),
     "single-file"),
])
def test_the_rules_are_the_table_row_of_the_release(tmp_path: Path, shape: dict[str, str],
                                                    cpu: RegionCall, layout: str) -> None:
    rules = read_rules(vllm_tree.write(tmp_path, **shape))
    assert (rules.cpu_worker, rules.version) == (cpu, shape["version"])
    assert layout_of(rules.cpu_worker.segments) == layout
    # the table's: both specs of a release pick slots alike (the stand-in's tiering code
    # does not say; the real releases' code is checked below)
    assert rules.tiering_worker == RegionCall(segments=1, rank_source=cpu.rank_source,
                                              barrier=False)
    assert rules.tiering_scheduler.rank_source is None
    assert rules.min_segment_bytes == 1 << 30
    files = effective_segments(rules.cpu_worker.segments, 3 << 30,
                               min_bytes=rules.min_segment_bytes)
    assert files == (3 if layout == "segmented" else 1)


@pytest.mark.parametrize(("shape", "why"), [
    (UNKNOWN, "takes segment_bytes and lacks creator_memory_check, populate_shard"),
    ({**ONE_FILE_032, "version": "0.33.0"},
     "takes populate_only_on_creator and lacks num_segments, populate_shard"),
    ({**ONE_FILE_032, "version": "0.34.0"}, "outside the releases this vllm-offload knows"),
    ({**ONE_FILE_032, "version": "unknown"}, "vLLM unknown at .* is outside the releases"),
    ({**SEGMENTED_033, "min_segment_bytes": "int('7')"},
     "_MIN_SEGMENT_BYTES is not a positive integer constant"),
    ({**ONE_FILE_032, "params": "barrier=None, **kwargs"}, r"\*\*kwargs"),
])
def test_code_that_is_not_understood_is_refused_not_guessed(tmp_path: Path,
                                                            shape: dict[str, str],
                                                            why: str) -> None:
    with pytest.raises(UnsupportedVllm, match=why):
        read_rules(vllm_tree.write(tmp_path, **shape))


def test_a_patch_release_shares_its_release_row() -> None:
    assert [release_of(v) for v in ("0.33.0", "0.33.1.dev4+g12ab", "0.31", "1.0rc1", None)
            ] == ["0.33", "0.33", "0.31", "", ""]


def test_a_tree_without_the_region_module_is_refused(tmp_path: Path) -> None:
    root = vllm_tree.write(tmp_path, **ONE_FILE_032)
    (root / "vllm/v1/kv_offload/cpu/shared_offload_region.py").unlink()
    with pytest.raises(UnsupportedVllm, match=r"shared_offload_region\.py cannot be read"):
        read_rules(root)


ENGINE = '''
import json, logging, sys, types
sys.path.insert(0, sys.argv[1])
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s", stream=sys.stderr)
from vllm_offload_cli.engine import plugin
plugin.register()
plugin.register()  # vLLM loads plugins in every process, sometimes twice
from vllm.v1.kv_offload import calls
from vllm_offload_cli.engine.vllm_spec import HardenedCPUOffloadingSpec
parallel = types.SimpleNamespace(rank=0, world_size=1)
config = types.SimpleNamespace(engine_id=sys.argv[2], parallel=parallel,
                               extra_config=json.loads(sys.argv[3]))
HardenedCPUOffloadingSpec(config).create_worker(None)
print(json.dumps(calls))
'''


def _engine(root: Path, engine_id: str, extra: dict[str, Any] | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", ENGINE, str(root), engine_id, json.dumps(extra or {})],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, **(env or {})})


def test_a_vllm_outside_the_matrix_gets_one_warning_and_runs_as_plain_vllm(
        tmp_path: Path) -> None:
    engine_id = f"vllm-offload-test-{secrets.token_hex(6)}"
    run = _engine(vllm_tree.write(tmp_path, **UNKNOWN), engine_id)
    assert run.returncode == 0, run.stderr
    logged = [line for line in run.stderr.splitlines() if line.startswith("LOG ")]
    assert len(logged) == 1 and "segment_bytes" in logged[0]
    assert "engine runs as plain vLLM" in logged[0]
    # nothing registered; vLLM's own create_worker built its region; the hook made nothing
    assert json.loads(run.stdout) == [["plain create_worker"], ["region", engine_id, 0]]
    assert not list(Path("/dev/shm").glob(f"vllm_offload_{engine_id}*"))


def test_strict_mode_refuses_a_vllm_outside_the_matrix(tmp_path: Path) -> None:
    root = vllm_tree.write(tmp_path, **UNKNOWN)
    run = _engine(root, "strict", env={"VLLM_OFFLOAD_STRICT": "1"})
    assert run.returncode == 1 and "UnsupportedVllm" in run.stderr
    assert "segment_bytes" in run.stderr and run.stdout == ""
    hook = _engine(root, "strict", extra={"vllm_offload_strict": True})  # the spec's switch
    assert hook.returncode == 1 and "UnsupportedVllm" in hook.stderr and hook.stdout == ""


def test_a_vllm_inside_the_matrix_gets_both_names_registered(tmp_path: Path) -> None:
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from vllm_offload_cli.engine "
              "import plugin; plugin.register(); from vllm.v1.kv_offload import calls; "
              "print(calls)")
    run = subprocess.run([sys.executable, "-c", script,
                          str(vllm_tree.write(tmp_path, **SEGMENTED_033))],
                         capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == ("[('registered', 'HardenedCPUOffloadingSpec'), "
                                  "('registered', 'HardenedTieringOffloadingSpec')]"), run.stderr


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make a stand-in tree the `vllm` that `create` finds (never imported)."""
    def install(**shape: str) -> None:
        root = vllm_tree.write(tmp_path / "site", **shape)
        monkeypatch.delitem(sys.modules, "vllm", raising=False)
        monkeypatch.syspath_prepend(str(root))
    return install


def _create(cli: Any, shm_dir: Path, engine_id: str, *extra: str) -> Any:
    return cli("create", engine_id, "--world-size", "2", "--cpu-page-size", "1MiB", "--size",
               "3GiB", "--no-populate", "--shm-dir", str(shm_dir), "--json", *extra)


def test_create_makes_the_layout_of_the_vllm_installed_here(cli: Any, shm_dir: Path,
                                                            installed: Any) -> None:
    installed(**ONE_FILE_032)
    made = _create(cli, shm_dir, "one")
    assert made.exit_code == 0, made.stderr
    assert made.json["data"]["vllm_layout"] == {"name": "single-file", "basis": "vllm",
                                                "vllm_version": "0.32.0"}
    assert [Path(p).name for p in made.json["data"]["paths"]] == ["vllm_offload_one.mmap"]
    assert made.json["warnings"] == []
    manifest = json.loads((shm_dir / "vllm_offload_one.manifest.json").read_text())
    assert (manifest["segments"], manifest["vllm_layout_basis"]) == (1, "vllm")  # single-file
    human = cli("create", "two", "--world-size", "2", "--cpu-page-size", "1MiB", "--size",
                "3GiB", "--no-populate", "--shm-dir", str(shm_dir))
    assert "layout    single-file (read from the vLLM 0.32.0 installed here)" in human.stdout


def test_create_refuses_to_guess_for_a_vllm_it_does_not_understand(
        cli: Any, shm_dir: Path, installed: Any) -> None:
    installed(**UNKNOWN)
    refused = _create(cli, shm_dir, "odd")
    assert refused.exit_code == 2
    assert refused.json["errors"][0]["code"] == "unknown_vllm"
    assert "--vllm-layout segmented or single-file" in refused.json["errors"][0]["message"]
    assert list(shm_dir.iterdir()) == []
    asked = _create(cli, shm_dir, "odd", "--vllm-layout", "segmented")  # the way out
    assert asked.exit_code == 0 and len(asked.json["data"]["paths"]) == 3


# -- the table against the code of the release in use (CI: once per release) ----------------

def _region_call(tree: ast.Module, cls: str, method: str) -> RegionCall:
    """What the one SharedOffloadRegion call in `cls.method` does, read from its code."""
    [func] = [f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls
              for f in c.body if isinstance(f, ast.FunctionDef) and f.name == method]
    [call] = [n for n in ast.walk(func) if isinstance(n, ast.Call)
              and getattr(n.func, "id", getattr(n.func, "attr", None)) == REGION_CLASS]
    given = {k.arg: k.value for k in call.keywords}
    segments = given.get("num_segments")
    if segments is not None:  # the module's constant, as vLLM defines it
        [value] = [n.value for n in tree.body if isinstance(n, ast.Assign)
                   and isinstance(segments, ast.Name)
                   and any(getattr(t, "id", None) == segments.id for t in n.targets)]
        segments = value
    is_none = lambda node: isinstance(node, ast.Constant) and node.value is None  # noqa: E731
    attributes = {n.attr for n in ast.walk(func) if isinstance(n, ast.Attribute)}
    rank_source = (None if is_none(given["rank"]) else DEVICE_MODULO
                   if "current_device_index" in attributes else LOGICAL)
    assert rank_source is None or "current_device_index" in attributes or (
        "rank" in attributes and "parallel" in attributes), "a slot rule the table lacks"
    return RegionCall(segments=1 if segments is None else ast.literal_eval(segments),
                      rank_source=rank_source,
                      barrier="barrier" in given and not is_none(given["barrier"]))


def test_the_release_table_matches_the_code_of_the_vllm_in_use() -> None:
    src = os.environ.get("VLLM_OFFLOAD_VLLM_SRC")
    if not src:
        if os.environ.get("VLLM_OFFLOAD_REQUIRE_VLLM") == "1":
            raise RuntimeError("vLLM's sources are required (VLLM_OFFLOAD_VLLM_SRC) but absent")
        pytest.skip("vLLM's sources are not available (set VLLM_OFFLOAD_VLLM_SRC)")
    rules = read_rules(Path(src))  # the row of this release; its signatures match
    assert release_of(rules.version) in RELEASES

    def parsed(module: str) -> ast.Module:
        return ast.parse((Path(src) / (module.replace(".", "/") + ".py")).read_text())
    cpu, tiering = parsed(CPU_SPEC_MODULE), parsed(TIERING_SPEC_MODULE)
    assert rules.cpu_worker == _region_call(cpu, "CPUOffloadingSpec", "create_worker")
    assert rules.tiering_worker == _region_call(tiering, "TieringOffloadingSpec",
                                                "create_worker")
    assert rules.tiering_scheduler == _region_call(tiering, "TieringOffloadingSpec",
                                                   "get_manager")
