"""Moving bytes: the copy worker, its copy rules and lanes, pinning and the benchmark."""

from vllm_offload_cli.core.transfer.copies import Direction
from vllm_offload_cli.core.transfer.worker import CopyWorker, TransferResult

__all__ = ["CopyWorker", "Direction", "TransferResult"]
