"""Per-node answers merged into one fleet answer and one exit code.

Each node runs the node-local command and answers with its own JSON envelope;
a node can also fail to answer (its node died, its worker crashed, the task
could not be placed) or not answer in time. The merge never hides a missing
node behind the others' results: it is listed with why, and the exit code says
the answer is partial.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_UNSAFE = 6
# A node failed or timed out: the answer covers only the other nodes.
EXIT_PARTIAL = 7

ANSWERED = "answered"
FAILED = "failed"
TIMED_OUT = "timed_out"

# Node status as the merged answer reports it.
OK = "ok"
ERROR = "error"  # answered with a non-zero exit code (problems, a failed removal, ...)
REFUSED = "refused"  # answered with exit 6: refused as unsafe (e.g. cannot see all processes)
ABSENT = "absent"  # the named region(s) live on other nodes

NOT_FOUND = "not_found"


@dataclass(frozen=True)
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
        if self.envelope is None:
            return None
        code = self.envelope.get("exit_code")
        return code if isinstance(code, int) else None

    @property
    def status(self) -> str:
        if self.outcome != ANSWERED or self.envelope is None:
            return self.outcome
        code = self.exit_code
        if code == EXIT_OK:
            return OK
        if code == EXIT_UNSAFE:
            return REFUSED
        errors = self.envelope.get("errors") or []
        if code == EXIT_USAGE and errors and all(e.get("code") == NOT_FOUND for e in errors):
            return ABSENT
        return ERROR


@dataclass(frozen=True)
class FleetResult:
    command: str
    address: str
    nodes: tuple[NodeResult, ...]
    timeout: float

    @property
    def missing(self) -> list[NodeResult]:
        """Nodes that did not answer: the answer is partial without them."""
        return [n for n in self.nodes if n.outcome != ANSWERED]

    @property
    def exit_code(self) -> int:
        """The highest node exit code; a node that did not answer counts as EXIT_PARTIAL.

        A node where the named regions are not (exit 2, only `not_found`) counts
        as 0, unless no node has them.
        """
        if not self.nodes:
            return 1
        codes = []
        for n in self.nodes:
            if n.outcome != ANSWERED:
                codes.append(EXIT_PARTIAL)
            elif n.status != ABSENT:
                codes.append(n.exit_code if n.exit_code is not None else 1)
        if not codes:  # every node said "not here"
            return EXIT_USAGE
        return max(codes)

    def label(self, node: NodeResult) -> str:
        """The node's name, with its id when several nodes share one (one host, many nodes)."""
        same = sum(n.node_name == node.node_name for n in self.nodes)
        return node.node_name if same == 1 else f"{node.node_name}/{node.node_id[:8]}"

    def errors(self) -> list[dict[str, str]]:
        """Fleet errors: each missing node, then each node's own errors, naming the node."""
        out = []
        for n in self.nodes:
            if n.outcome != ANSWERED:
                out.append({"code": f"node_{n.outcome}", "message":
                            f"node {self.label(n)}: {n.reason}", "node_id": n.node_id})
            elif n.status not in (OK, ABSENT) and n.envelope is not None:
                for e in n.envelope.get("errors") or []:
                    out.append({"code": str(e.get("code", "error")),
                                "message": f"node {self.label(n)}: {e.get('message', '')}",
                                "node_id": n.node_id})
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
        for n in self.nodes:
            for w in (n.envelope or {}).get("warnings") or []:
                out.append({"code": str(w.get("code", "warning")),
                            "message": f"node {self.label(n)}: {w.get('message', '')}",
                            "node_id": n.node_id})
        return out

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
        missing = self.missing
        return {
            "address": self.address,
            "timeout_seconds": self.timeout,
            "partial": bool(missing),
            "nodes_total": len(self.nodes),
            "nodes_answered": len(self.nodes) - len(missing),
            "nodes": nodes,
        }

