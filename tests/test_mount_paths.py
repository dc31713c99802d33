"""A region is one inode, whatever mount path its holders opened it by.

The same tmpfs can be mounted twice (a bind mount, a container's /dev/shm
bind-mounted from the host's): a region released by its engine and held
through the other path names that path in /proc, and was invisible to
inspect, gc and the claim, which compared the directory by path (issue 30,
finding 11). Runs in a private mount namespace (needs root; skipped otherwise).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import require_root

_LOOK = """
import json, mmap, os, sys
from vllm_offload_cli.core.host.discovery import discover, discover_engine
shm, other = sys.argv[1], sys.argv[2]
path = os.path.join(other, "vllm_offload_mp.mmap")
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 8192)
m = mmap.mmap(fd, 8192)
os.unlink(path)  # released: it lives on in this process, named by the other path
print(json.dumps({"all": [(r.engine_id, r.linked) for r in discover(shm).regions],
                  "claim": [(r.engine_id, r.linked) for r in
                            discover_engine(shm, "mp").regions]}))
"""


def test_a_released_region_held_through_another_mount_path_is_seen(shm_dir: Path) -> None:
    require_root("needs root for a private mount namespace")
    require_root("unshare(1) is not installed", granted=shutil.which("unshare") is not None)
    other = Path(tempfile.mkdtemp(prefix="vllm-offload-test-other-"))
    try:
        proc = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             'mount --bind "$1" "$2" && exec "$3" -c "$4" "$1" "$2"', "sh",
             str(shm_dir), str(other), sys.executable, _LOOK],
            capture_output=True, text=True, timeout=60)
        require_root(f"cannot bind-mount here: {proc.stderr}",
                     granted="mount" not in proc.stderr or proc.returncode == 0)
        assert proc.returncode == 0, proc.stderr
        found = json.loads(proc.stdout)
        assert found == {"all": [["mp", False]], "claim": [["mp", False]]}
    finally:
        other.rmdir()
