"""What each command's `--json` `data` holds: the man page's JSON reference.

Rendered into the man page by `tools/gendocs.py`; a test runs the
commands and fails when their `data` carries a key this reference does not
describe. Paths use `[]` for list items (`regions[].holders[]`).
"""

from __future__ import annotations

from vllm_offload_cli.core.base.exit_status import ExitStatus as S

ENVELOPE = (
    'With --json a command prints exactly one JSON document on stdout and nothing else: '
    '{"schema_version": 1, "command": NAME, "ok": BOOL, "exit_code": INT, "data": {...}, '
    '"errors": [{"code", "message"}], "warnings": [{"code", "message"}]}. Diagnostics go to '
    'stderr. Sizes are bytes, times seconds or Unix time, strings raw (JSON escapes control '
    'characters). A usage error still prints the envelope, with "data": {}.'
)

DATA: dict[str, tuple[tuple[str, str], ...]] = {
    "create": (
        ("engine_id", "the final engine_id (with _dpN under --dp-rank)"),
        ("path, paths", "the region's first file and every segment file"),
        ("manifest", "the sidecar manifest's path"),
        ("size_bytes", "bytes of the region (whole rows)"),
        ("geometry", "{num_blocks, row_stride, cpu_page_size, world_size}"),
        ("populated, populate_seconds, populate_gbps, populate_threads",
         "whether it was pre-faulted, and how fast (null with --no-populate)"),
        ("persistent, held", "kept for an engine to join, or held until a signal"),
        ("placement", "NUMA policy and nodes, huge-page mode, whether advised, bytes mapped "
         "with huge pages"),
        ("released_by, removed", "with --hold: the signal that ended it (SIGINT: exit "
         f"{S.INTERRUPTED:d}), whether it is gone"),
        ("owner", "with --owner or --mode: {uid, gid, mode} the files were given"),
        ("vllm_layout", "{name: segmented or single-file, basis: vllm (read from the vLLM "
         "installed here), newest (none installed) or requested, vllm_version}"),
    ),
    "inspect": (
        ("shm_dir", "the directory listed"),
        ("regions[]", "one per region, named or only mapped (deleted), segments grouped: "
         "yours all, of every other owner the first 32 (all with --all)"),
        ("aggregated[]", "{uid, regions, size_bytes, allocated_bytes, resident_bytes, "
         "states {STATE: n}, problems {code: n}, holders}: per other owner, its regions past "
         "the first 32, summed (empty with --all)"),
        ("regions[].engine_id, base_engine_id, dp_rank, kind",
         "identity; dp_rank null without a _dpN suffix"),
        ("regions[].paths, linked", "its files; false when only a deleted mapping is left"),
        ("regions[].size_bytes, resident_bytes", "file bytes; bytes in memory (null with "
         "--no-residency)"),
        ("regions[].uid, mode", "owner and permission bits of the first file"),
        ("regions[].age_seconds", "since creation or the last change of its files"),
        ("regions[].geometry, manifest", "from the manifest, or null"),
        ("regions[].holders[]", "{pid, name, rank, via}: via lists map, fd and lock"),
        ("regions[].state", "live, creating, persistent, unknown or stale"),
        ("regions[].persistent", "pre-provisioned by create"),
        ("regions[].problems[]", "{code, message}"),
        ("regions[].vllm_layout", "segmented (only vLLM 0.33's CPU spec joins it), "
         "single-file, or null where a released name's bare file cannot tell"),
        ("regions[].numa_nodes, huge_page_bytes, placement",
         "resident bytes per NUMA node, huge-page bytes, how they were observed (null with "
         "--no-residency)"),
        ("measurement_errors", "{residency|numa: {regions, message}}: measurements a refused "
         "system call (a seccomp filter) left unmade; also a warning, and the metric "
         "vllm_offload_measurement_errors"),
        ("regions[].evidence", "{creator_pid, creator_alive, recorded_holders[] {pid, rank, "
         "alive}, last_activity_at, summary}: why it is in its state (null fields without a "
         "manifest)"),
        ("gc_would_free_bytes", "tmpfs memory of the stale regions shown (st_blocks, as gc "
         "counts what it frees)"),
        ("check", f"with --check: {{flagged: engine_ids stale or with a problem}} (exit "
         f"{S.PROBLEMS_FOUND:d} when any, or when an aggregated[] entry counts one)"),
        ("unsafe_entries[]", "{engine_id, paths, problems}: names like a region's that are "
         "no regular file (a symlink, a FIFO): not regions, never stale, left by gc; --check "
         "flags them"),
        ("orphan_manifests[]", "manifests whose region is gone"),
        ("shm", "{total_bytes, free_bytes} of the shm filesystem"),
        ("uninspectable_processes", "processes whose /proc entries could not be read"),
        ("visibility", "blind spots that may hide a holder, and the processes hidden"),
        ("not_found", f"engine_ids asked for that match no region (exit {S.USAGE:d})"),
        ("not_judged[], others_counted[]", "{uid, files, size_bytes, allocated_bytes}: "
         "region-named files of other users counted per owner, not looked at one by one "
         "(past the largest 4,096 judged, or the first 256 listed from lstat)"),
        ("held_unlisted[]", "{pid, files}: files on the shm filesystem a process holds past "
         "256 per process, or unlinked region files of another owner past its 4,096, "
         "counted, not looked up"),
        ("output", "with --output: the textfile written"),
    ),
    "verify-rank-layout": (
        ("mode", "plan or live"),
        ("ok, problems[]", "false with {code, message, ...} for each problem (exit "
         f"{S.PROBLEMS_FOUND:d})"),
        ("world_size, dp_size, rank_source, devices, devices_spec, dp_suffix, "
         "unused_devices, replicas[]", "plan: the inputs and every replica's engine_id and "
         "workers {worker, device, slot, problems}"),
        ("engine_id, path, manifest, size_bytes, geometry, geometry_source, rank_source",
         "live: the region checked and where its geometry came from"),
        ("workers[], rankless_openers, stale_attachments", "live: attached workers"),
        ("slots[]", "live: {slot, start, end, workers, pages, resident_pages, shared_pages, "
         "shared_resident_pages, populated_fraction, status}"),
        ("joined", "live: whether any worker attached (null without a manifest); until one "
         "does, populated_fraction says nothing"),
        ("notes[], numa[]", "live: remarks, and each worker's NUMA placement"),
    ),
    "garbage-collect": (
        ("shm_dir, dry_run, min_age_seconds, include_persistent, all_users", "the run's "
         "options"),
        ("removed[]", "{engine_id, paths, bytes, ...}: removed (would be, with --dry-run)"),
        ("kept[]", "{engine_id, code, reason, uid, ...}: kept, and why: yours all, of every "
         "other owner the first 32"),
        ("kept_aggregated[]", "{uid, regions, codes {code: n}}: per other owner, its kept "
         "regions past the first 32, summed"),
        ("freed_bytes", "tmpfs memory given back"),
        ("orphan_manifests_removed[], temp_files_removed[]", "paths removed"),
        ("vanished[], not_found[], failures[]", "gone meanwhile; named but absent; removals "
         "that failed"),
        ("regions_seen, uninspectable_processes, visibility", "what the run could see"),
        ("not_judged[], not_judged_files, listed_all", "{uid, files, size_bytes, "
         "allocated_bytes} per owner: region files this run could have removed but did not "
         "judge within --timeout (or past the largest 4,096 of other users'); listed_all is "
         "false when time ran out before the directory was listed; either makes the run "
         f"exit {S.PARTIAL:d}"),
        ("others_counted[]", "{uid, files, size_bytes, allocated_bytes}: files of owners "
         "this run may not remove, counted per owner past the first 256 (listed in kept[])"),
        ("syslog", "{socket, sent, dropped, problem}: the system log's record (one line per "
         "removal, one per run)"),
        ("started_at, duration_seconds", "when it ran and for how long"),
        ("prometheus", "with --prometheus: the textfile written"),
    ),
    "preflight": (
        ("engine_id, dp_size, size_bytes", "what was asked"),
        ("needed_bytes, free_bytes", "room needed for the regions to create, and free"),
        ("dry_run", "nothing was reclaimed"),
        ("replicas[]", "{engine_id, path, action, state_seen, engine_holders, reclaimed_paths, "
         "reclaimed_bytes, needed_bytes, free_bytes, notes, reclaimed_for_room}"),
        ("reclaimed_for_room[]", "{engine_id, paths, bytes, freed_bytes, manifest, age_seconds, "
         "uid, reason, hidden_pids}: stale leftovers of other engine_ids removed (dry run: to "
         "be removed) so the regions fit"),
    ),
    "benchmark": (
        ("rows[]", "{block_bytes, pattern, mode, blocks_per_transfer, transfer_bytes, store, "
         "load, verified}; store and load carry GB/s and the ratio to memcpy"),
        ("patterns, huge_pages", "the patterns measured; the huge-page run, or null"),
    ),
    "fleet": (
        ("nodes[]", '{node_id, label, status (ok, error, refused, absent, failed, timed_out), '
         'exit_code, reason, data, errors, warnings}: each node\'s own envelope'),
        ("partial", "true when a node did not answer or its command was interrupted there"),
    ),
}
