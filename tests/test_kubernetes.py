"""The Kubernetes DaemonSet in contrib/kubernetes parses, is least-privilege as its
README says, and runs a gc command line our CLI accepts and carries out."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from region_files import region_file

MANIFEST = Path(__file__).resolve().parent.parent / "contrib" / "kubernetes" / \
    "vllm-offload-gc.yaml"
NEEDED_CAPS = {"SYS_PTRACE", "DAC_READ_SEARCH", "FOWNER", "LEASE"}


def _docs() -> list[dict[str, Any]]:
    with MANIFEST.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _daemonset() -> dict[str, Any]:
    (ds,) = [d for d in _docs() if d["kind"] == "DaemonSet"]
    return ds


def _container() -> dict[str, Any]:
    (container,) = _daemonset()["spec"]["template"]["spec"]["containers"]
    return container


def _script() -> str:
    c = _container()
    assert c["command"] == ["/bin/sh", "-c"]
    (script,) = c["args"]
    assert isinstance(script, str)
    return script


def _gc_argv() -> list[str]:
    [line] = [ln for ln in _script().splitlines() if "vllm-offload garbage-collect" in ln]
    words = shlex.split(line.split("||")[0])
    assert words[0] == "vllm-offload"
    return words[1:]


def test_every_document_parses_with_kind_and_name() -> None:
    docs = _docs()
    assert [d["kind"] for d in docs] == ["Namespace", "ServiceAccount", "DaemonSet"]
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"]
    ds = _daemonset()
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_pod_sees_the_hosts_processes_and_shm() -> None:
    pod = _daemonset()["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    assert pod["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in _container()["volumeMounts"]}
    assert volumes["shm"]["hostPath"]["path"] == "/dev/shm"
    assert mounts["shm"]["mountPath"] == "/dev/shm"
    assert volumes["textfile"]["hostPath"]["path"] == "/var/lib/prometheus/node-exporter"
    prom = _gc_argv()[_gc_argv().index("--prometheus") + 1]
    assert prom.startswith(mounts["textfile"]["mountPath"] + "/")
    env = {e["name"]: e["value"] for e in _container()["env"]}
    assert env["VLLM_OFFLOAD_SHM_DIR"] == "/dev/shm"


def test_least_privilege() -> None:
    c = _container()
    sc = c["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == NEEDED_CAPS
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    limits = c["resources"]["limits"]
    assert limits["cpu"] and limits["memory"]
    assert c["resources"]["requests"]["memory"]
    readme = (MANIFEST.parent / "README.md").read_text()
    for cap in NEEDED_CAPS:
        assert f"`{cap}`" in readme  # each one explained
    assert "hostPID: true" in readme and "exit 6" in readme


def test_loop_script_is_valid_shell() -> None:
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh")
    proc = subprocess.run([sh, "-n", "-c", _script()], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "sleep" in _script() and "while true" in _script()


def test_the_command_it_runs_is_ours_and_works(cli: Any, shm_dir: Path,
                                                tmp_path: Path) -> None:
    argv = _gc_argv()
    assert argv[0] in ("garbage-collect", "gc")
    prom_at = argv.index("--prometheus") + 1
    prom = tmp_path / "gc.prom"
    argv[prom_at] = str(prom)
    region_file(shm_dir, "leaked")

    result = cli(*argv, "--min-age", "0", env={"VLLM_OFFLOAD_SHM_DIR": str(shm_dir)})

    assert result.exit_code == 0, result.stdout + result.stderr
    assert not (shm_dir / "vllm_offload_leaked.mmap").exists()
    assert "vllm_offload_gc_regions_removed 1.0" in prom.read_text()
    again = cli(*argv, env={"VLLM_OFFLOAD_SHM_DIR": str(shm_dir)})
    assert again.exit_code == 0 and again.stdout == ""  # --quiet: silent when idle


CONTAINERFILE = MANIFEST.parent / "Containerfile"


def _containerfile() -> list[tuple[str, str]]:
    from tests.test_packaging import containerfile_steps
    return containerfile_steps()


def test_the_manifest_runs_the_image_the_containerfile_builds() -> None:
    """One tag, pinned to this version, in the build command and the DaemonSet."""
    from vllm_offload_cli import __version__

    image = _container()["image"]
    assert image.endswith(f"/vllm-offload:{__version__}")
    build = f"-f contrib/kubernetes/Containerfile -t {image} ."
    assert build in CONTAINERFILE.read_text()
    assert build in (MANIFEST.parent / "README.md").read_text()
    assert "./Containerfile" in MANIFEST.read_text()


def test_containerfile_is_slim_non_root_and_fits_a_read_only_root() -> None:
    steps = _containerfile()
    (base,) = [args for instruction, args in steps if instruction == "FROM"]
    assert base.startswith("docker.io/library/python:3.") and base.endswith("-slim")
    (user,) = [args for instruction, args in steps if instruction == "USER"]
    assert int(user.split(":")[0]) != 0  # the DaemonSet chooses uid 0 itself, and says why
    env = " ".join(args for instruction, args in steps if instruction == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env  # nothing tries to write to the root fs
    assert ("ENTRYPOINT", '["vllm-offload"]') in steps
    sc = _container()["securityContext"]
    assert sc["runAsUser"] == 0 and sc["readOnlyRootFilesystem"] is True
    readme = (MANIFEST.parent / "README.md").read_text()
    assert "Why uid 0, not a non-root user" in readme and "no_new_privs" in readme


# -- valid on every Kubernetes version the README names ------------------------------

BEFORE_130 = MANIFEST.parent / "before-1.30" / "kustomization.yaml"


def _apply_json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 `remove` and `add` (the ops the overlay uses), as kustomize applies them."""
    import copy

    out = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~")
                          for p in op["path"].lstrip("/").split("/")]
        node: Any = out
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "remove":
            del node[last]
        else:
            assert op["op"] == "add", op
            node[last] = op["value"]
    return out


def _before_130() -> list[dict[str, Any]]:
    overlay = yaml.safe_load(BEFORE_130.read_text())
    assert overlay["resources"] == [".."]
    base = yaml.safe_load((MANIFEST.parent / "kustomization.yaml").read_text())
    assert base["resources"] == [MANIFEST.name]
    [patch] = overlay["patches"]
    docs = []
    for d in _docs():
        if d["kind"] == patch["target"]["kind"] and d["metadata"]["name"] == \
                patch["target"]["name"]:
            d = _apply_json_patch(d, yaml.safe_load(patch["patch"]))
        docs.append(d)
    return docs


def _versions(low: str, high: str) -> list[str]:
    from kubernetes_validate.utils import all_versions

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split(".")[:2])

    return sorted({v for v in all_versions() if key(low) <= key(v) <= key(high)}, key=key)


@pytest.mark.parametrize(("which", "low", "high"), [("manifest", "1.30", "1.37"),
                                                      ("before-1.30", "1.26", "1.29")])
def test_valid_on_every_version_the_readme_names(which: str, low: str, high: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    readme = (MANIFEST.parent / "README.md").read_text()
    assert f"Kubernetes {low} to {high}" in readme
    docs = _docs() if which == "manifest" else _before_130()
    versions = _versions(low, high)
    assert versions[0].startswith(low) and versions[-1].startswith(high), versions
    for version in versions:
        for d in docs:
            kubernetes_validate.validate(d, version, strict=True)


def test_before_130_keeps_the_container_apparmor_unconfined() -> None:
    [ds] = [d for d in _before_130() if d["kind"] == "DaemonSet"]
    template = ds["spec"]["template"]
    [container] = template["spec"]["containers"]
    assert "appArmorProfile" not in container["securityContext"]
    assert template["metadata"]["annotations"] == {
        f"container.apparmor.security.beta.kubernetes.io/{container['name']}": "unconfined"}
    assert _container()["securityContext"]["appArmorProfile"] == {"type": "Unconfined"}
