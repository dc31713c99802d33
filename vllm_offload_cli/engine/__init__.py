"""The engine start-up hook; imports nothing itself, as vLLM loads `plugin` in every process
(only `vllm_spec` and `plugin` import vLLM)."""
