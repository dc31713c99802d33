"""How options look in `--help` and how their values are read: like a system tool's.

typer builds one pydantic TypeAdapter per parameter to convert values, and
importing pydantic costs more than the rest of a command's start-up. The
option kinds this CLI declares (str, int, float, Path, an Enum, a list of
str) are converted here instead, with typer's own messages; anything else
still goes to typer. Help shows no `<bool>` or `<int>` on flags and
counters, and every value option's default.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

from typer._click import Command, Context
from typer._click.exceptions import BadParameter
from typer._coercion import RuntimeParam, TypeDescriptor
from typer.core import TyperArgument, TyperOption, _TyperParameter

_SCALARS = (str, int, float, Path, bool)
_TRUE, _FALSE = {"1", "true", "yes", "on", "y", "t"}, {"0", "false", "no", "off", "n", "f"}


def element_type(annotation: Any) -> Any:
    """What one value of an option is: `E` for a repeatable `list[E]`, else the type."""
    if get_origin(annotation) is list:
        (inner,) = get_args(annotation)
        return inner
    return annotation


def _leaf(annotation: Any) -> Any:
    """The element type this module converts, or None to leave it to typer."""
    if get_origin(annotation) is list:
        inner = element_type(annotation)
        return inner if inner is str else None
    if annotation in _SCALARS:
        return annotation
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation
    return None


@dataclass(frozen=True)
class _Plain(RuntimeParam):
    """Conversion without pydantic for scalars, enums and lists of strings."""

    leaf: Any

    def _coerce_value(self, value: Any, param: _TyperParameter, ctx: Context) -> Any:
        if isinstance(value, (list, tuple)):
            return [self._one(v, param, ctx) for v in value]
        return self._one(value, param, ctx)

    def _one(self, value: Any, param: _TyperParameter, ctx: Context) -> Any:
        leaf = self.leaf
        if leaf is bool:
            text = str(value).strip().lower()
            if isinstance(value, bool) or text in _TRUE | _FALSE:
                return value if isinstance(value, bool) else text in _TRUE
            raise BadParameter(f"{value!r} is not a boolean.", ctx=ctx, param=param)
        if isinstance(value, leaf) and not isinstance(value, bool):
            converted = value
        elif leaf is str:
            return str(value)
        elif isinstance(leaf, type) and issubclass(leaf, enum.Enum):
            for member in leaf:
                if str(member.value) == str(value):
                    return member
            allowed = ", ".join(repr(str(m.value)) for m in leaf)
            raise BadParameter(f"{value!r} is not one of {allowed}.", ctx=ctx, param=param)
        elif leaf is Path:
            converted = Path(os.fsdecode(value))
        else:
            try:
                converted = leaf(str(value).strip())
            except ValueError:
                kind = "an integer" if leaf is int else "a number"
                raise BadParameter(f"{value!r} is not {kind}.", ctx=ctx, param=param) from None
        return self._check(converted, param, ctx)

    def _check(self, value: Any, param: _TyperParameter, ctx: Context) -> Any:
        info = self.parameter_info
        if isinstance(value, Path):
            if not getattr(info, "dir_okay", True) and value.is_dir():
                raise BadParameter(f"{str(value)!r} is a directory.", ctx=ctx, param=param)
            if not getattr(info, "file_okay", True) and value.exists() and not value.is_dir():
                raise BadParameter(f"{str(value)!r} is a file.", ctx=ctx, param=param)
            return value
        low, high = getattr(info, "min", None), getattr(info, "max", None)
        if isinstance(value, (int, float)) and (
                (low is not None and value < low) or (high is not None and value > high)):
            bounds = " and ".join(b for b in (
                None if low is None else f">= {low}", None if high is None else f"<= {high}")
                if b is not None)
            raise BadParameter(f"{value} is not {bounds}.", ctx=ctx, param=param)
        return value


def _runtime(param: _TyperParameter) -> RuntimeParam:
    cached: RuntimeParam | None = param._runtime_param
    if cached is not None:
        return cached
    desc: TypeDescriptor = param.type_descriptor
    leaf = _leaf(desc.annotation)
    info = desc.parameter_info
    if leaf is None or info.parser is not None or getattr(info, "exists", False):
        return TyperOption.get_runtime_param(param)
    param._runtime_param = _Plain(info, desc.annotation, leaf)
    return param._runtime_param


class PlainOption(TyperOption):
    """An option as `--help` of a system tool shows it."""

    def display_type_rich(self, ctx: Context) -> str | None:
        if self.is_flag or self.count:
            return None
        if self.metavar is None and self.type_descriptor.annotation is int:
            return "N"
        shown = self.metavar or super().display_type_rich(ctx)
        if shown and shown.startswith("<list[") and shown.endswith("]>"):
            return f"<{shown[6:-2]}>"  # a repeatable choice: the choices, not a type
        return shown

    def get_runtime_param(self) -> RuntimeParam:
        return _runtime(self)


class PlainArgument(TyperArgument):
    """An argument as a man page writes it: ENGINE_ID, [ENGINE_ID], [ENGINE_ID]..."""

    def display_type_rich(self, ctx: Context) -> str | None:
        return None  # the metavar says it

    def _usage_display_name(self) -> str:
        name = (self.metavar or self.name or "ARG").upper()
        name = name if self.required else f"[{name}]"
        return f"{name}..." if self.nargs != 1 else name

    def get_runtime_param(self) -> RuntimeParam:
        return _runtime(self)


def tidy(cmd: Command) -> Command:
    """Convert `cmd`'s values without pydantic; no `<bool>`/`<int>`; every default shown."""
    ctx = Context(cmd, help_option_names=["-h", "--help"])
    for p in [*cmd.params, cmd.get_help_option(ctx)]:
        if isinstance(p, TyperOption):
            p.__class__ = PlainOption
            if p.is_flag or p.count:
                p.show_default = False  # off, and 0: nothing to say
            elif p.show_default is False and p.default is not None:
                p.show_default = True
        elif isinstance(p, TyperArgument):
            p.__class__ = PlainArgument
    for sub in getattr(cmd, "commands", {}).values():
        tidy(sub)
    return cmd
