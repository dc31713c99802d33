"""What inspect and gc print is bounded by owners, not files (issue 30): user nobody piles
up region-named files and held unlinked ones; root's commands list their own regions and
the first LISTED_PER_OWNER of nobody's, and sum the rest per owner (--all lists them)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers.other_user import NOBODY
from test_adversarial_nobody import CLI, need_root, run, shared, tricks
from test_volume_nobody import victim

from vllm_offload_cli.cli.inspect import STATES
from vllm_offload_cli.cli.metrics import LISTED_PER_OWNER
from vllm_offload_cli.core.host import discovery

__all__ = ["shared", "tricks"]  # fixtures used here by name

FILES, HELD = 50, 30  # nobody's stale files, and unlinked files nobody holds open


def piled(shared: Path, tricks: Any) -> Path:
    tricks("files", str(shared), "junk", str(FILES), "4096")
    tricks("held", str(shared), "held", str(HELD))
    return victim(shared)


def test_inspect_lists_its_own_and_sums_other_owners_past_the_bound(shared: Path,
                                                                    tricks: Any) -> None:
    need_root()
    piled(shared, tricks)
    code, doc, err = run("inspect", "--shm-dir", str(shared), "--json")
    assert code == 0, err
    data = doc["data"]
    mine = [r for r in data["regions"] if r["uid"] == NOBODY]
    assert len(mine) == LISTED_PER_OWNER
    assert [r["engine_id"] for r in data["regions"] if r["uid"] == 0] == ["victim"]
    [summed] = data["aggregated"]
    assert summed["uid"] == NOBODY and summed["regions"] == FILES + HELD - LISTED_PER_OWNER
    for state, total in (("stale", FILES), ("live", HELD)):
        assert summed["states"][state] + sum(r["state"] == state for r in mine) == total
    assert data["gc_would_free_bytes"] >= FILES * 4096  # the summed regions count too

    code, every, err = run("inspect", "--shm-dir", str(shared), "--json", "--all")
    assert code == 0 and every["data"]["aggregated"] == [], err
    assert len(every["data"]["regions"]) == FILES + HELD + 1

    table = subprocess.run([*CLI, "inspect", "--shm-dir", str(shared)], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    assert ["victim", "-", "stale", "root"] in [line.split()[:4] for line in table.splitlines()]
    [more] = [line.split() for line in table.splitlines() if line.startswith("(")]
    assert more[:5] == [f"({summed['regions']}", "more)", "-",
                        f"live:{summed['states']['live']},stale:{summed['states']['stale']}",
                        "nobody"]
    assert f"{FILES + HELD + 1} region(s), {FILES + 1} stale" in table


def test_textfile_series_are_bounded_and_the_counts_still_add_up(shared: Path,
                                                                 tricks: Any) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    need_root()
    piled(shared, tricks)
    out = subprocess.run([*CLI, "inspect", "--format", "prometheus", "--shm-dir",
                          str(shared)], capture_output=True, text=True, timeout=60, check=True)
    samples = [s for m in text_string_to_metric_families(out.stdout) for s in m.samples]
    regions = {s.labels["inode"] for s in samples if s.name == "vllm_offload_region_state"}
    assert len(regions) == LISTED_PER_OWNER + 1
    owner = {s.labels["state"]: s.value for s in samples
             if s.name == "vllm_offload_owner_regions" and s.labels["uid"] == str(NOBODY)}
    counts = {s.labels["state"]: s.value for s in samples if s.name == "vllm_offload_regions"}
    for state in STATES:
        listed = sum(s.value for s in samples if s.name == "vllm_offload_region_state"
                     and s.labels["state"] == state)
        assert counts[state] == listed + owner[state], state
    assert counts["stale"] == FILES + 1 and counts["live"] == HELD


def test_gc_lists_its_decisions_on_its_own_and_sums_other_owners(shared: Path,
                                                                 tricks: Any) -> None:
    need_root()
    path = piled(shared, tricks)
    code, doc, err = run("gc", "--shm-dir", str(shared), "--min-age", "0", "--json")
    assert code == 0, err
    data = doc["data"]
    assert [r["engine_id"] for r in data["removed"]] == ["victim"] and not path.exists()
    kept = [k for k in data["kept"] if k["uid"] == NOBODY]
    assert len(kept) == LISTED_PER_OWNER
    [summed] = data["kept_aggregated"]
    assert summed["uid"] == NOBODY and summed["regions"] == FILES + HELD - LISTED_PER_OWNER
    codes = {c: sum(k["code"] == c for k in kept) + summed["codes"].get(c, 0)
             for c in ("foreign_owner", "live")}
    assert codes == {"foreign_owner": FILES, "live": HELD}


def test_unlinked_files_past_the_bound_cost_a_count_whatever_holds_them(
        shared: Path, tricks: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """However many processes hold another owner's unlinked files, past JUDGED_OTHERS of
    them per owner each is counted under its holder, not made a region (no residency, no
    manifest lookup, no name per holder): memory bounded by the bound, not the holders."""
    need_root()
    monkeypatch.setattr(discovery, "JUDGED_OTHERS", 10)
    holders = [tricks("held", str(shared), f"h{i}_", "15") for i in range(2)]
    victim(shared)
    inv = discovery.discover(shared)
    assert sum(r.uid == NOBODY for r in inv.regions) == 10
    counted = dict(inv.unnamed_held)
    assert sum(counted.get(h.pid, 0) for h in holders) == 20
    assert [r.engine_id for r in inv.regions if r.uid == 0] == ["victim"]
