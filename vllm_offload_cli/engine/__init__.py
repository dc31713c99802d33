"""The engine start-up hook, importable without vLLM or torch (`vllm_spec` and `plugin`
are the modules only vLLM loads). The package imports nothing itself: vLLM loads the
plugin in every process, which needs none of the claim's discovery and reclaim code."""
