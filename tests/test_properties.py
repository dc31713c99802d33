"""Property-based tests of everything that parses outside input (issue 9, item 6).

What is written and parsed back is equal; whatever goes in, only the
documented errors come out (InvalidInputError, UntrustedJsonError, a
`manifest_*` problem). Example counts stay modest (profile below) so the suite
stays fast; HYPOTHESIS_PROFILE=thorough runs many more.
"""

from __future__ import annotations

import itertools
import json
import os
from contextlib import suppress
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.region_files import private_shm_dir
from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.units import parse_size
from vllm_offload_cli.core.region import manifest as manifest_io
from vllm_offload_cli.core.region import untrusted_json as uj
from vllm_offload_cli.core.region.geometry import (
    PAGESIZE,
    Geometry,
    geometry_from_size,
)
from vllm_offload_cli.core.region.naming import (
    MAX_ENGINE_ID_LEN,
    engine_id_problem,
    manifest_path,
    parse_manifest_filename,
    parse_region_filename,
    region_filename,
    split_engine_id,
    validate_engine_id,
    with_dp_rank,
)
from vllm_offload_cli.core.region.prefault import slot_ranges
from vllm_offload_cli.core.system.files import FileId

settings.register_profile("fast", max_examples=40, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=2000, deadline=None, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))

engine_ids = st.from_regex(r"[A-Za-z0-9._-]{1,60}", fullmatch=True).filter(
    lambda s: s not in (".", ".."))
any_text = st.text(st.characters(codec="utf-8"), max_size=80) | st.from_regex(
    r"vllm_offload_[A-Za-z0-9._\n\r\t\x00\x1b-]{0,20}\.(mmap|manifest\.json)(\.[0-9]{1,3})?"
    r"[\n\x00]?", fullmatch=True)


_scratch = private_shm_dir  # one per example: fixtures are per test, not per example


# -- naming ---------------------------------------------------------------------------


@given(engine_ids, st.integers(0, 40))
def test_region_names_round_trip(engine_id: str, segment: int) -> None:
    name = region_filename(engine_id) + (f".{segment}" if segment else "")
    parsed = parse_region_filename(name)
    assert parsed is not None and (parsed.engine_id, parsed.segment) == (engine_id, segment)
    assert parse_manifest_filename(manifest_path("/x", engine_id).name) == engine_id


@given(any_text)
def test_any_name_parses_to_a_valid_id_or_nothing(name: str) -> None:
    parsed = parse_region_filename(name)
    if parsed is not None:
        assert engine_id_problem(parsed.engine_id) is None
        suffix = f".{parsed.segment}" if parsed.segment else ""
        assert region_filename(parsed.engine_id) + suffix == name  # nothing left over
    engine_id = parse_manifest_filename(name)
    if engine_id is not None:
        assert manifest_path("/x", engine_id).name == name


@given(st.text(max_size=MAX_ENGINE_ID_LEN + 5))
def test_engine_id_validation_is_exact(text: str) -> None:
    safe = (0 < len(text) <= MAX_ENGINE_ID_LEN and text not in (".", "..")
            and all(c.isascii() and (c.isalnum() or c in "._-") for c in text))
    assert (engine_id_problem(text) is None) == safe
    try:
        assert validate_engine_id(text) == text and safe
    except InvalidInputError:
        assert not safe


@given(engine_ids, st.integers(0, 10**6))
def test_dp_rank_round_trips(base: str, dp_rank: int) -> None:
    full = with_dp_rank(base, dp_rank)
    parts = split_engine_id(full)
    assert (parts.base_engine_id, parts.dp_rank) == (base, dp_rank)


# -- geometry -------------------------------------------------------------------------


@given(st.integers(1, 4096), st.integers(1, 64), st.integers(1, 1 << 20))
def test_worker_geometry_holds_every_slot(num_blocks: int, world: int, page: int) -> None:
    g = Geometry.for_workers(num_blocks=num_blocks, world_size=world, cpu_page_size=page)
    assert g.row_stride % PAGESIZE == 0
    assert world * page <= g.row_stride < world * page + PAGESIZE
    assert g.size_bytes == num_blocks * g.row_stride
    slots = [g.slot(r) for r in range(world)]
    assert all(a.stop == b.start for a, b in itertools.pairwise(slots))  # disjoint, in order
    assert slots[-1].stop <= g.row_stride


@given(st.integers(1, 64), st.integers(1, 1 << 20), st.integers(1, 1 << 34))
def test_size_is_split_into_whole_rows(world: int, page: int, size: int) -> None:
    try:
        g, rest = geometry_from_size(size, world_size=world, cpu_page_size=page)
    except InvalidInputError:
        assert size < Geometry.for_workers(num_blocks=1, world_size=world,
                                           cpu_page_size=page).row_stride
        return
    assert g.size_bytes + rest == size and 0 <= rest < g.row_stride


@given(st.integers(1, 16), st.integers(1, 8), st.integers(1, 3 * PAGESIZE),
       st.data())
def test_prefault_ranges_cover_only_the_ranks_slot(num_blocks: int, world: int, page: int,
                                                   data: st.DataObject) -> None:
    g = Geometry.for_workers(num_blocks=num_blocks, world_size=world, cpu_page_size=page)
    rank = data.draw(st.integers(0, world - 1))
    covered = {b for start, length in slot_ranges(g, rank) for b in range(start, start + length)}
    start = g.slot(rank).start
    assert {row * g.row_stride + start + i for row in range(num_blocks) for i in range(page)
            } <= covered
    assert all(0 <= b < g.size_bytes for b in covered)
    whole = slot_ranges(g, None)
    assert sum(length for _, length in whole) == g.size_bytes


# -- sizes ----------------------------------------------------------------------------


@given(st.integers(0, 1 << 60))
def test_sizes_round_trip(n: int) -> None:
    assert parse_size(str(n)) == n
    for unit, multiple in (("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3)):
        assert parse_size(f"{n}{unit}") == n * multiple


@given(st.integers(0, 1 << 30), st.sampled_from(["", "B", "k", "KiB", "m", "MiB", "G", "GiB",
                                                 "TiB"]))
def test_suffixes_multiply_exactly(n: int, unit: str) -> None:
    scale = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
             "g": 1 << 30, "gib": 1 << 30, "tib": 1 << 40}[unit.lower()]
    assert parse_size(f"{n}{unit}") == n * scale


@given(st.text(max_size=60) | st.from_regex(r"[0-9]{1,400}(\.[0-9]{1,400})?[KMGT]?i?B?",
                                            fullmatch=True))
def test_any_size_text_is_a_size_or_invalid_input(text: str) -> None:
    try:
        value = parse_size(text)
    except InvalidInputError:
        return
    assert isinstance(value, int) and value >= 0


# -- manifests ------------------------------------------------------------------------

finite_times = st.floats(0, 2.0**33, allow_nan=False, allow_infinity=False)
small_strings = st.text(max_size=40)
attachments = st.builds(
    manifest_io.Attachment, pid=st.integers(1, 2**22), start_ticks=st.none() | st.integers(
        0, 2**63), rank=st.none() | st.integers(0, 64), device_index=st.none() | st.integers(
        0, 64), rank_source=st.none() | small_strings, host=st.none() | small_strings,
    attached_at=finite_times)


@st.composite
def manifests(draw: st.DrawFn) -> manifest_io.Manifest:
    world = draw(st.integers(1, 16))
    page = draw(st.integers(1, 1 << 20))
    geometry = Geometry.for_workers(num_blocks=draw(st.integers(1, 1 << 20)), world_size=world,
                                    cpu_page_size=page)
    return manifest_io.Manifest(
        engine_id=draw(engine_ids), geometry=geometry, region_dev=draw(st.integers(0, 2**64 - 1)),
        region_ino=draw(st.integers(0, 2**64 - 1)), creator_pid=draw(st.integers(1, 2**22)),
        creator_start_ticks=draw(st.none() | st.integers(0, 2**63)),
        creator_host=draw(small_strings), created_at=draw(finite_times),
        layout=draw(st.sampled_from(["worker", "canonical"])),
        rank_source=draw(st.none() | st.sampled_from(["logical", "device-modulo"])),
        persistent=draw(st.booleans()),
        attachments=tuple(draw(st.lists(attachments, max_size=4))),
        state=draw(st.sampled_from([manifest_io.CREATING, manifest_io.READY])))


@given(manifests())
def test_manifest_write_then_read_is_equal(m: manifest_io.Manifest) -> None:
    with _scratch() as d:
        path = str(manifest_path(d, m.engine_id))
        manifest_io.write(path, m)
        assert manifest_io.read(path, owner_uid=os.geteuid()) == m


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=4),
    max_leaves=30)


def _only_documented_errors(doc: Any) -> None:
    with suppress(uj.UntrustedJsonError):
        manifest_io.Manifest.from_json(doc)


@given(json_values)
def test_any_json_is_a_manifest_or_refused(doc: Any) -> None:
    _only_documented_errors(doc)
    try:
        text = json.dumps(doc)
    except ValueError:
        return
    try:
        parsed = uj.loads(text.encode(), max_bytes=1 << 20)
    except uj.UntrustedJsonError:
        return
    _only_documented_errors(parsed)


@given(manifests(), st.data())
def test_a_manifest_with_any_field_replaced_is_refused_or_valid(
        m: manifest_io.Manifest, data: st.DataObject) -> None:
    doc = m.to_json()
    section = data.draw(st.sampled_from([doc, doc["geometry"], doc["creator"], doc["region"]]))
    key = data.draw(st.sampled_from(sorted(section)))
    section[key] = data.draw(json_values)
    _only_documented_errors(doc)


@given(st.binary(max_size=300) | st.builds(lambda n, c: c * n, st.integers(1, 20000),
                                           st.sampled_from([b"[", b"{\"a\":", b"9", b"\""])))
def test_any_bytes_are_a_manifest_or_a_problem(data: bytes) -> None:
    with _scratch() as d:
        path = manifest_path(d, "x")
        path.write_bytes(data)
        path.chmod(0o600)
        m, problem = manifest_io.read_matching(str(path), FileId(0, 0), owner_uid=os.geteuid())
        assert m is None or problem is None
        if problem is not None:
            assert problem.code.startswith("manifest_")


@given(st.binary(max_size=2000))
def test_nesting_depth_never_recurses(data: bytes) -> None:
    depth = uj.nesting_depth(data)
    assert 0 <= depth <= data.count(b"[") + data.count(b"{")
