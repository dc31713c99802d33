"""The engine hook's start-up steps, run by real processes standing in for an engine's ranks.

Each test starts the ranks of one engine at once against what a host can hold
under the engine's name: nothing, the leftover of a SIGKILLed engine (bigger,
smaller, same size; one file or segmented), a region held by a live process of
another engine, or a region another engine is making at the same moment.
Exactly one rank reclaims, no rank sees stale bytes, collisions name the pid.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_root
from tests.engine_ranks import Engine
from vllm_offload_cli.core.region.geometry import split
from vllm_offload_cli.core.region.naming import manifest_path

MiB = 1 << 20
PAGE = 64 * 1024
WORLD = 3
STRIDE = WORLD * PAGE  # a multiple of 4096: rows need no padding
BLOCKS = 16


@pytest.fixture
def engines(shm_dir: Path) -> Iterator[Any]:
    made: list[Engine] = []

    def make(engine_id: str = "prod", **kw: Any) -> Engine:
        opts: dict[str, Any] = {"num_blocks": BLOCKS, "row_stride": STRIDE,
                                "cpu_page_size": PAGE, "world_size": WORLD, **kw}
        e = Engine(shm_dir, engine_id, **opts)
        made.append(e)
        return e

    try:
        yield make
    finally:
        for e in made:
            e.close()


def region_files(shm_dir: Path, engine_id: str = "prod") -> list[Path]:
    return sorted(p for p in shm_dir.iterdir() if p.name.startswith(f"vllm_offload_{engine_id}."))


def test_ranks_against_nothing_make_one_region_and_all_join_it(engines: Any,
                                                                shm_dir: Path) -> None:
    ranks = engines().start(WORLD)
    assert all(r.ok for r in ranks), [r.info for r in ranks]
    assert sorted(r.info["creator"] for r in ranks) == [False, False, True]
    assert len({r.info["ino"] for r in ranks}) == 1
    assert sorted(r.info["action"] for r in ranks) == ["create", "join", "join"]
    bare = shm_dir / "vllm_offload_prod.mmap"
    assert bare.stat().st_size == BLOCKS * STRIDE
    for k, r in enumerate(ranks):  # each rank writes its own slot; no one sees another's
        assert r.ask(f"fill {k + 1}") == "ok"
    assert all(r.ask("zero") == '{"zero": false}' for r in ranks)


def _leave_stale(engines: Any, **geometry: Any) -> int:
    """An engine whose ranks wrote their slots and were SIGKILLed: returns the old inode."""
    old = engines(**geometry)
    ranks = old.start(WORLD)
    assert all(r.ok for r in ranks), [r.info for r in ranks]
    for k, r in enumerate(ranks):
        assert r.ask(f"fill {0xA0 + k}") == "ok"
    old.kill()
    return int(ranks[0].info["ino"])


@pytest.mark.parametrize("old_blocks", [BLOCKS // 2, BLOCKS, BLOCKS * 2],
                         ids=["smaller", "same-size", "bigger"])
def test_a_killed_engines_leftover_is_reclaimed_by_exactly_one_rank(
        engines: Any, shm_dir: Path, old_blocks: int) -> None:
    old_ino = _leave_stale(engines, num_blocks=old_blocks)
    ranks = engines().start(WORLD)
    assert all(r.ok for r in ranks), [r.info for r in ranks]
    actions = sorted(r.info["action"] for r in ranks)
    assert actions == ["join", "join", "reclaimed"]
    reclaimer = next(r for r in ranks if r.info["action"] == "reclaimed")
    assert reclaimer.info["creator"] and reclaimer.info["reclaimed_bytes"] > 0
    assert {r.info["ino"] for r in ranks} != {old_ino} and len({r.info["ino"] for r in ranks}) == 1
    assert all(r.ask("zero") == '{"zero": true}' for r in ranks)  # no stale bytes joined
    assert [p.stat().st_size for p in region_files(shm_dir) if p.suffix == ".mmap"] == [
        BLOCKS * STRIDE]


def test_a_leftover_made_by_plain_vllm_is_reclaimed(engines: Any, shm_dir: Path,
                                                     holders: Any) -> None:
    """vLLM's tiering path leaks its file with no manifest and no lock: same-size join trap."""
    h = holders("vllm", str(shm_dir), "prod", str(BLOCKS), "0", str(STRIDE), str(PAGE))
    h.send("fill 7")
    assert h.proc.stdout is not None and h.proc.stdout.readline().strip() == "ok"
    h.kill()
    ranks = engines().start(WORLD)
    assert sorted(r.info["action"] for r in ranks) == ["join", "join", "reclaimed"]
    assert all(r.ask("zero") == '{"zero": true}' for r in ranks)


def test_a_segmented_leftover_is_reclaimed_whole(engines: Any, shm_dir: Path) -> None:
    """vLLM's CPU spec splits >= 2 GiB into .mmap.N files; sparse here, nothing is faulted in."""
    big = {"num_blocks": 8, "row_stride": 3 * 128 * MiB, "cpu_page_size": 128 * MiB,
           "segments": 32}
    old_ino = _leave_stale(engines, **big)
    old = region_files(shm_dir)
    assert [p.name for p in old if ".mmap" in p.name] == [
        "vllm_offload_prod.mmap", "vllm_offload_prod.mmap.1", "vllm_offload_prod.mmap.2"]
    ranks = engines(**big).start(WORLD)
    assert sorted(r.info["action"] for r in ranks) == ["join", "join", "reclaimed"]
    assert old_ino not in {r.info["ino"] for r in ranks}
    assert all(r.ask("zero") == '{"zero": true}' for r in ranks)
    sizes = [p.stat().st_size for p in region_files(shm_dir) if ".mmap" in p.name]
    assert sizes == [s.length for s in split(8, 3 * 128 * MiB, 3)]


def test_a_region_held_by_another_engine_is_refused_naming_the_pid(engines: Any,
                                                                     shm_dir: Path) -> None:
    first = engines().start(WORLD)
    assert all(r.ok for r in first)
    second = engines().start(WORLD)  # same engine_id, another token: another `vllm serve`
    assert [r.info.get("code") for r in second] == ["engine_id_collision"] * WORLD
    pids = {r.info["pid"] for r in first}
    for r in second:
        assert r.info["pid"] in pids and f"pid {r.info['pid']}" in r.info["error"]
    assert all(r.ask("zero") == '{"zero": true}' for r in first)  # untouched
    assert len({p.stat().st_ino for p in region_files(shm_dir) if p.suffix == ".mmap"}) == 1


def test_a_live_plain_vllm_process_is_another_engine(engines: Any, shm_dir: Path,
                                                      holders: Any) -> None:
    h = holders("vllm", str(shm_dir), "prod", str(BLOCKS), "0", str(STRIDE), str(PAGE))
    ranks = engines().start(WORLD)
    assert {r.info.get("code") for r in ranks} == {"engine_id_collision"}
    assert all(r.info["pid"] == h.pid for r in ranks)


def test_two_engines_starting_at_once_one_wins_the_other_is_refused(engines: Any,
                                                                    shm_dir: Path) -> None:
    a, b = engines(), engines()
    ranks = [a.spawn(k) for k in range(WORLD)] + [b.spawn(k) for k in range(WORLD)]
    for r in ranks:
        r.ready()
    by_engine = [[r.ok for r in e.ranks] for e in (a, b)]
    assert sorted(by_engine) == [[False] * WORLD, [True] * WORLD], [r.info for r in ranks]
    winner, loser = (a, b) if by_engine[0][0] else (b, a)
    winner_pids = {r.info["pid"] for r in winner.ranks}
    assert all(r.info["code"] == "engine_id_collision" and r.info["pid"] in winner_pids
               for r in loser.ranks)
    assert len({r.info["ino"] for r in winner.ranks}) == 1


def test_two_workers_computing_one_slot_are_refused(engines: Any) -> None:
    e = engines()
    first = e.spawn(1)
    assert first.ready()["action"] == "create"
    twin = e.spawn(1)  # a second worker that computed the same slot
    assert twin.ready()["code"] == "slot_collision"
    assert f"pid {first.info['pid']}" in twin.info["error"]


def test_released_name_leaves_a_live_mapping_and_nothing_to_leak(engines: Any,
                                                                 shm_dir: Path) -> None:
    ranks = engines().start(WORLD)
    assert ranks[0].ask("release") == '{"released": true}'
    assert region_files(shm_dir) == []  # name and manifest gone; the mapping lives on
    assert all(r.ask("zero") == '{"zero": true}' for r in ranks)
    # another engine with the id would share no bytes now, but it is still a collision
    refused = engines().spawn(0).ready()
    assert refused["code"] == "engine_id_collision" and "(deleted)" in refused["error"]
    assert refused["pid"] in {r.info["pid"] for r in ranks}
    # ...and it says so: a new engine would get a fresh file, not share KV bytes
    assert "fresh file" in refused["error"] and "share KV bytes" not in refused["error"]
    for r in ranks:
        r.kill()  # the kernel frees the bytes with the last mapping: nothing to reclaim
    again = engines().start(WORLD)
    assert sorted(r.info["action"] for r in again) == ["create", "join", "join"]
    assert region_files(shm_dir) != []


def test_importing_the_hook_needs_neither_vllm_nor_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, vllm_offload_cli.engine, vllm_offload_cli.engine.plugin; "
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": ""})
    assert out.stdout.strip() == "[]"


def test_the_token_is_made_once_and_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_offload_cli.engine.identity import ENGINE_TOKEN_ENV, engine_token, read_token

    monkeypatch.setenv(ENGINE_TOKEN_ENV, "not-a-token")  # malformed: replaced
    token = engine_token()
    assert token != "not-a-token" and engine_token() == token == os.environ[ENGINE_TOKEN_ENV]
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "print(1, flush=True); input()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline()  # running, exec done
        assert read_token(child.pid)[0] == token  # what a sibling rank reads from /proc
    finally:
        child.communicate(b"\n")
    from vllm_offload_cli.core.system import processes

    env = processes.environ(os.getpid())  # set after exec: not in environ
    assert env is not None and ENGINE_TOKEN_ENV not in env
    assert read_token(os.getpid())[0] == token  # ...but our beacon says it


def test_a_worker_forked_after_the_token_was_set_is_still_this_engine() -> None:
    """vLLM forks its workers: /proc/PID/environ shows the parent's exec-time environment,
    without the token; the inherited beacon proves the worker is ours."""
    from vllm_offload_cli.core.system import processes
    from vllm_offload_cli.engine import identity

    token = identity.engine_token()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the forked worker: no exec, so no new environment block
        os.close(write)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        assert (processes.environ(pid) or {}).get(identity.ENGINE_TOKEN_ENV) != token
        assert identity.read_token(pid)[0] == token
    finally:
        os.close(write)
        os.waitpid(pid, 0)


def test_a_process_holding_another_engines_beacon_is_read_as_that_engine() -> None:
    import sys

    from vllm_offload_cli.engine import identity

    other = "ab" * 16
    code = (f"import os; fd = os.memfd_create({identity.BEACON_PREFIX + other!r}); "
            "print(1, flush=True); input()")
    env = {k: v for k, v in os.environ.items() if k != identity.ENGINE_TOKEN_ENV}
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline()
        assert identity.read_token(child.pid)[0] == other != identity.engine_token()
    finally:
        child.communicate(b"\n")


def test_the_plugin_never_raises_into_vllm_unless_strict(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import sys

    from vllm_offload_cli.engine import plugin
    from vllm_offload_cli.engine.identity import ENGINE_TOKEN_ENV

    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM absent or broken: import fails
    monkeypatch.delenv(ENGINE_TOKEN_ENV, raising=False)
    monkeypatch.delenv(plugin.STRICT_ENV, raising=False)
    plugin.register()
    plugin.register()
    assert "could not register" in caplog.text
    assert len(os.environ[ENGINE_TOKEN_ENV]) == 32  # the token is set before workers spawn
    monkeypatch.setenv(plugin.STRICT_ENV, "1")
    with pytest.raises(ImportError):
        plugin.register()


def test_a_pre_provisioned_region_is_joined_if_its_geometry_matches(engines: Any, cli: Any,
                                                                    shm_dir: Path) -> None:
    made = cli("create", "prod", "--world-size", str(WORLD), "--cpu-page-size", str(PAGE),
               "--num-blocks", str(BLOCKS), "--shm-dir", str(shm_dir))
    assert made.exit_code == 0, made.stderr
    ino = (shm_dir / "vllm_offload_prod.mmap").stat().st_ino
    ranks = engines().start(WORLD)
    assert [r.info["action"] for r in ranks] == ["join"] * WORLD
    assert {r.info["ino"] for r in ranks} == {ino}
    other = engines("other")
    cli("create", "other", "--world-size", str(WORLD), "--cpu-page-size", str(PAGE),
        "--num-blocks", str(BLOCKS * 2), "--shm-dir", str(shm_dir))
    refused = other.spawn(0).ready()
    assert refused["code"] == "size_mismatch"  # exit 6: never joined with another geometry


def test_a_pre_provisioned_region_keeps_its_name_whichever_spec_releases(
        engines: Any, cli: Any, shm_dir: Path) -> None:
    """The tiering spec's scheduler releases the name of what it joins: never that of a
    region `create` made to keep (the CPU spec releases only what the engine made)."""
    made = cli("create", "prod", "--world-size", str(WORLD), "--cpu-page-size", str(PAGE),
               "--num-blocks", str(BLOCKS), "--shm-dir", str(shm_dir))
    assert made.exit_code == 0, made.stderr
    ino = (shm_dir / "vllm_offload_prod.mmap").stat().st_ino
    e = engines()
    ranks = e.start(WORLD)
    scheduler = e.spawn(None)
    assert scheduler.ready()["action"] == "join"
    assert scheduler.ask("release") == '{"released": false}'
    for r in [*ranks, scheduler]:
        assert r.stop() == 0
    assert (shm_dir / "vllm_offload_prod.mmap").stat().st_ino == ino
    assert manifest_path(shm_dir, "prod").exists()


def test_a_lease_never_closed_is_closed_at_interpreter_exit(engines: Any,
                                                             shm_dir: Path) -> None:
    """A program that exits without shutting vLLM down leaves no named region behind."""
    [rank] = engines().start(1)
    assert rank.info["action"] == "create"
    assert (shm_dir / "vllm_offload_prod.mmap").exists()
    assert rank.proc.stdin is not None
    rank.proc.stdin.write("leave\n")
    rank.proc.stdin.flush()
    assert rank.proc.wait(timeout=30) == 0
    assert region_files(shm_dir) == []


def test_a_leftover_of_another_user_is_refused_not_removed(engines: Any,
                                                          shm_dir: Path) -> None:
    require_root("needs root to plant a file owned by another user")
    leftover = shm_dir / "vllm_offload_prod.mmap"
    leftover.touch(mode=0o600)
    os.truncate(leftover, BLOCKS * STRIDE)
    os.chown(leftover, 12345, 12345)
    info = engines().spawn(0).ready()
    assert info["code"] == "foreign_owner" and "uid 12345" in info["error"]
    assert leftover.exists()


def _blind(cmd: list[str] | None = None) -> list[str]:
    """A new PID namespace with its own /proc: the rank sees only itself (skips if denied)."""
    require_root("needs root for a PID namespace")
    require_root("unshare(1) is not installed", granted=shutil.which("unshare") is not None)
    wrap = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    probe = subprocess.run([*wrap, "true"], capture_output=True, timeout=30)
    require_root(f"unshare --pid is not permitted here: {probe.stderr.decode()}",
                 granted=probe.returncode == 0)
    return [*wrap, *(cmd or [])]


@pytest.mark.parametrize("holder", [False, True], ids=["nobody-holds-it", "hidden-holder"])
def test_a_rank_that_cannot_prove_a_leftover_unused_refuses_it(
        engines: Any, shm_dir: Path, holders: Any, holder: bool) -> None:
    """`unknown` end to end: a blind rank neither reclaims nor joins nor replaces.

    In its own PID namespace a rank cannot see the processes outside, so no
    leftover is provably stale, whether or not one of them (here a plain vLLM
    process) still maps it. The same leftover seen from the host: reclaimed when
    nobody holds it, refused as another engine's (naming the pid) when held.
    """
    old = engines(num_blocks=BLOCKS // 2)
    [r] = old.start(1)
    assert r.ask("fill 9") == "ok"
    r.kill()  # a SIGKILLed engine's leftover, made by the hook: manifest and all
    bare = shm_dir / "vllm_offload_prod.mmap"
    before = (bare.stat().st_ino, bare.read_bytes())
    names = sorted(p.name for p in region_files(shm_dir))  # the file and its manifest
    h = holders("vllm", str(shm_dir), "prod", str(BLOCKS // 2), "0", str(STRIDE),
                str(PAGE)) if holder else None

    blind = engines().spawn(0, wrap=_blind())
    info = blind.ready()
    assert info.get("code") == "region_not_stale", info
    assert f"{bare} is unknown: nothing proves it unused (" in info["error"]
    assert "PID namespace" in info["error"]  # the blind spot, in the error itself
    assert blind.proc.wait(timeout=30) == 3
    assert (bare.stat().st_ino, bare.read_bytes()) == before  # not removed, not rewritten
    assert sorted(p.name for p in region_files(shm_dir)) == names

    seen = engines().start(1)[0]  # the same step on the host sees everything
    if h is not None:
        assert (seen.info.get("code"), seen.info.get("pid")) == ("engine_id_collision", h.pid)
        assert (bare.stat().st_ino, bare.read_bytes()) == before
    else:
        assert seen.ok and seen.info["action"] == "reclaimed", seen.info
        assert seen.info["ino"] != before[0]


def test_a_released_region_stays_fully_visible_while_any_holder_lives(
        engines: Any, cli: Any, shm_dir: Path) -> None:
    """Once the hook released the names (vLLM's barrier passed), inspect and
    verify-rank-layout still see the geometry, every rank, the creator and the age, from
    the manifest each holder carries; nothing of it is left when the last holder goes."""
    ranks = engines().start(WORLD)
    assert [r.ask(f"fill {k + 1}") for k, r in enumerate(ranks)] == ["ok"] * WORLD

    def inspected() -> dict[str, Any]:
        doc = cli("inspect", "--shm-dir", str(shm_dir), "--json").json["data"]
        [region] = doc["regions"]
        return region  # type: ignore[no-any-return]

    def verified(exit_code: int = 0) -> dict[str, Any]:
        result = cli("verify-rank-layout", "prod", "--shm-dir", str(shm_dir), "--json")
        assert result.exit_code == exit_code, result.stdout + result.stderr
        return result.json["data"]  # type: ignore[no-any-return]

    named, named_check = inspected(), verified()
    creator = next(r for r in ranks if r.info["creator"])
    assert creator.ask("release") == '{"released": true}'
    assert region_files(shm_dir) == []
    released, released_check = inspected(), verified()
    assert (released["linked"], released["state"]) == (False, "live")
    for key in ("geometry", "size_bytes", "base_engine_id"):
        assert released[key] == named[key]
    assert released["geometry"] is not None
    assert sorted(h["rank"] for h in released["holders"]) == list(range(WORLD))
    assert released["age_seconds"] >= named["age_seconds"]
    for key in ("geometry", "geometry_source", "rank_source", "workers"):
        assert released_check[key] == named_check[key]
    assert released_check["path"].endswith("vllm_offload_prod.mmap (deleted)")
    # the creator dies (SIGKILL): the others still carry what it wrote
    creator.kill()
    rest = [r for r in ranks if r is not creator]
    assert sorted(h["rank"] for h in inspected()["holders"]) == sorted(
        r.info["rank"] for r in rest)
    check = verified(exit_code=3)  # as for a named region: a worker of the engine is gone
    assert check["geometry"] == named_check["geometry"]
    assert [(p["code"], p["ranks"]) for p in check["problems"]] == [
        ("rank_missing", [creator.info["rank"]])]
    for r in rest:
        r.kill()
    assert cli("inspect", "--shm-dir", str(shm_dir), "--json").json["data"]["regions"] == []
    assert region_files(shm_dir) == []
