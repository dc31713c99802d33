"""Value types of the command line: sizes, durations and choices, as click parameter types.

Each reads the text as `core.base.units` does and turns a bad value into click's
usage error (exit 2, `usage` in the JSON envelope), never the raw text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from vllm_offload_cli.core.base.errors import InvalidInputError
from vllm_offload_cli.core.base.units import parse_duration, parse_size


class Size(click.ParamType):  # type: ignore[type-arg]  # generic in newer click
    """Bytes: `4096`, `64KiB`, `1G` (powers of 1024), `1GB` (of 1000)."""

    name = "size"
    parse: Callable[..., float] = staticmethod(parse_size)

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return self.name.upper()

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, (int, float)):  # converted already
            return value
        try:
            return self.parse(str(value), what="")
        except InvalidInputError as exc:
            self.fail(exc.message.strip(), param, ctx)


class Duration(Size):
    """Seconds: `90`, `90s`, `5m`, `2h`, `1h30m`; 0 is a time already up."""

    name = "duration"
    parse = staticmethod(parse_duration)


class ParsedChoice(click.Choice):  # type: ignore[type-arg]
    """One of `choices`, read by the core's own parser (its leniency, its message)."""

    def __init__(self, choices: list[str], parse: Callable[[str], Any]) -> None:
        super().__init__(choices)
        self.parse = parse

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        try:
            return self.parse(str(value))
        except InvalidInputError as exc:
            self.fail(exc.message, param, ctx)
