"""How the vLLM in use makes its region, read from its code: never from its version.

vLLM 0.31, 0.32 and 0.33 name the region alike and lay out its rows alike, but
make it differently: how many files (0.33's CPU spec splits a region into
segment files), which slot each worker takes (0.31 folds the device index,
later releases use the logical rank), and whether the creator unlinks the
names after a barrier. The hook must make exactly the files vLLM then joins and
give each worker the slot vLLM will use, so it reads those facts from vLLM's
own sources with `ast`. Nothing of vLLM is imported, so `create` can ask too.

What is read, and what makes a release one this module does not understand
(`UnsupportedVllm`, so the hook stands aside instead of guessing):

* the region class's constructor: vLLM's five positional parameters, and
  only keyword parameters this module knows (an unknown one may change what
  lands on disk);
* each place a spec builds that class (the CPU spec's worker, the tiering
  spec's worker and scheduler): exactly one call, `num_segments=` a module
  constant or a number, `barrier=` given or not;
* how that call's rank is computed: `current_device_index()` (device-modulo)
  or the config's `parallel.rank` (logical); anything else is not understood;
* the constants (files asked for, smallest file): the value in vLLM's module
  where it is loaded in this process (what vLLM will use), else the source's.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_offload_cli.core.region.segments import effective_segments, layout_of

logger = logging.getLogger(__name__)

REGION_MODULE = "vllm.v1.kv_offload.cpu.shared_offload_region"
CPU_SPEC_MODULE = "vllm.v1.kv_offload.cpu.spec"
TIERING_SPEC_MODULE = "vllm.v1.kv_offload.tiering.spec"
REGION_CLASS = "SharedOffloadRegion"

# vLLM's positional parameters (the core's SharedOffloadRegion takes the same),
# then every keyword parameter some release in the support matrix takes.
POSITIONAL = ("engine_id", "num_chunks", "rank", "kv_bytes_per_chunk", "cpu_page_size")
KNOWN_KEYWORDS = frozenset({
    "barrier",  # all: the creator unlinks the names once every worker passed it
    "creator_memory_check",  # all: a callable run before sizing (memory, not layout)
    "populate_only_on_creator",  # 0.31, 0.32: who pre-faults (memory, not layout)
    "populate_shard",  # 0.33: who pre-faults (memory, not layout)
    "num_segments",  # 0.33: segment files `.mmap.N`
})
# What the hardened specs read of vLLM's specs besides the region call.
_CPU_SPEC_ATTRIBUTES = ("num_chunks", "kv_bytes_per_chunk", "cpu_page_size_per_worker",
                        "replicated_layout", "_manager")
_CPU_SPEC_METHODS = ("create_worker", "get_manager", "_uses_shared_region")
_MAX_SOURCE_BYTES = 4 << 20  # a module of vLLM is far smaller; bounds a hostile tree

LOGICAL, DEVICE_MODULO = "logical", "device-modulo"  # core.region.ranks' names


class UnsupportedVllm(Exception):  # noqa: N818 - a verdict about vLLM, reported in one line
    """The vLLM found makes its region in a way this version does not understand."""


@dataclass(frozen=True)
class RegionCall:
    """One place a vLLM spec builds its region, as that code reads."""

    segments: int  # files asked for (1: the call passes no num_segments)
    rank_source: str | None  # LOGICAL or DEVICE_MODULO; None for the rank-less scheduler
    barrier: bool  # vLLM's creator unlinks the names once every worker mapped them


@dataclass(frozen=True, kw_only=True)
class VllmRules:
    """What one vLLM installation does with its region, and where it was read."""

    root: str  # the directory holding `vllm/`
    version: str | None  # for messages only: nothing is decided by it
    min_segment_bytes: int  # vLLM makes no segment file smaller than this
    cpu_worker: RegionCall
    tiering_worker: RegionCall
    tiering_scheduler: RegionCall

    def files(self, call: RegionCall, size_bytes: int) -> int:
        """How many files vLLM asks for at `call` for a region of `size_bytes` (its rule)."""
        return effective_segments(call.segments, size_bytes, min_bytes=self.min_segment_bytes)

    @property
    def cpu_layout(self) -> str:
        """SEGMENTED where the CPU spec splits regions, else SINGLE_FILE."""
        return layout_of(self.cpu_worker.segments)

    @property
    def name(self) -> str:
        return f"vLLM {self.version or '(version unknown)'} at {self.root}"

    def summary(self) -> str:
        """One line: the facts read, as the README's support matrix states them."""
        cpu = self.cpu_worker
        files = (f"segment files (up to {cpu.segments}, none under "
                 f"{self.min_segment_bytes} bytes)" if cpu.segments > 1 else "one file")
        return (f"{self.name}: CPU spec {files}, slots by {cpu.rank_source} rank, names "
                f"{'released after its barrier' if cpu.barrier else 'kept'}; tiering spec "
                f"{'one file' if self.tiering_worker.segments == 1 else 'segment files'}, "
                f"slots by {self.tiering_worker.rank_source} rank")


def vllm_root() -> Path | None:
    """The directory holding the `vllm` package in use, without importing it."""
    loaded = sys.modules.get("vllm")
    paths = list(getattr(loaded, "__path__", None) or [])
    if not paths:
        try:
            spec = importlib.util.find_spec("vllm")
        except (ImportError, ValueError):  # a broken or half-loaded `vllm` in sys.modules
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        paths = list(spec.submodule_search_locations)
    return Path(paths[0]).parent


def read_rules(root: Path | None = None) -> VllmRules:
    """Read vLLM's rules at `root` (default: the vLLM in use).

    Raises UnsupportedVllm (one line saying what was not understood), also when
    no vLLM is found.
    """
    root = root if root is not None else vllm_root()
    if root is None:
        raise UnsupportedVllm("vLLM is not installed here")
    region = _Source(root, REGION_MODULE)
    cpu = _Source(root, CPU_SPEC_MODULE)
    tiering = _Source(root, TIERING_SPEC_MODULE)
    params = _region_parameters(region)
    cpu_class = cpu.cls("CPUOffloadingSpec")
    for method in _CPU_SPEC_METHODS:
        cpu.method(cpu_class, method)
    missing = [a for a in _CPU_SPEC_ATTRIBUTES if a not in _self_stores(
        cpu.method(cpu_class, "__init__"))]
    if missing:
        raise UnsupportedVllm(f"{cpu.where('CPUOffloadingSpec.__init__')} sets no "
                              f"{', '.join(missing)}")
    tiering_class = tiering.cls("TieringOffloadingSpec")
    calls = {
        "cpu_worker": _region_call(cpu, cpu.method(cpu_class, "create_worker"), params),
        "tiering_worker": _region_call(
            tiering, tiering.method(tiering_class, "create_worker"), params),
        "tiering_scheduler": _region_call(
            tiering, tiering.method(tiering_class, "get_manager"), params),
    }
    if calls["cpu_worker"].rank_source is None or calls["tiering_worker"].rank_source is None:
        raise UnsupportedVllm(f"a worker's region is rank-less in {root}")
    min_bytes = (region.integer("_MIN_SEGMENT_BYTES") if "num_segments" in params
                 else 1 << 30)  # never used: nothing is split
    return VllmRules(root=str(root), version=_version(root), min_segment_bytes=min_bytes,
                     **calls)


_warned: set[str] = set()


def rules_or_none(*, strict: bool) -> VllmRules | None:
    """The rules of the vLLM in use; else (not strict) one warning per process and None."""
    try:
        return read_rules()
    except UnsupportedVllm as exc:
        if strict:
            raise
        if str(exc) not in _warned:
            _warned.add(str(exc))
            logger.warning("vllm-offload: %s: outside what this vllm-offload understands, "
                           "so the hardened specs stand aside and the engine runs as plain "
                           "vLLM (strict mode refuses instead)", exc)
        return None


# -- reading the sources ------------------------------------------------------------


class _Source:
    """One module of vLLM: its parsed source, and the module itself if loaded here."""

    def __init__(self, root: Path, module: str) -> None:
        self.module = module
        self.path = root / (module.replace(".", "/") + ".py")
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise UnsupportedVllm(f"{self.path} cannot be read ({exc.strerror})") from None
        self.tree = _parsed(str(self.path), st.st_mtime_ns, st.st_size)

    def where(self, what: str) -> str:
        return f"{self.module}.{what}"

    def cls(self, name: str) -> ast.ClassDef:
        for node in self.tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise UnsupportedVllm(f"{self.module} has no class {name}")

    def method(self, cls: ast.ClassDef, name: str) -> ast.FunctionDef:
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        raise UnsupportedVllm(f"{self.where(cls.name)} has no method {name}")

    def integer(self, name: str) -> int:
        """A module-level integer constant: the loaded module's value, else the source's."""
        value = self._loaded_value(name)
        if value is None:
            for node in self.tree.body:
                if (isinstance(node, ast.Assign) and len(node.targets) == 1
                        and isinstance(node.targets[0], ast.Name) and node.targets[0].id == name):
                    value = _int_expr(node.value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UnsupportedVllm(f"{self.where(name)} is not a positive integer constant")
        return value

    def _loaded_value(self, name: str) -> object | None:
        module = sys.modules.get(self.module)
        file = getattr(module, "__file__", None)
        if module is None or file is None:
            return None
        with contextlib.suppress(OSError):
            if os.path.samefile(file, self.path):
                return getattr(module, name, None)
        return None


@functools.lru_cache(maxsize=16)
def _parsed(path: str, mtime_ns: int, size: int) -> ast.Module:
    """A vLLM module's syntax tree, read and parsed once per process and file version:
    the plugin and every spec's create_worker/get_manager ask for the same three."""
    try:
        with open(path, "rb") as f:
            text = f.read(_MAX_SOURCE_BYTES + 1)
    except OSError as exc:
        raise UnsupportedVllm(f"{path} cannot be read ({exc.strerror})") from None
    if len(text) > _MAX_SOURCE_BYTES:
        raise UnsupportedVllm(f"{path} is over {_MAX_SOURCE_BYTES} bytes")
    try:
        return ast.parse(text, filename=path)
    except (SyntaxError, ValueError) as exc:
        raise UnsupportedVllm(f"{path} does not parse ({exc})") from None


def _int_expr(node: ast.expr) -> int | None:
    """An integer written as a literal or simple arithmetic of literals (`1 << 30`)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp):
        left, right = _int_expr(node.left), _int_expr(node.right)
        if left is None or right is None or not (0 <= right <= 64):
            return None
        ops: dict[type[ast.operator], Any] = {
            ast.LShift: lambda a, b: a << b, ast.Mult: lambda a, b: a * b,
            ast.Pow: lambda a, b: a ** b, ast.Add: lambda a, b: a + b}
        op = ops.get(type(node.op))
        return None if op is None else int(op(left, right))
    return None


def _region_parameters(region: _Source) -> frozenset[str]:
    init = region.method(region.cls(REGION_CLASS), "__init__")
    a = init.args
    positional = tuple(p.arg for p in a.posonlyargs + a.args)[1:]  # without self
    if positional[:len(POSITIONAL)] != POSITIONAL:
        raise UnsupportedVllm(f"{region.where(REGION_CLASS)}({', '.join(positional)}) does "
                              f"not start with vLLM's ({', '.join(POSITIONAL)})")
    if a.vararg is not None or a.kwarg is not None:
        raise UnsupportedVllm(f"{region.where(REGION_CLASS)} takes *args or **kwargs")
    keywords = frozenset(positional[len(POSITIONAL):]) | {p.arg for p in a.kwonlyargs}
    unknown = sorted(keywords - KNOWN_KEYWORDS)
    if unknown:
        raise UnsupportedVllm(f"{region.where(REGION_CLASS)} takes {', '.join(unknown)}, "
                              "which this vllm-offload does not know")
    return keywords | frozenset(POSITIONAL)


def _self_stores(func: ast.FunctionDef) -> set[str]:
    return {n.attr for n in ast.walk(func) if isinstance(n, ast.Attribute)
            and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
            and n.value.id == "self"}


def _callee(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _region_call(source: _Source, func: ast.FunctionDef, params: frozenset[str]) -> RegionCall:
    where = source.where(func.name)
    calls = [n for n in ast.walk(func) if isinstance(n, ast.Call) and _callee(n) == REGION_CLASS]
    if len(calls) != 1:
        raise UnsupportedVllm(f"{where} builds {REGION_CLASS} {len(calls)} times, not once")
    call = calls[0]
    if len(call.args) > len(POSITIONAL) or any(k.arg is None for k in call.keywords):
        raise UnsupportedVllm(f"{where} passes {REGION_CLASS} arguments this version cannot "
                              "follow")
    given: dict[str, ast.expr] = dict(zip(POSITIONAL, call.args, strict=False))
    given.update({k.arg: k.value for k in call.keywords if k.arg is not None})
    unknown = sorted(set(given) - params)
    if unknown:
        raise UnsupportedVllm(f"{where} passes {', '.join(unknown)}, which "
                              f"{REGION_CLASS} does not take")
    segments = 1
    if "num_segments" in given:
        value = given["num_segments"]
        segments = (source.integer(value.id) if isinstance(value, ast.Name)
                    else _int_expr(value) or 0)
        if segments < 1:
            raise UnsupportedVllm(f"{where} passes num_segments this version cannot read")
    rank = given.get("rank")
    if rank is None:
        raise UnsupportedVllm(f"{where} passes no rank")
    rank_source = None if _is_none(rank) else _rank_source(func, where)
    barrier = "barrier" in given and not _is_none(given["barrier"])
    return RegionCall(segments=segments, rank_source=rank_source, barrier=barrier)


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _rank_source(func: ast.FunctionDef, where: str) -> str:
    """How the code picks a worker's slot: from the device index, or the logical rank."""
    attributes = [n for n in ast.walk(func) if isinstance(n, ast.Attribute)]
    if any(n.attr == "current_device_index" for n in attributes):
        return DEVICE_MODULO
    if any(n.attr == "rank" and isinstance(n.value, ast.Attribute) and n.value.attr == "parallel"
           for n in attributes):
        return LOGICAL
    raise UnsupportedVllm(f"{where} picks each worker's slot in a way this version cannot "
                          "follow")


def _version(root: Path) -> str | None:
    """`vllm/_version.py`'s string, for messages; None when it is not plain."""
    try:
        with open(root / "vllm" / "_version.py", "rb") as f:
            tree = ast.parse(f.read(1 << 16))
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
                and any(isinstance(t, ast.Name) and t.id == "__version__"
                        for t in node.targets)):
            return node.value.value[:64]
    return None
