"""`python -m vllm_offload_cli` and the console script: the CLI, interruptible at any moment
(the tree is imported inside `main`: a SIGINT while modules load is one line and exit 130)."""

import gc
import sys


def main() -> None:
    gc.disable()  # loading makes no garbage, yet ~40 collections; get_command re-enables
    try:
        from vllm_offload_cli.cli.app import main as run

        run()
    except KeyboardInterrupt:  # the command's own boundary turns later ones into 130 too
        sys.stderr.write("Error: interrupted\n")
        sys.exit(130)  # ExitStatus.INTERRUPTED, not imported: it may be mid-import
    finally:
        gc.freeze()  # exit frees everything at once: spare the collector's walk over it all


if __name__ == "__main__":
    main()
