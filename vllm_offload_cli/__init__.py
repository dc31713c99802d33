"""vllm-offload: inspect, verify and reclaim vLLM's shared-memory KV offload regions."""

__version__ = "0.1.0"
