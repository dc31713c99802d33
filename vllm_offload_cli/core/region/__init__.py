"""The region file and its safe handling: names, geometry, guarded opens, locks, manifests."""

from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion

__all__ = ["SharedOffloadRegion"]
