"""Makes a Ray node slow to answer, for the fleet's timeout and node-death tests.

On PYTHONPATH of one test node only. While the file named by
$VLLM_OFFLOAD_TEST_GATE exists, every Ray worker that starts on that node
(not the node's agents) writes `<gate>.started` and waits, so a fleet task
pinned there cannot run until the gate is removed, the node is killed, or
two minutes pass.
"""

import os
import sys
import time

_gate = os.environ.get("VLLM_OFFLOAD_TEST_GATE")
if _gate and sys.argv and "default_worker" in sys.argv[0] and os.path.exists(_gate):
    with open(_gate + ".started", "w"):
        pass
    _deadline = time.monotonic() + 120
    while os.path.exists(_gate) and time.monotonic() < _deadline:
        time.sleep(0.05)
