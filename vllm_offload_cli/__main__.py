"""`python -m vllm_offload_cli` runs the same entry point as the console script."""

from vllm_offload_cli.cli.app import main

if __name__ == "__main__":
    main()
