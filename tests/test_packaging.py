"""The distribution as people get it: a light base install, and a wheel like a system tool's.

The base install (no extras) runs every node-local command without torch, and what
needs the `copy` extra refuses with the line that installs it. Proved the way an
operator meets it: a fresh venv of the distribution's python3, the package
installed from this tree by pip (and the package index), the README's "Try it" line
run as written. The wheel and sdist are built as a release would be, listed, and
checked by twine. Venvs and builds are made once per session (tests marked `slow`).
"""

from __future__ import annotations

import email.parser
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from vllm_offload_cli import __version__
from vllm_offload_cli.cli.app import app
from vllm_offload_cli.core.base.errors import MissingExtraError
from vllm_offload_cli.core.base.exit_status import ExitStatus
from vllm_offload_cli.core.base.extras import COPY, import_torch, install_line, require

REPO = Path(__file__).resolve().parent.parent
CONTAINERFILE = REPO / "contrib" / "kubernetes" / "Containerfile"
SYSTEM_PYTHON = Path("/usr/bin/python3")  # the distribution's, not a developer's
COPY_LINE = "pip install 'vllm-offload[copy]'"
BENCHMARK_REFUSAL = ("Error: vllm-offload benchmark needs torch and numpy, which are not "
                     f"installed; install them with: {COPY_LINE}\n")
BASE_DEPS = {"click", "rich", "psutil", "prometheus-client"}
# what the copy extra brings, and what must never come with the base install
HEAVY = {"torch", "numpy", "cffi", "triton"}
SHARED_DATA = {
    "man/vllm-offload.1": "share/man/man1/vllm-offload.1",
    "completions/vllm-offload.bash": "share/bash-completion/completions/vllm-offload",
    "completions/_vllm-offload": "share/zsh/site-functions/_vllm-offload",
    "completions/vllm-offload.fish": "share/fish/vendor_completions.d/vllm-offload.fish",
}
INSTALL_TIMEOUT = 600  # a cold pip cache on a busy 2-core machine


# -- helpers ---------------------------------------------------------------------------

def containerfile_steps() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Containerfile: comments dropped, `\\` lines joined."""
    steps: list[tuple[str, str]] = []
    pending = ""
    for line in CONTAINERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        instruction, _, args = pending.strip().partition(" ")
        steps.append((instruction.upper(), args.strip()))
        pending = ""
    return steps


def stage_build_context(root: Path) -> None:
    """Do the Containerfile's COPY steps from this tree into `root` (its `/`)."""
    for instruction, args in containerfile_steps():
        if instruction != "COPY":
            continue
        *sources, dest = shlex.split(args)
        target = root / dest.lstrip("/")
        for source in sources:
            src = REPO / source
            assert src.exists(), f"COPY {source}: not in the repository"
            into = target / src.name if dest.endswith("/") else target
            if src.is_dir():
                shutil.copytree(src, into, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                into.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, into)


def venv_env(venv: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of an operator's shell: none of this test run's Python settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin"
        env["VIRTUAL_ENV"] = str(venv)
    env.update(extra)
    return env


def run(argv: list[str] | str, *, env: dict[str, str], cwd: Path | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, shell=isinstance(argv, str),
                          executable="/bin/bash" if isinstance(argv, str) else None)


def readme_line(section: str) -> str:
    """The one command line in the README's `## {section}` code block."""
    text = (REPO / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    block = body.split("```sh\n", 1)[1].split("```", 1)[0]
    (line,) = block.strip().splitlines()
    return line


def installed(venv: Path) -> set[str]:
    proc = run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
               env=venv_env(venv))
    assert proc.returncode == 0, proc.stderr
    return {p["name"].lower().replace("_", "-") for p in json.loads(proc.stdout)}


def offload(venv: Path, shm_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run([str(venv / "bin" / "vllm-offload"), *args],
               env=venv_env(venv, VLLM_OFFLOAD_SHM_DIR=str(shm_dir)))


@functools.cache
def _image_venv(root: Path) -> Path:
    """A venv made the way the Containerfile makes its image: its COPY and RUN steps."""
    stage_build_context(root)
    venv = root / "venv"
    made = run([str(SYSTEM_PYTHON), "-m", "venv", str(venv)], env=venv_env(), timeout=300)
    assert made.returncode == 0, made.stderr
    (step,) = [args for instruction, args in containerfile_steps() if instruction == "RUN"]
    command = step.replace("/tmp/src", str(root / "tmp" / "src"))
    proc = run(command, env=venv_env(venv), timeout=INSTALL_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return venv


@pytest.fixture(scope="session")
def image_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not SYSTEM_PYTHON.exists():
        pytest.skip("no distribution python3 at /usr/bin/python3")
    return _image_venv(tmp_path_factory.mktemp("image"))


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist, and the wheel built from it, as `python -m build` makes a release."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT,
                          env=venv_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


# -- the extra helper, in this process ---------------------------------------------------

def test_a_missing_extra_is_the_projects_error_with_the_install_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    require(COPY, what="anything")  # present in the test environment: no error
    monkeypatch.setitem(sys.modules, "numpy", None)  # an import of it now fails
    with pytest.raises(MissingExtraError) as caught:
        require(COPY, what="CopyWorker")
    assert str(caught.value) == ("CopyWorker needs numpy, which is not installed; install it "
                                 f"with: {COPY_LINE}")
    assert caught.value.install == install_line(COPY) == COPY_LINE
    assert caught.value.code == "extra_not_installed"
    assert caught.value.exit_status == ExitStatus.USAGE


def test_import_torch_without_torch_raises_the_projects_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MissingExtraError, match=r"needs torch, .*: pip install 'vllm-offload\["):
        import_torch()


def test_benchmark_without_the_extra_exits_2_in_process(
        monkeypatch: pytest.MonkeyPatch, shm_dir: Path) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    result = CliRunner().invoke(app, ["benchmark", "--shm-dir", str(shm_dir)],
                                catch_exceptions=False)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == ("Error: vllm-offload benchmark needs torch, which is not "
                             f"installed; install it with: {COPY_LINE}\n")
    assert list(shm_dir.iterdir()) == []


# -- a fresh venv of the distribution's python3, the base install only ------------------

@pytest.mark.slow  # a fresh venv or a build, once per session
def test_readme_try_it_line_passes_in_a_fresh_venv(tmp_path: Path, shm_dir: Path) -> None:
    """The README's line as written: its own venv, `pip install .`, the demo commands."""
    if not SYSTEM_PYTHON.exists():
        pytest.skip("no distribution python3 at /usr/bin/python3")
    line = readme_line("Try it")
    assert "pip install . " in line and "torch" not in line and "[" not in line
    # the scratch directory goes inside this test's private one, removed whatever happens
    template = "/dev/shm/vllm-offload-demo.XXXX"
    assert line.count(template) == 1
    line = line.replace(template, f"{shm_dir}/vllm-offload-demo.XXXX")
    checkout = tmp_path / "checkout"
    stage_build_context(tmp_path)  # the files `pip install .` reads, as an sdist has them
    (tmp_path / "tmp" / "src").rename(checkout)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(SYSTEM_PYTHON)

    proc = run(line, cwd=checkout, timeout=INSTALL_TIMEOUT,
               env=venv_env(PATH=f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"))

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo_dp0" in proc.stdout
    assert list(shm_dir.iterdir()) == []  # gc removed the region, rmdir its directory
    assert not HEAVY & installed(checkout / ".venv")


@pytest.mark.slow  # a fresh venv or a build, once per session
def test_base_install_has_no_torch(image_venv: Path) -> None:
    names = installed(image_venv)
    assert BASE_DEPS | {"vllm-offload"} <= names
    assert not HEAVY & names
    assert not {n for n in names if n.startswith(("nvidia-", "cuda-"))}


@pytest.mark.slow  # a fresh venv or a build, once per session
def test_node_local_commands_work_without_torch(image_venv: Path, shm_dir: Path) -> None:
    for args in (["--version"],
                 ["create", "light", "--world-size", "2", "--cpu-page-size", "4KiB",
                  "--num-blocks", "8", "--json"],
                 ["inspect", "--json"],
                 ["inspect", "--format", "prometheus"],
                 ["verify-rank-layout", "light", "--json"],
                 ["verify-rank-layout", "--world-size", "2", "--dp-size", "2", "--json"],
                 ["preflight", "other", "--size", "1MiB", "--json"],
                 ["gc", "--include-persistent", "--min-age", "0", "--json"]):
        proc = offload(image_venv, shm_dir, *args)
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
        if "--json" in args:
            assert json.loads(proc.stdout)["ok"] is True
    assert [r["engine_id"] for r in json.loads(proc.stdout)["data"]["removed"]] == ["light"]
    assert not any(shm_dir.glob("vllm_offload_*"))


@pytest.mark.slow  # a fresh venv or a build, once per session
def test_benchmark_refuses_with_the_install_line(image_venv: Path, shm_dir: Path) -> None:
    proc = offload(image_venv, shm_dir, "benchmark")
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", BENCHMARK_REFUSAL)
    proc = offload(image_venv, shm_dir, "benchmark", "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == doc["exit_code"] == 2
    assert doc["errors"][0]["code"] == "extra_not_installed"
    assert COPY_LINE in doc["errors"][0]["message"]
    assert list(shm_dir.iterdir()) == []


LIBRARY_PROBE = """
import json, sys
from importlib.metadata import entry_points
(plugin,) = entry_points(group="vllm.general_plugins", name="vllm_offload")
plugin.load()()  # as vLLM calls it; without vLLM it logs, never raises
import vllm_offload_cli.engine  # the startup steps: plain core calls
from vllm_offload_cli.core.base.errors import MissingExtraError
from vllm_offload_cli.core.region.shared_region import SharedOffloadRegion
from vllm_offload_cli.core.transfer.worker import CopyWorker
out = {}
region = SharedOffloadRegion("lib", 4, 0, 8192, 4096, shm_dir=sys.argv[1], world_size=2)
try:
    for name, call in (("view", lambda: region.create_next_worker_view(4096)),
                       ("worker", lambda: CopyWorker(region, []))):
        try:
            call()
        except MissingExtraError as exc:
            out[name] = [exc.code, str(exc)]
finally:
    region.cleanup()
out["torch_imported"] = "torch" in sys.modules
print(json.dumps(out))
"""


@pytest.mark.slow  # a fresh venv or a build, once per session
def test_engine_plugin_and_library_without_torch(image_venv: Path, shm_dir: Path) -> None:
    proc = run([str(image_venv / "bin" / "python"), "-c", LIBRARY_PROBE, str(shm_dir)],
               env=venv_env(image_venv))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out.pop("torch_imported") is False
    assert out == {
        "view": ["extra_not_installed", "a tensor view or copy needs torch, which is not "
                 f"installed; install it with: {COPY_LINE}"],
        "worker": ["extra_not_installed", "CopyWorker needs torch and numpy, which are not "
                   f"installed; install them with: {COPY_LINE}"]}
    assert not any(shm_dir.glob("vllm_offload_*"))


@pytest.mark.slow  # a fresh venv or a build, once per session
def test_man_page_and_completions_land_where_tools_look(image_venv: Path) -> None:
    for source, target in SHARED_DATA.items():
        assert (image_venv / target).read_bytes() == (REPO / source).read_bytes()
    man = shutil.which("man")
    if man is None:
        return
    proc = run([man, "-w", "vllm-offload"], env=venv_env(image_venv))
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == image_venv / SHARED_DATA["man/vllm-offload.1"]
    analyze = shutil.which("systemd-analyze")
    if analyze is not None:  # the unit's Documentation=man:vllm-offload(1) resolves
        unit = REPO / "contrib" / "systemd" / "vllm-offload-gc.service"
        proc = run([analyze, "verify", str(unit)], env=venv_env(image_venv))
        assert "man vllm-offload(1)" not in proc.stdout + proc.stderr


def install_route() -> str:
    """The install lines of contrib/README.md, as an operator pastes them."""
    text = (REPO / "contrib" / "README.md").read_text()
    block = text.split("<!-- install-route", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return block.strip()


@pytest.mark.slow  # a fresh venv or a build, once per session
def test_the_documented_install_route_works(dists: dict[str, Path], tmp_path: Path,
                                            shm_dir: Path) -> None:
    """contrib/README.md's lines as written, from the built wheel, with / moved into
    tmp_path: the command, the man page and the bash completion are where the units,
    man and bash look, and `systemd-analyze verify` accepts the gc unit's
    Documentation=man: line (pipx, which the files assumed, cannot do this on Debian 12)."""
    if not SYSTEM_PYTHON.exists():
        pytest.skip("no distribution python3 at /usr/bin/python3")
    root = tmp_path / "root"
    lines = [ln for ln in install_route().splitlines() if "apt-get" not in ln]
    assert all(ln.startswith("sudo ") for ln in lines)
    script = "\n".join(ln.removeprefix("sudo ") for ln in lines)
    assert "pip install .\n" in script and "pipx" not in script
    script = (script.replace("/opt/", f"{root}/opt/").replace("/usr/local/", f"{root}/usr/local/")
              .replace("pip install .\n", f"pip install {shlex.quote(str(dists['wheel']))}\n")
              .replace("python3 -m venv", f"{SYSTEM_PYTHON} -m venv"))
    (root / "usr" / "local" / "bin").mkdir(parents=True)

    proc = run(f"set -e\n{script}", env=venv_env(), timeout=INSTALL_TIMEOUT)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    exe = root / "usr" / "local" / "bin" / "vllm-offload"
    version = run([str(exe), "--version"], env=venv_env(VLLM_OFFLOAD_SHM_DIR=str(shm_dir)))
    assert version.returncode == 0 and __version__ in version.stdout, version.stderr
    completion = root / "usr/local/share/bash-completion/completions/vllm-offload"
    assert completion.read_bytes() == (REPO / "completions" / "vllm-offload.bash").read_bytes()
    manpath = {"MANPATH": str(root / "usr" / "local" / "share" / "man")}
    man = shutil.which("man")
    if man is not None:
        found = run([man, "-w", "vllm-offload"], env=venv_env(**manpath))
        assert found.returncode == 0, found.stderr
        assert Path(found.stdout.strip()).read_bytes() == (REPO / "man" / "vllm-offload.1"
                                                           ).read_bytes()
    analyze = shutil.which("systemd-analyze")
    if analyze is not None and man is not None:
        unit = tmp_path / "vllm-offload-gc.service"
        unit.write_text((REPO / "contrib" / "systemd" / unit.name).read_text()
                        .replace("/usr/local/bin/vllm-offload", str(exe)))
        verified = run([analyze, "verify", str(unit)], env=venv_env(**manpath))
        assert verified.returncode == 0, verified.stdout + verified.stderr


def test_containerfile_installs_the_base_package_only() -> None:
    steps = containerfile_steps()
    (run_step,) = [args for instruction, args in steps if instruction == "RUN"]
    words = shlex.split(run_step.split("&&")[0])
    assert words[:2] == ["pip", "install"] and words[-1] == "/tmp/src"  # no [extra]
    copied = [shlex.split(a)[:-1] for i, a in steps if i == "COPY"]
    assert {"pyproject.toml", "README.md", "LICENSE", "vllm_offload_cli", "man",
            "completions"} == {s for sources in copied for s in sources}


# -- the wheel and the sdist -------------------------------------------------------------

@pytest.mark.slow  # a fresh venv or a build, once per session
def test_wheel_carries_license_man_page_and_completions(dists: dict[str, Path]) -> None:
    wheel = dists["wheel"]
    dist_info = f"vllm_offload-{__version__}.dist-info"
    data = f"vllm_offload-{__version__}.data/data"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert z.read(f"{dist_info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
        for source, target in SHARED_DATA.items():
            assert z.read(f"{data}/{target}") == (REPO / source).read_bytes()
        metadata = email.parser.Parser().parsestr(z.read(f"{dist_info}/METADATA").decode())
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    package = {p.relative_to(REPO).as_posix() for p in (REPO / "vllm_offload_cli").rglob("*.py")}
    assert package <= names
    strays = {n for n in names if not n.startswith(("vllm_offload_cli/", dist_info, data))}
    assert not strays  # no tests, benchmarks or contrib in site-packages
    assert not [n for n in names if n.rsplit("/", 1)[-1] in ("gendocs.py", "datadoc.py")]

    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    requires = metadata.get_all("Requires-Dist") or []
    unconditional = {re.split(r"[<>=!~,; \[]", r, maxsplit=1)[0].lower()  # the name alone
                     for r in requires if ";" not in r}
    assert unconditional == BASE_DEPS
    torch_markers = {r.split(";")[1].strip() for r in requires if r.startswith("torch")}
    assert "extra == 'copy'" in torch_markers
    assert "vllm-offload = vllm_offload_cli.__main__:main" in entry_points
    assert "vllm_offload = vllm_offload_cli.engine.plugin:register" in entry_points


@pytest.mark.slow  # a fresh venv or a build, once per session
def test_sdist_carries_what_the_wheel_is_built_from(dists: dict[str, Path]) -> None:
    root = f"vllm_offload-{__version__}"
    with tarfile.open(dists["sdist"]) as t:
        names = {n.removeprefix(root + "/") for n in t.getnames()}
        member = t.extractfile(f"{root}/LICENSE")
        assert member is not None and member.read() == (REPO / "LICENSE").read_bytes()
    assert {"LICENSE", "pyproject.toml", "README.md", *SHARED_DATA} <= names


def test_license_is_the_full_apache_text() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0")
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190


@pytest.mark.slow  # a fresh venv or a build, once per session
def test_twine_check_passes(dists: dict[str, Path]) -> None:
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict",
                           str(dists["sdist"]), str(dists["wheel"])],
                          capture_output=True, text=True, timeout=120, env=venv_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2
