"""Plan mode: which slot every worker of every replica would write, before launch."""

from __future__ import annotations

import pytest

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.layout.plan import (
    MAX_WORKERS,
    LayoutPlan,
    WorkerRef,
    engine_id_suffix,
    parse_devices,
    plan_layout,
)
from vllm_offload_cli.core.region.ranks import DEVICE_INDEX, DEVICE_MODULO, LOGICAL


def _slots(plan: LayoutPlan) -> list[list[int]]:
    return [[w.slot for w in r.workers] for r in plan.replicas]


def _codes(plan: LayoutPlan) -> list[str]:
    return [p.code for p in plan.problems]


@pytest.mark.parametrize(("world", "dp"), [(1, 1), (2, 1), (8, 1), (1, 4), (2, 2), (4, 2),
                                           (2, 4), (3, 3), (8, 8)])
@pytest.mark.parametrize("source", [DEVICE_MODULO, LOGICAL])
def test_contiguous_layouts_pass(world: int, dp: int, source: object) -> None:
    plan = plan_layout(world, source, dp_size=dp)  # type: ignore[arg-type]
    assert plan.ok, plan.problems
    assert _slots(plan) == [list(range(world))] * dp
    devices = [w.device.index for r in plan.replicas for w in r.workers]
    assert devices == list(range(world * dp))
    ids = [r.engine_id for r in plan.replicas]
    assert ids == (["<engine_id>"] if dp == 1 else [f"<engine_id>_dp{k}" for k in range(dp)])
    assert all(w.problems == () for r in plan.replicas for w in r.workers)


def test_non_contiguous_devices_collide_under_device_modulo_naming_the_workers() -> None:
    plan = plan_layout(2, DEVICE_MODULO, devices=parse_devices("0,2;1,3"))
    assert plan.dp_size == 2  # inferred from the groups
    assert _slots(plan) == [[0, 0], [1, 1]]
    assert _codes(plan) == ["slot_collision", "slot_collision"]
    first, second = plan.problems
    assert first.workers == (WorkerRef(0, 0), WorkerRef(0, 1))
    assert (first.slot, first.engine_id) == (0, "<engine_id>_dp0")
    assert first.message.startswith("replica 0 workers 0 and 1 both -> slot 0 of "
                                    "<engine_id>_dp0 (device-modulo: device 0 -> 0, "
                                    "device 2 -> 0)")
    assert second.workers == (WorkerRef(1, 0), WorkerRef(1, 1))
    assert second.slot == 1
    assert [w.problems for r in plan.replicas for w in r.workers] == [("slot_collision",)] * 4


def test_logical_rank_passes_where_device_modulo_fails() -> None:
    for spec in ("0,2;1,3", "per-process", "5,7,1;0,2,4"):
        devices = parse_devices(spec)
        dp = 2 if spec == "per-process" else None
        world = 3 if spec.count(",") == 4 else 2
        assert not plan_layout(world, DEVICE_MODULO, dp_size=dp, devices=devices).ok, spec
        plan = plan_layout(world, LOGICAL, dp_size=dp, devices=devices)
        assert plan.ok, (spec, plan.problems)
        assert _slots(plan) == [list(range(world))] * plan.dp_size


def test_one_device_per_process_collides_every_worker_of_each_replica() -> None:
    plan = plan_layout(3, DEVICE_MODULO, dp_size=2, devices=parse_devices("per-process"))
    assert _slots(plan) == [[0, 0, 0], [0, 0, 0]]
    assert [(p.code, p.workers) for p in plan.problems] == [
        ("slot_collision", (WorkerRef(0, 0), WorkerRef(0, 1), WorkerRef(0, 2))),
        ("slot_collision", (WorkerRef(1, 0), WorkerRef(1, 1), WorkerRef(1, 2))),
    ]
    assert plan.problems[0].message.startswith(
        "replica 0 workers 0, 1 and 2 all -> slot 0 of <engine_id>_dp0 (device-modulo: "
        "device 0 -> 0 for each)")
    # every process sees index 0 of its own GPU: not a shared device
    assert "device_shared" not in _codes(plan)


def test_one_worker_per_process_and_replica_is_sound_even_with_device_modulo() -> None:
    assert plan_layout(1, DEVICE_MODULO, dp_size=4, devices=parse_devices("per-process")).ok


def test_device_modulo_needs_distinct_residues_not_contiguity() -> None:
    """'1,2' is not k*W..k*W+W-1 but folds to slots 1 and 0: sound."""
    plan = plan_layout(2, DEVICE_MODULO, devices=parse_devices("1,2;3,0"))
    assert plan.ok, plan.problems
    assert _slots(plan) == [[1, 0], [1, 0]]


def test_raw_device_index_is_out_of_range_past_the_first_replica() -> None:
    plan = plan_layout(2, DEVICE_INDEX, dp_size=2)
    assert _slots(plan) == [[0, 1], [2, 3]]
    assert [(p.code, p.workers, p.slot) for p in plan.problems] == [
        ("slot_out_of_range", (WorkerRef(1, 0),), 2),
        ("slot_out_of_range", (WorkerRef(1, 1),), 3),
    ]
    assert plan.problems[0].message.startswith(
        "replica 1 worker 0 -> slot 2, outside [0, 2) (device-index: device 2 -> 2)")


def test_missing_dp_suffix_makes_replicas_share_one_region() -> None:
    plan = plan_layout(2, LOGICAL, dp_size=2, dp_suffix=False)
    assert [r.engine_id for r in plan.replicas] == ["<engine_id>", "<engine_id>"]
    collision = plan.problems[0]
    assert (collision.code, collision.replicas) == ("engine_id_collision", (0, 1))
    assert "replicas 0 and 1 would all use engine_id <engine_id>" in collision.message
    shared = [(p.workers, p.slot) for p in plan.problems if p.code == "slot_collision"]
    assert shared == [((WorkerRef(0, 0), WorkerRef(1, 0)), 0),
                      ((WorkerRef(0, 1), WorkerRef(1, 1)), 1)]
    assert plan.problems[1].message.startswith(
        "replica 0 worker 0 and replica 1 worker 0 both -> slot 0 of <engine_id>")


def test_without_dp_one_replica_needs_no_suffix() -> None:
    assert plan_layout(2, LOGICAL, dp_size=1, dp_suffix=False).ok
    assert engine_id_suffix(0, 1) == ""
    assert engine_id_suffix(3, 4) == "_dp3"
    assert engine_id_suffix(3, 4, dp_suffix=False) == ""


def test_two_workers_on_one_device_are_reported_whatever_the_rank_source() -> None:
    plan = plan_layout(2, LOGICAL, devices=parse_devices("0,1;1,2"))
    assert [(p.code, p.workers, p.device) for p in plan.problems] == [
        ("device_shared", (WorkerRef(0, 1), WorkerRef(1, 0)), "1")]


def test_environment_layout_uses_positions_not_physical_ids() -> None:
    layout = parse_devices("env", environ={"CUDA_VISIBLE_DEVICES": "3, 1,GPU-8f2a-77,0,5"})
    plan = plan_layout(2, DEVICE_MODULO, dp_size=2, devices=layout)
    assert plan.ok, plan.problems
    workers = [w for r in plan.replicas for w in r.workers]
    assert [(w.device.index, w.device.label, w.slot) for w in workers] == [
        (0, "3", 0), (1, "1", 1), (2, "GPU-8f2a-77", 0), (3, "0", 1)]
    assert plan.unused_devices == ("5",)


def test_environment_layout_flags_a_device_listed_twice() -> None:
    layout = parse_devices("env", environ={"CUDA_VISIBLE_DEVICES": "0,1,1,2"})
    plan = plan_layout(2, DEVICE_MODULO, dp_size=2, devices=layout)
    assert [(p.code, p.workers) for p in plan.problems] == [
        ("device_shared", (WorkerRef(0, 1), WorkerRef(1, 0)))]


@pytest.mark.parametrize(("environ", "needle"), [
    ({}, "is not set"),
    ({"CUDA_VISIBLE_DEVICES": ""}, "is empty"),
    ({"CUDA_VISIBLE_DEVICES": "0,-1"}, "'-1'"),
    ({"CUDA_VISIBLE_DEVICES": "0,,1"}, "''"),
])
def test_environment_layout_refuses_what_cuda_would_not_use(environ: dict[str, str],
                                                            needle: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        parse_devices("env", environ=environ)
    assert needle in str(err.value)


def test_environment_layout_needs_a_device_per_worker() -> None:
    layout = parse_devices("env", environ={"CUDA_VISIBLE_DEVICES": "0,1,2"})
    with pytest.raises(InvalidInputError, match=r"lists 3 device.*need 4"):
        plan_layout(2, DEVICE_MODULO, dp_size=2, devices=layout)


@pytest.mark.parametrize("spec", ["", " ", "0,,1", "0;", ";0", "a", "0,-1", "0.5", "0,1;2,x",
                                  "٣"])
def test_malformed_device_lists_are_refused(spec: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        parse_devices(spec)
    assert err.value.code == "invalid_devices"


def test_device_groups_must_match_the_world_and_dp_sizes() -> None:
    with pytest.raises(InvalidInputError, match="replica 1 has 1 device"):
        plan_layout(2, LOGICAL, devices=parse_devices("0,1;2"))
    with pytest.raises(InvalidInputError, match=r"gives 2 replica group.*--dp-size is 3"):
        plan_layout(2, LOGICAL, dp_size=3, devices=parse_devices("0,1;2,3"))


@pytest.mark.parametrize(("world", "dp"), [(0, 1), (-2, 1), (2, 0), (2, -1)])
def test_sizes_must_be_positive(world: int, dp: int) -> None:
    with pytest.raises(InvalidInputError, match="greater than 0"):
        plan_layout(world, LOGICAL, dp_size=dp)


def test_absurd_plans_are_refused() -> None:
    with pytest.raises(InvalidInputError, match=str(MAX_WORKERS)):
        plan_layout(MAX_WORKERS, LOGICAL, dp_size=2)


def test_plan_serialises_the_full_mapping() -> None:
    doc = plan_layout(2, DEVICE_MODULO, devices=parse_devices("0,2;1,3")).to_dict()
    assert doc["rank_source"] == "device-modulo"
    assert doc["devices"] == "explicit"
    assert doc["replicas"][0] == {
        "replica": 0, "engine_id": "<engine_id>_dp0", "engine_id_suffix": "_dp0",
        "workers": [
            {"worker": 0, "rank": 0, "device_index": 0, "device": "0", "slot": 0,
             "status": "slot_collision"},
            {"worker": 1, "rank": 1, "device_index": 2, "device": "2", "slot": 0,
             "status": "slot_collision"},
        ],
    }
