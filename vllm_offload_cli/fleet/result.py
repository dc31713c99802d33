"""Per-node answers merged into one fleet answer and one exit code.

A node that failed or did not answer in time is never hidden behind the others:
it is listed with why, and the answer is partial unless a node said something more
important (`exit_status.PRECEDENCE`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vllm_offload_cli.core.base.errors import RegionNotFoundError
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

NOT_FOUND = RegionNotFoundError.code


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
        code = self.exit_code
        if code == ExitStatus.SUCCESS:
            return OK
        if code == ExitStatus.UNSAFE:
            return REFUSED
        errors = self._errors()
        if code == ExitStatus.USAGE and errors and all(e.get("code") == NOT_FOUND
                                                       for e in errors):
            return ABSENT
        return ERROR

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
        """What this node adds to the fleet's exit status: PARTIAL when it did not answer
        or was interrupted there. A node that lacks named regions counts as not asked for
        them (FleetResult judges regions no node has), so any other error it reported (a
        failed removal) counts as FAILED."""
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
    """Why another host's answer is not an envelope the merge, the table and `--json` can
    take (JSON-clean, the envelope's shape); None when it is."""
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
    why = malformed(doc)
    if why is not None:
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
            lacks = n.not_found()
            if lacks is None:
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
