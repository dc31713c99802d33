"""Run a node-local command on every node of a Ray cluster (one task pinned per node; Ray
imported only in `run_on_every_node`) and merge the answers into one answer and exit code.
A node that failed or did not answer is listed with why, never hidden: the answer is partial
unless a node said something more important (`exit_status.PRECEDENCE`)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from vllm_offload_cli.core.base import errors
from vllm_offload_cli.core.base.exit_status import ExitStatus, as_status, most_important
from vllm_offload_cli.core.base.units import is_int

ANSWERED = "answered"
FAILED = "failed"
TIMED_OUT = "timed_out"

# Node status as the merged answer reports it.
OK = "ok"
ERROR = "error"  # answered with a non-zero exit code (problems, a failed removal, ...)
REFUSED = "refused"  # answered with exit 6: refused as unsafe (e.g. cannot see all processes)
ABSENT = "absent"  # only "not found" errors: the named region(s) live on other nodes

NOT_FOUND = errors.RegionNotFoundError.code


@dataclass(frozen=True, kw_only=True)
class NodeResult:
    """What one node answered, or why it did not."""

    node_id: str
    node_name: str  # the address Ray reports for the node
    outcome: str  # ANSWERED, FAILED or TIMED_OUT
    envelope: dict[str, Any] | None = None  # the node-local command's --json envelope
    reason: str = ""  # FAILED / TIMED_OUT: what happened
    reason_code: str = ""  # e.g. node_died, worker_crashed, unschedulable, timed_out
    seconds: float = 0.0

    @property
    def exit_code(self) -> int | None:
        code = (self.envelope or {}).get("exit_code")
        return code if isinstance(code, int) else None

    @property
    def status(self) -> str:
        if self.outcome != ANSWERED or self.envelope is None:
            return self.outcome
        code, said = self.exit_code, self._errors()
        if code == ExitStatus.USAGE and said and all(e.get("code") == NOT_FOUND for e in said):
            return ABSENT
        return OK if code == ExitStatus.SUCCESS else REFUSED if code == ExitStatus.UNSAFE else ERROR

    @property
    def interrupted(self) -> bool:
        """The node's command was interrupted there: its answer is incomplete."""
        return self.exit_code == ExitStatus.INTERRUPTED

    def _errors(self) -> list[dict[str, Any]]:
        return [e for e in (self.envelope or {}).get("errors") or [] if isinstance(e, dict)]

    def not_found(self) -> frozenset[str] | None:
        """The named engine_ids this node lacks: empty when it said nothing of the kind,
        None for "all of them" (an answer that was only "not found", without a list)."""
        if not any(e.get("code") == NOT_FOUND for e in self._errors()):
            return frozenset()
        listed = ((self.envelope or {}).get("data") or {}).get("not_found")
        return frozenset(map(str, listed)) if isinstance(listed, list) else None

    def merge_status(self) -> ExitStatus:
        """This node's part of the fleet's status: PARTIAL when it did not answer or was
        interrupted. Lacking named regions counts as not asked for them (FleetResult judges
        regions no node has); any other error it reported (a failed removal) is FAILED."""
        if self.outcome != ANSWERED or self.interrupted:
            return ExitStatus.PARTIAL
        status = as_status(self.exit_code)
        if status != ExitStatus.USAGE or self.not_found() == frozenset():
            return status
        others = [e for e in self._errors() if e.get("code") != NOT_FOUND]
        return ExitStatus.FAILED if others else ExitStatus.SUCCESS


# entries of a node's data that are records: each must be a JSON object
_RECORD_LISTS = ("regions", "removed", "kept", "problems", "failures")


def malformed(doc: object) -> str | None:
    """Why another host's answer is no JSON-clean envelope we can merge and show, or None."""
    try:
        json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return f"not plain JSON ({exc})"
    if not isinstance(doc, dict):
        return f"a {type(doc).__name__}, not a JSON object"
    if not is_int(doc.get("exit_code")):
        return "no integer exit_code"
    if not isinstance(doc.get("data"), dict):
        return "no data object"
    lists = [(key, doc.get(key) or []) for key in ("errors", "warnings")]
    lists += [(f"data.{key}", doc["data"][key]) for key in _RECORD_LISTS
              if doc["data"].get(key) is not None]
    return next((f"{key} is not a list of objects" for key, entries in lists
                 if not isinstance(entries, list) or not all(isinstance(e, dict)
                                                             for e in entries)), None)


def answered(node_id: str, node_name: str, doc: object, seconds: float) -> NodeResult:
    """A node's answer, or a failed node when the answer cannot be read (and says why)."""
    if (why := malformed(doc)) is not None:
        return NodeResult(node_id=node_id, node_name=node_name, outcome=FAILED,
                          reason=f"malformed answer: {why}", reason_code="malformed_answer",
                          seconds=seconds)
    assert isinstance(doc, dict)
    return NodeResult(node_id=node_id, node_name=node_name, outcome=ANSWERED, envelope=doc,
                      seconds=seconds)


@dataclass(frozen=True, kw_only=True)
class FleetResult:
    address: str
    nodes: tuple[NodeResult, ...]
    timeout: float

    @property
    def missing(self) -> list[NodeResult]:
        """Nodes that did not answer: the answer is partial without them."""
        return [n for n in self.nodes if n.outcome != ANSWERED]

    @property
    def exit_code(self) -> ExitStatus:
        """The most important node status by `exit_status.PRECEDENCE` (not the largest
        number); USAGE when a named region is on no node (and every node answered)."""
        if not self.nodes:
            return ExitStatus.FAILED
        nowhere = [] if self.on_no_node() is None else [ExitStatus.USAGE]
        return most_important([n.merge_status() for n in self.nodes] + nowhere)

    def on_no_node(self) -> list[str] | None:
        """Named engine_ids that every node lacks (every node answered); None when there is
        none, [] when the nodes said "not found" without naming what."""
        if not self.nodes or self.missing:  # a node that did not answer may have it
            return None
        everywhere: frozenset[str] | None = None  # None: whatever was named
        for n in self.nodes:
            if (lacks := n.not_found()) is None:
                continue
            everywhere = lacks if everywhere is None else everywhere & lacks
            if not everywhere:
                return None
        return sorted(everywhere or ())

    def label(self, node: NodeResult) -> str:
        """The node's name, with its id when several nodes share one (one host, many nodes)."""
        same = sum(n.node_name == node.node_name for n in self.nodes)
        return node.node_name if same == 1 else f"{node.node_name}/{node.node_id[:8]}"

    def _said(self, key: str, nodes: list[NodeResult]) -> list[dict[str, str]]:
        """The `key` entries (errors or warnings) of these nodes' envelopes, naming the node."""
        return [{"code": str(e.get("code", key[:-1])),
                 "message": f"node {self.label(n)}: {e.get('message', '')}",
                 "node_id": n.node_id} for n in nodes for e in (n.envelope or {}).get(key) or []]

    def errors(self) -> list[dict[str, str]]:
        """A named region on no node, each missing node, then each node's own errors."""
        nowhere = self.on_no_node()
        out = [] if nowhere is None else [{"code": NOT_FOUND, "message": no_node_has(nowhere)}]
        for n in self.nodes:
            if n.outcome != ANSWERED:
                out.append({"code": f"node_{n.outcome}", "message":
                            f"node {self.label(n)}: {n.reason}", "node_id": n.node_id})
            elif n.status not in (OK, ABSENT):
                out += self._said("errors", [n])
        return out

    def warnings(self, version: str) -> list[dict[str, str]]:
        """Each node's warnings, naming the node; a node running another version first."""
        out = []
        for n in self.nodes:
            theirs = ((n.envelope or {}).get("node") or {}).get("version")
            if theirs is not None and theirs != version:
                out.append({"code": "version_mismatch", "node_id": n.node_id, "message":
                            f"node {self.label(n)} runs vllm-offload {theirs}, this host "
                            f"{version}; install the same version on every node"})
        return out + self._said("warnings", list(self.nodes))

    def data(self) -> dict[str, Any]:
        nodes = []
        for n in self.nodes:
            env = n.envelope or {}
            nodes.append({
                "node_id": n.node_id, "node_name": n.node_name, "label": self.label(n),
                "status": n.status, "exit_code": n.exit_code,
                "reason": n.reason or None, "reason_code": n.reason_code or None,
                "seconds": round(n.seconds, 3),
                "host": env.get("node"),  # hostname, pid, version, shm_dir of the answer
                "data": env.get("data"), "errors": env.get("errors", []),
                "warnings": env.get("warnings", []),
            })
        return {
            "address": self.address,
            "timeout_seconds": self.timeout,
            # a node did not answer, or was interrupted: the answer lacks part of the fleet
            "partial": any(n.outcome != ANSWERED or n.interrupted for n in self.nodes),
            "nodes_total": len(self.nodes),
            "nodes_answered": len(self.nodes) - len(self.missing),
            "nodes": nodes,
        }


def no_node_has(engine_ids: list[str]) -> str:
    """The message for named regions on no node ([]: the nodes did not say which)."""
    named = f"a region named {', '.join(engine_ids)}" if engine_ids else "the named region(s)"
    return f"no node has {named}"


RAY_ADDRESS_ENV = "RAY_ADDRESS"


def _cannot_connect(address: str, why: object) -> errors.OperationFailedError:
    return errors.OperationFailedError(
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
    host, _, port = address.removeprefix("ray://").rpartition(":")
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
        raise errors.InvalidInputError(
            "fleet commands need Ray, which is not installed; install it with: pip install "
            "'vllm-offload[ray]'", code="ray_not_installed") from None
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
    """One task per node, pinned there (soft=False); node id -> its object ref. No CPU asked
    for: vLLM's workers hold every CPU and GPU, and a task waiting for one would never run.
    No retry: one elsewhere would answer for the wrong node."""
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
    while pending and (left := started + timeout - time.monotonic()) > 0:
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
