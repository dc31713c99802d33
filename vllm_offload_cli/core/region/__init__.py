"""The region file and its safe handling: names, geometry, guarded opens, locks, manifests."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion

__all__ = ["SharedOffloadRegion"]


def __getattr__(name: str) -> Any:
    """`SharedOffloadRegion` loads on first use: `inspect` and `gc` need only the parts."""
    if name == "SharedOffloadRegion":
        from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion

        return SharedOffloadRegion
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
