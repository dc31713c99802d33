"""Run one function on every alive node of a Ray cluster, one task pinned per node.

The only module that imports ray, and only inside `run_on_every_node`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from vllm_offload_cli.core.base.errors import InvalidInputError, OperationFailedError
from vllm_offload_cli.fleet.result import FAILED, TIMED_OUT, NodeResult, answered

RAY_ADDRESS_ENV = "RAY_ADDRESS"


def _cannot_connect(address: str, why: object) -> OperationFailedError:
    return OperationFailedError(
        f"cannot connect to the Ray cluster at {address!r}: {why}; pass --address or set "
        f"{RAY_ADDRESS_ENV} (e.g. head:6379 or ray://head:10001)", code="ray_connect")


# Ray's exception (by name: older releases lack some) -> the reason code a node gets
_FAILURES = {"NodeDiedError": "node_died", "TaskUnschedulableError": "unschedulable",
             "WorkerCrashedError": "worker_crashed", "TaskCancelledError": "cancelled",
             "RayTaskError": "task_error"}


def _failure(exc: BaseException, ray: Any) -> tuple[str, str]:
    """(reason_code, reason) for a task that did not return."""
    for name, code in _FAILURES.items():
        if isinstance(exc, getattr(ray.exceptions, name, ())):
            first = str(exc).strip().splitlines()
            return code, f"{code.replace('_', ' ')}: {first[-1] if first else type(exc).__name__}"
    return "failed", f"{type(exc).__name__}: {exc}"


def _probe(address: str, timeout: float) -> None:
    """Fail fast on a host:port where nothing listens (ray.init would retry for minutes)."""
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if address == "auto" or not host or not port.isdigit():
        return  # ray resolves these itself, quickly
    try:
        # --timeout 0 (every node late) still gets an answer about the address
        wait = min(timeout, 10.0) if timeout > 0 else 10.0
        socket.create_connection((host.strip("[]"), int(port)), timeout=wait).close()
    except OSError as exc:
        raise _cannot_connect(address, exc.strerror or exc) from None


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Keep stdout for our one document: Ray prints cluster events (a raylet died) there."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _mark_dead(ray: Any, results: list[NodeResult]) -> list[NodeResult]:
    """A node that is gone now died during the run, whatever its task's error says."""
    if not any(r.outcome == FAILED for r in results):
        return results
    alive = {str(n["NodeID"]) for n in ray.nodes() if n.get("Alive")}
    return [replace(r, reason_code="node_died", reason=f"the node died during the run ({r.reason})")
            if r.outcome == FAILED and r.node_id not in alive else r for r in results]


def run_on_every_node(fn: Callable[..., dict[str, Any]], args: tuple[Any, ...], *,
                      address: str | None, timeout: float) -> tuple[str, list[NodeResult]]:
    """Call fn(*args) once on each alive node; (address, one NodeResult per node)."""
    try:
        ray: Any = importlib.import_module("ray")
    except ImportError:
        raise InvalidInputError("fleet commands need Ray, which is not installed; install it "
                                "with: pip install 'vllm-offload[ray]'",
                                code="ray_not_installed") from None
    # Ray's own convention: --address, else $RAY_ADDRESS, else a cluster on this host
    where = address or os.environ.get(RAY_ADDRESS_ENV) or "auto"
    connected_here = not ray.is_initialized()
    with _stdout_to_stderr():
        if connected_here:
            _probe(where, timeout)
            try:
                ray.init(address=where, logging_level="ERROR", log_to_driver=False,
                         configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise _cannot_connect(where, exc) from None
        try:
            nodes = sorted((n for n in ray.nodes() if n.get("Alive")),
                           key=lambda n: (str(n.get("NodeName", "")), str(n["NodeID"])))
            refs = _submit(ray, fn, args, [str(n["NodeID"]) for n in nodes])
            done_at = _wait(ray, list(refs.values()), timeout)
            results = [_result(ray, node, refs[str(node["NodeID"])], done_at, timeout)
                       for node in nodes]
            return where, _mark_dead(ray, results)
        finally:
            if connected_here:
                ray.shutdown()


def _submit(ray: Any, fn: Callable[..., dict[str, Any]], args: tuple[Any, ...],
            node_ids: list[str]) -> dict[str, Any]:
    """One task per node, pinned there (soft=False); node id -> its object ref.

    No CPU asked for: vLLM's workers hold every CPU and GPU, and a task that waits for
    one would never run. No retry: one elsewhere would answer for the wrong node.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(fn)
    return {node_id: remote.options(
        num_cpus=0, max_retries=0, name=f"vllm-offload-fleet-{node_id[:8]}",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(*args) for node_id in node_ids}


def _wait(ray: Any, pending: list[Any], timeout: float) -> dict[Any, float]:
    """Seconds until each ref finished (answer or failure); the late ones are absent."""
    started = time.monotonic()
    done_at: dict[Any, float] = {}
    while pending:
        left = started + timeout - time.monotonic()
        if left <= 0:
            break
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            done_at[ref] = time.monotonic() - started
    return done_at


def _result(ray: Any, node: dict[str, Any], ref: Any, done_at: dict[Any, float],
            timeout: float) -> NodeResult:
    node_id, name = str(node["NodeID"]), str(node.get("NodeName") or "?")
    if ref not in done_at:
        ray.cancel(ref, force=True)
        return NodeResult(node_id=node_id, node_name=name, outcome=TIMED_OUT, reason=(
            f"no answer within {timeout:g} s (--timeout)"), reason_code="timed_out",
            seconds=timeout)
    try:
        doc = ray.get(ref, timeout=0)
    except Exception as exc:  # whatever Ray raised: this node did not answer
        code, reason = _failure(exc, ray)
        return NodeResult(node_id=node_id, node_name=name, outcome=FAILED, reason=reason,
                          reason_code=code, seconds=done_at[ref])
    return answered(node_id, name, doc, done_at[ref])
