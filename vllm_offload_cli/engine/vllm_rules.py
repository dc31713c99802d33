"""How the vLLM in use makes its region: RELEASES (what differs per release; CI checks each
row against that release's code), confirmed by signatures. A vLLM not understood is
`UnsupportedVllm`: the hook stands aside. Read with `ast`, never imported (`create` asks too).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import logging
import operator
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from vllm_offload_cli.core.base.units import is_int
from vllm_offload_cli.core.region import ranks

logger = logging.getLogger(__name__)

REGION_MODULE = "vllm.v1.kv_offload.cpu.shared_offload_region"
CPU_SPEC_MODULE = "vllm.v1.kv_offload.cpu.spec"
TIERING_SPEC_MODULE = "vllm.v1.kv_offload.tiering.spec"
REGION_CLASS = "SharedOffloadRegion"

# vLLM's positional parameters (the core's SharedOffloadRegion takes the same).
POSITIONAL = ("engine_id", "num_chunks", "rank", "kv_bytes_per_chunk", "cpu_page_size")
# The methods the hardened specs override or call, per spec class and module.
_SPEC_METHODS = {CPU_SPEC_MODULE: ("CPUOffloadingSpec", ("__init__", "create_worker",
                                                        "get_manager", "_uses_shared_region")),
                 TIERING_SPEC_MODULE: ("TieringOffloadingSpec", ("create_worker",
                                                                 "get_manager"))}
_MAX_SOURCE_BYTES = 4 << 20  # a module of vLLM is far smaller; bounds a hostile tree

LOGICAL, DEVICE_MODULO = ranks.LOGICAL.name, ranks.DEVICE_MODULO.name


class UnsupportedVllm(Exception):  # noqa: N818 - a verdict about vLLM, reported in one line
    """The vLLM found makes its region in a way this version does not understand."""


@dataclass(frozen=True)
class RegionCall:
    """One place a vLLM spec builds its region: what its release does there."""

    segments: int  # files asked for (1: the call passes no num_segments)
    rank_source: str | None  # LOGICAL or DEVICE_MODULO; None for the rank-less scheduler
    barrier: bool  # vLLM's creator unlinks the names once every worker mapped them


@dataclass(frozen=True, kw_only=True)
class Release:
    """One release of the support matrix, as its code reads (checked by CI)."""

    keywords: frozenset[str]  # SharedOffloadRegion's parameters after vLLM's five
    rank_source: str  # how both specs' workers pick their slot
    segments_constant: str | None  # the CPU spec's constant for num_segments; None: one file


# Every release: the CPU spec unlinks after its barrier, the tiering scheduler is rank-less.
_KEYWORDS_031 = frozenset({"barrier", "creator_memory_check", "populate_only_on_creator"})
RELEASES: Mapping[str, Release] = MappingProxyType({
    "0.31": Release(keywords=_KEYWORDS_031, rank_source=DEVICE_MODULO, segments_constant=None),
    "0.32": Release(keywords=_KEYWORDS_031, rank_source=LOGICAL, segments_constant=None),
    "0.33": Release(keywords=frozenset({"barrier", "creator_memory_check", "populate_shard",
                                        "num_segments"}),
                    rank_source=LOGICAL, segments_constant="_REGION_SEGMENTS"),
})


@dataclass(frozen=True, kw_only=True)
class VllmRules:
    """What one vLLM installation does with its region, and where it was read."""

    root: str  # the directory holding `vllm/`
    version: str | None  # picks the row of RELEASES (major.minor)
    min_segment_bytes: int  # vLLM makes no segment file smaller than this
    cpu_worker: RegionCall
    tiering_worker: RegionCall
    tiering_scheduler: RegionCall


def vllm_root() -> Path | None:
    """The directory holding the `vllm` package in use, without importing it."""
    loaded = sys.modules.get("vllm")
    paths = list(getattr(loaded, "__path__", None) or [])
    if not paths:
        try:
            spec = importlib.util.find_spec("vllm")
        except (ImportError, ValueError):  # a broken or half-loaded `vllm` in sys.modules
            return None
        paths = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(paths[0]).parent if paths else None


def read_rules(root: Path | None = None) -> VllmRules:
    """vLLM's rules at `root` (default: the vLLM in use); else UnsupportedVllm, one line."""
    root = root if root is not None else vllm_root()
    if root is None:
        raise UnsupportedVllm("vLLM is not installed here")
    version = _version(root)
    release = RELEASES.get(release_of(version))
    if release is None:
        raise UnsupportedVllm(f"vLLM {version or '(version unknown)'} at {root} is outside "
                              f"the releases this vllm-offload knows ({', '.join(RELEASES)})")
    region = _Source(root, REGION_MODULE)
    _check_region_signature(region, release)
    specs = {module: _Source(root, module) for module in _SPEC_METHODS}
    for module, (name, methods) in _SPEC_METHODS.items():
        for method in methods:
            specs[module].method(specs[module].cls(name), method)
    segments = (1 if release.segments_constant is None
                else specs[CPU_SPEC_MODULE].integer(release.segments_constant))
    min_bytes = (region.integer("_MIN_SEGMENT_BYTES") if "num_segments" in release.keywords
                 else 1 << 30)  # never used: nothing is split
    return VllmRules(
        root=str(root), version=version, min_segment_bytes=min_bytes,
        cpu_worker=RegionCall(segments=segments, rank_source=release.rank_source, barrier=True),
        tiering_worker=RegionCall(segments=1, rank_source=release.rank_source, barrier=False),
        tiering_scheduler=RegionCall(segments=1, rank_source=None, barrier=False))


def release_of(version: str | None) -> str:
    """'0.33.1.dev4+g1234' -> '0.33': patch releases share their release's row."""
    m = re.match(r"(\d+)\.(\d+)(?:\.|$)", version or "")
    return "" if m is None else f"{int(m[1])}.{int(m[2])}"


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

    def cls(self, name: str) -> ast.ClassDef:
        for node in self.tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise UnsupportedVllm(f"{self.module} has no class {name}")

    def method(self, cls: ast.ClassDef, name: str) -> ast.FunctionDef:
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
        raise UnsupportedVllm(f"{self.module}.{cls.name} has no method {name}")

    def integer(self, name: str) -> int:
        """A module-level integer constant: the loaded module's value, else the source's."""
        module = sys.modules.get(self.module)
        file = getattr(module, "__file__", None)  # None also when not loaded
        value: object | None = None
        with contextlib.suppress(OSError):
            if file is not None and os.path.samefile(file, self.path):
                value = getattr(module, name, None)
        if value is None:
            value = _int_expr(_assigned(self.tree, name))
        if not is_int(value) or value < 1:
            raise UnsupportedVllm(f"{self.module}.{name} is not a positive integer constant")
        return value


@functools.lru_cache(maxsize=16)
def _parsed(path: str, mtime_ns: int, size: int) -> ast.Module:
    """A vLLM module's syntax tree, parsed once per process and file version."""
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


def _assigned(tree: ast.Module, name: str) -> ast.expr | None:
    """The value last assigned to the module-level name `name`."""
    values = [n.value for n in tree.body if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]
    return values[-1] if values else None


_OPS: dict[type[ast.operator], Any] = {ast.LShift: operator.lshift, ast.Mult: operator.mul,
                                       ast.Pow: operator.pow, ast.Add: operator.add}


def _int_expr(node: ast.expr | None) -> int | None:
    """An integer written as a literal or simple arithmetic of literals (`1 << 30`)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp):
        left, right = _int_expr(node.left), _int_expr(node.right)
        op = _OPS.get(type(node.op))
        if left is None or right is None or op is None or not (0 <= right <= 64):
            return None
        return int(op(left, right))
    return None


def _check_region_signature(region: _Source, release: Release) -> None:
    """The constructor takes vLLM's five positional parameters, then exactly the row's."""
    where = f"{region.module}.{REGION_CLASS}"
    a = region.method(region.cls(REGION_CLASS), "__init__").args
    positional = tuple(p.arg for p in a.posonlyargs + a.args)[1:]  # without self
    if positional[:len(POSITIONAL)] != POSITIONAL:
        raise UnsupportedVllm(f"{where}({', '.join(positional)}) does not start with vLLM's "
                              f"({', '.join(POSITIONAL)})")
    if a.vararg is not None or a.kwarg is not None:
        raise UnsupportedVllm(f"{where} takes *args or **kwargs")
    keywords = frozenset(positional[len(POSITIONAL):]) | {p.arg for p in a.kwonlyargs}
    said = [f"{verb} {', '.join(sorted(names))}" for verb, names in (
        ("takes", keywords - release.keywords), ("lacks", release.keywords - keywords)) if names]
    if said:
        raise UnsupportedVllm(f"{where} {' and '.join(said)}, unlike the release this "
                              "vllm-offload knows by that version")


def _version(root: Path) -> str | None:
    """`vllm/_version.py`'s string, for messages; None when it is not plain."""
    try:
        value = _assigned(_Source(root, "vllm._version").tree, "__version__")
    except UnsupportedVllm:
        return None
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return value.value[:64]
    return None
