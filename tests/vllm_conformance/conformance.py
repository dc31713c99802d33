"""pytest plugin of the vLLM conformance job: proves the substitution, leaves out what
cannot apply to another class.

Loaded with `-p conformance` beside `sitecustomize.py` (.ci/run). A run where vLLM's
name does not refer to our class fails at once instead of passing on vLLM's own code.
"""

from __future__ import annotations

import pytest

# vLLM's tests that cannot judge another class, each with the reason. They patch a
# private module-level function or variable of vLLM's region module (which our class
# never calls), or set a private attribute of vLLM's class. Matched as substrings of
# the test id, so that one list serves every release's tests.
_REGION = "tests/v1/kv_offload/cpu/test_shared_offload_region.py::"
_POPULATE = ("patches vLLM's private pre-fault helpers (_madvise_populate_write, "
             "_fallback_populate_write, _get_populate_write_fn) and counts their calls; our "
             "class pre-faults through its own (core.region.prefault)")
_OS = ("patches os.open/os.close/os.unlink through vLLM's module (process-wide) with fake "
       "descriptors, and vLLM's private check_shm_free_space; our class checks capacity "
       "with core.region.capacity")
LEFT_OUT: dict[str, str] = {
    _REGION + "test_madvise_success_selects_madvise_population": _POPULATE,
    _REGION + "test_populate_shard_prefaults_only_its_share": _POPULATE,
    _REGION + "test_madvise_einval_selects_fallback_for_ranked_region": _POPULATE,
    _REGION + "test_madvise_einval_selects_fallback_for_unranked_region": _POPULATE,
    _REGION + "test_madvise_unexpected_oserror_propagates": _POPULATE,
    _REGION + "test_pin_mmap_region_worker_slot_only_registers_own_slots": _POPULATE,
    _REGION + "test_mp_barrier_unlinks_file_and_survives_sigkill": _POPULATE,
    _REGION + "test_setup_failure_before_barrier_releases_peers[probe": _POPULATE,
    _REGION + "test_setup_failure_before_barrier_releases_peers[population": _POPULATE,
    _REGION + "test_setup_failure_before_barrier_releases_peers[shm": _OS,
    _REGION + "test_barrier_release_failure_keeps_original_error": (
        _OS + "; 0.33's second case patches _get_populate_write_fn"),
    _REGION + "test_insufficient_space_raises_clear_error": _OS,
    _REGION + "test_ftruncate_failure_cleans_up_creator": _OS,
    _REGION + "test_segmented_region_maps_files_back_to_back": (
        "patches vLLM's private _MIN_SEGMENT_BYTES; our class takes min_segment_bytes "
        "(tests/test_region_dropin.py runs the same layout)"),
    _REGION + "test_multiprocess_race_construct_and_write": (
        "four spawned interpreters each import torch and vLLM against a 30 s deadline: on "
        "CI's 2 cores it fails with vLLM's own class too, and then its children wait "
        "forever, hanging pytest at exit (tests/test_region.py races real processes)"),
    _REGION + "test_pin_mmap_region_selects_by_savings_not_row_count": (
        "builds vLLM's class with object.__new__ and sets its private attributes "
        "(_row_stride, _segments, _base) instead of constructing it"),
}


def pytest_sessionstart(session: pytest.Session) -> None:
    from vllm.v1.kv_offload.cpu import shared_offload_region as vllm_region

    from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion

    if vllm_region.SharedOffloadRegion is not SharedOffloadRegion:
        raise pytest.UsageError(
            "vLLM's SharedOffloadRegion is not ours: tests/vllm_conformance must be first "
            "on PYTHONPATH (its sitecustomize substitutes the class)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if not torch.accelerator.is_available():
        # vLLM's tests/conftest.py frees accelerator memory after each test unless marked
        # so; without an accelerator there is nothing to free and the call raises
        needs_device = pytest.mark.skip(reason="VllmConfig() must infer an accelerator")
        for item in items:
            item.add_marker(pytest.mark.skip_global_cleanup)
            if "default_vllm_config" in getattr(item, "fixturenames", ()):
                item.add_marker(needs_device)
    left_out = [item for item in items if any(key in item.nodeid for key in LEFT_OUT)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]
