"""Region churn for the gc stress test: many short-lived processes create, join and leave.

Usage: churn.py SHM_DIR RESULTS_DIR SESSIONS CONCURRENCY SEED

Runs SESSIONS forked children, CONCURRENCY at a time. Each child is one
session: it opens a region (through SharedOffloadRegion on one of a few shared
engine_ids, or like vLLM on an id of its own, with no lock), holds it for a
random moment while checking every few milliseconds that its path still
names the inode it opened, then leaves cleanly or dies without cleanup
(leaking the region for gc). It writes one JSON result file before exiting.

Nothing but gc ever unlinks a name another live process uses: a creator of a
non-persistent region always "crashes" (vLLM's creator would unlink on a clean
exit while joiners still run, which is not gc's doing), and vLLM-style
sessions use ids no one else joins. So a session that saw its name change was
wronged by gc.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import sys
import time

NUM_BLOCKS, RANK_SLOT, WORLD = 4, 4096, 2
ROW_STRIDE = RANK_SLOT * WORLD
SHARED_IDS = [f"churn{i}" for i in range(5)]


def _still_mine(path: str, ident: tuple[int, int]) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == ident


def _hold(path: str, ident: tuple[int, int], seconds: float, result: dict[str, object]) -> None:
    checks = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        checks += 1
        if not _still_mine(path, ident):
            result["lost"] = True
            break
        time.sleep(0.004)
    result["checks"] = checks


def _finish(results: str, n: int, result: dict[str, object]) -> None:
    tmp = os.path.join(results, f".{n}.json")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.rename(tmp, os.path.join(results, f"{n}.json"))


def _region_session(shm_dir: str, rng: random.Random, result: dict[str, object]) -> bool:
    """Returns True to leave cleanly, False to die without cleanup."""
    from vllm_offload_cli.core.region import SharedOffloadRegion

    engine_id = rng.choice(SHARED_IDS)
    result.update(mode="region", engine_id=engine_id)
    region = SharedOffloadRegion(
        engine_id, NUM_BLOCKS, rng.randrange(WORLD), ROW_STRIDE, RANK_SLOT, shm_dir=shm_dir,
        world_size=WORLD, persistent=rng.random() < 0.3, join_timeout=20.0,
    )
    ident = (region.identity.dev, region.identity.ino)
    result["creator"] = region.creator
    _hold(region.mmap_path, ident, rng.uniform(0.03, 0.4), result)
    clean = not (region.creator and not region.persistent) and rng.random() < 0.5
    if clean:
        region.cleanup()
    return clean


def _vllm_session(shm_dir: str, rng: random.Random, n: int, seed: int,
                  result: dict[str, object]) -> bool:
    engine_id = f"churnv{seed}x{n}"
    path = os.path.join(shm_dir, f"vllm_offload_{engine_id}.mmap")
    size = NUM_BLOCKS * ROW_STRIDE
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    ident = (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
    map_only = rng.random() < 0.5
    if map_only:
        os.close(fd)  # from now on only the mapping shows we use it
    result.update(mode="vllm-map" if map_only else "vllm", engine_id=engine_id, creator=True)
    _hold(path, ident, rng.uniform(0.03, 0.4), result)
    if rng.random() < 0.5:
        return False
    mm.close()
    if _still_mine(path, ident):
        os.unlink(path)
    if not map_only:
        os.close(fd)
    return True


def _session(shm_dir: str, results: str, n: int, seed: int) -> None:
    rng = random.Random(seed * 1_000_003 + n)
    result: dict[str, object] = {"n": n, "lost": False, "error": None, "creator": False}
    try:
        if rng.random() < 0.75:
            result["clean"] = _region_session(shm_dir, rng, result)
        else:
            result["clean"] = _vllm_session(shm_dir, rng, n, seed, result)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    _finish(results, n, result)
    os._exit(0)  # never run inherited cleanup: a "crash" leaves everything behind


def main() -> None:
    shm_dir, results = sys.argv[1], sys.argv[2]
    sessions, concurrency, seed = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    import vllm_offload_cli.core.region.shared_region  # noqa: F401  # imported once, before forking

    children: set[int] = set()
    started = 0
    while started < sessions or children:
        while len(children) < concurrency and started < sessions:
            started += 1
            pid = os.fork()
            if pid == 0:
                try:
                    _session(shm_dir, results, started, seed)
                finally:
                    os._exit(1)
            children.add(pid)
        pid, _ = os.wait()
        children.discard(pid)
    print(json.dumps({"sessions": started}), flush=True)


if __name__ == "__main__":
    main()
