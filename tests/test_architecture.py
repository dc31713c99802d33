"""The package's import graph points one way.

Every `import` in every module (top level, inside functions and under
TYPE_CHECKING alike) is read with `ast` and checked against the layer table
below, so a new module cannot slip in an import against the direction, and a
new package cannot appear without a place in the table.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import vllm_offload_cli

PACKAGE = Path(vllm_offload_cli.__file__).parent
ROOT = "vllm_offload_cli"

# What each part may import from this package (besides itself). Order is the
# layering: the region format knows nothing of hosts, reclaim, layouts or copies.
ALLOWED: dict[str, set[str]] = {
    "core.base": set(),
    # the one layer that reads the host (/proc, /sys, mountinfo, cgroups, libc)
    "core.system": {"core.base"},
    "core.region": {"core.base", "core.system"},
    "core.host": {"core.base", "core.system", "core.region"},
    "core.layout": {"core.base", "core.system", "core.region", "core.host"},
    "core.reclaim": {"core.base", "core.system", "core.region", "core.host"},
    "core.transfer": {"core.base", "core.system", "core.region"},
    "core": {"core.base", "core.region", "core.transfer"},  # core/__init__ re-exports only
    # the engine hook: start-up steps on the core, importable without vLLM and torch
    "engine": {"core.base", "core.system", "core.region", "core.host", "core.reclaim"},
    # merge and render a fleet's per-node answers; Ray only inside fleet.run_on_every_node
    "fleet": {"core.base"},
    "cli": {"core.base", "core.system", "core.region", "core.host", "core.layout",
            "core.reclaim", "core.transfer", "engine", "fleet", "package"},
    "package": {"cli"},  # __main__.py runs the CLI
}
THIRD_PARTY_FORBIDDEN_IN_CORE = {"typer", "rich", "click"}


def _part(module: str) -> str:
    """The layer a dotted module name belongs to."""
    parts = module.split(".")[1:]  # drop "vllm_offload_cli"
    if not parts or parts[0] in {"__main__", "__init__"}:
        return "package"
    if parts[0] == "core" and len(parts) > 1 and parts[1] != "__init__":
        return f"core.{parts[1]}"
    return parts[0]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str | None = None) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import statement in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:  # `from pkg import submodule`
                yield node.lineno, f"{module}.{alias.name}"


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").exists() or \
        (PACKAGE.parent / rel / "__init__.py").exists()


def test_every_part_is_in_the_layer_table() -> None:
    parts = {_part(_module_name(p)) for p in _modules()}
    assert parts <= set(ALLOWED), f"give {sorted(parts - set(ALLOWED))} a row in ALLOWED"


def test_no_module_sits_loose_in_core() -> None:
    loose = [p.name for p in (PACKAGE / "core").glob("*.py") if p.name != "__init__.py"]
    assert loose == []


def _violations(path: Path, name: str) -> list[str]:
    own = _part(name)
    wrong = []
    for line, module in _imports(path, name):
        top = module.split(".")[0]
        if own.startswith("core") and top in THIRD_PARTY_FORBIDDEN_IN_CORE:
            wrong.append(f"line {line}: {module}: the core never imports the CLI framework")
        if top != ROOT or not _is_module(module):
            continue
        target = _part(module)
        message = f"line {line}: {own} may not import {target}"
        if target != own and target not in ALLOWED[own] and message not in wrong:
            wrong.append(message)
    return wrong


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_one_way(path: Path) -> None:
    assert _violations(path, _module_name(path)) == []


def test_subcommand_modules_do_not_import_the_app() -> None:
    """cli.app registers the subcommands; nothing imports it back (no cycle)."""
    offenders = [
        str(path.relative_to(PACKAGE)) for path in (PACKAGE / "cli").glob("*.py")
        if path.name != "app.py"
        and any(module.startswith(f"{ROOT}.cli.app") for _, module in _imports(path))
    ]
    assert offenders == []


def test_the_checker_sees_a_wrong_import(tmp_path: Path) -> None:
    """The rule is live: upward, relative and CLI-framework imports are caught."""
    probe = tmp_path / "probe.py"
    probe.write_text("from vllm_offload_cli.core.host import discovery\n"
                     "from ..reclaim import collector\n"
                     "import rich\n"
                     "from vllm_offload_cli.core.region import naming\n")
    wrong = _violations(probe, "vllm_offload_cli.core.region.probe")
    assert [w.split(":")[0] for w in wrong] == ["line 1", "line 2", "line 3"]


# -- host facts come from core/system only ------------------------------------------

_HOST_PATH = re.compile(r"^/(?:proc|sys)(?:/|$)")  # a path, not prose like "/proc is ..."


def _host_path_literals(path: Path) -> list[str]:
    """String literals that are /proc or /sys paths (docstrings and prose do not count)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"line {node.lineno}: {node.value!r}" for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and id(node) not in docstrings
        and _HOST_PATH.match(node.value)
    ]


@pytest.mark.parametrize("path", [p for p in _modules() if "system" not in p.parts],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_core_system_reads_the_host(path: Path) -> None:
    """Every /proc and /sys path is built in core/system, so one error policy applies."""
    assert _host_path_literals(path) == []


def test_the_host_path_rule_is_live(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('"""Reads /proc/PID/maps (a docstring: fine)."""\n'
                     'def f(pid: int) -> str:\n'
                     '    print("/proc is mounted with hidepid (prose: fine)")\n'
                     '    return open(f"/proc/{pid}/maps").read() + open("/sys/x").read()\n')
    assert [w.split(":")[0] for w in _host_path_literals(probe)] == ["line 4", "line 4"]


FRAMEWORKS = ("click", "rich", "typer")


def _private_framework_names(tree: ast.AST) -> list[str]:
    """`_`-names of the CLI frameworks: imported, or reached as attributes."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FRAMEWORKS:
            parts = (node.module or "").split(".") + [a.name for a in node.names]
            found += [f"{node.module}: {p}" for p in parts if p.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in FRAMEWORKS
                      and any(p.startswith("_") for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in FRAMEWORKS:
                found.append(f"{root.id}...{node.attr}")
    return found


def test_the_cli_frameworks_are_used_through_their_public_api() -> None:
    """No `typer._click`, `click.core._x` or `rich._x`: a minor release may change those."""
    used = {str(path.relative_to(PACKAGE)): names for path in PACKAGE.rglob("*.py")
            if (names := _private_framework_names(ast.parse(path.read_text())))}
    assert used == {}
    assert _private_framework_names(ast.parse(
        "from typer._click import Context\nimport click\nclick.core._main\n")) == [
        "typer._click: _click", "click..._main"]
