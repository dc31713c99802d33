"""A private network namespace for the Ray tests.

Ray gives every node the host's interface address (it resolves even
127.0.0.1 to it), so a local test cluster would talk over that address. In a
fresh network namespace with only loopback up, Ray falls back to 127.0.0.1 and
no test traffic can reach any interface but `lo`.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

INSIDE_ENV = "VLLM_OFFLOAD_TEST_NETNS"  # set in the child run inside the namespace


def inside() -> bool:
    return os.environ.get(INSIDE_ENV) == "1"


@functools.cache
def available() -> bool:
    """Can we make a network namespace with loopback up (root, unshare and ip)?"""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "--net", "ip", "link", "set", "lo", "up"],
                           capture_output=True, check=False)
    return probe.returncode == 0


def command(argv: list[str]) -> list[str]:
    """`argv` run in a new network namespace whose only interface is loopback."""
    return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]
