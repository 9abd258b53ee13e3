"""deploy/k8s/kustomization.yaml and the GPU overlay deploy/k8s-gpu/, rendered with `kubectl
kustomize` (offline; no cluster). The base renders exactly the objects of the plain files. The
overlay changes the vLLM containers and nothing else but one toleration: the CUDA image, a GPU
each, no vLLM-CPU settings, a memory-backed /dev/shm apart from the pool's own directory, a
toleration of the GPU nodes' taint (shared with the host pool's DaemonSet, which those pods need
on their node). test_k8s.py runs its structural checks on the overlay's objects as well."""

from __future__ import annotations

import copy
import sys
from pathlib import PurePosixPath

import pytest
import yaml

from deployfiles import DOC, K8S, K8S_GPU, KUSTOMIZATION, container_argv, image_name, manifests, memory_bytes
from deployfiles import rendered

GPU = "nvidia.com/gpu"
TOLERATION = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
VLLM_WORKLOADS = {("Deployment", "vllm-host-pool"), ("StatefulSet", "vllm-mooncake")}
VLLM = ["python", "-m", "vllm.entrypoints.openai.api_server"]


def by_key(docs: list[tuple[str, dict]]) -> dict[tuple[str, str], dict]:
    out: dict[tuple[str, str], dict] = {}
    for _, doc in docs:
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in out, f"{key} twice"
        out[key] = doc
    return out


def base() -> dict[tuple[str, str], dict]:
    return by_key(rendered(K8S))


def gpu() -> dict[tuple[str, str], dict]:
    return by_key(rendered(K8S_GPU))


def spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def vllm_container(workload: dict) -> dict:
    (c,) = [c for c in spec(workload)["containers"] if container_argv(c)[:3] == VLLM]
    return c


def env_names(container: dict) -> set[str]:
    return {e["name"] for e in container.get("env", [])}


def test_the_base_kustomization_lists_every_manifest_and_nothing_else():
    listed = yaml.safe_load((K8S / KUSTOMIZATION).read_text())
    files = sorted(p.name for p in K8S.glob("*.yaml") if p.name != KUSTOMIZATION)
    assert sorted(listed["resources"]) == files
    # Resources only: a transformer (namespace, labels, images ...) would change the objects.
    assert set(listed) == {"apiVersion", "kind", "resources"}, set(listed)


def test_the_base_renders_exactly_the_objects_of_the_plain_files():
    assert base() == by_key(manifests())


def test_the_overlay_builds_on_the_base_and_renders_the_same_objects():
    overlay = yaml.safe_load((K8S_GPU / KUSTOMIZATION).read_text())
    assert overlay["resources"] == ["../k8s"]
    assert set(gpu()) == set(base())


def test_the_overlays_vllm_containers_run_the_cuda_image_on_a_gpu_each_without_vllm_cpu_settings():
    for key in VLLM_WORKLOADS:
        w = gpu()[key]
        c = vllm_container(w)
        assert c["image"] == f"{image_name()}-cuda", key
        assert c["resources"]["limits"][GPU] == 1, key
        assert not {n for n in env_names(c) if n.startswith("VLLM_CPU_")}, key
        # vLLM's own default for the GPU memory it takes: the pool needs none of it.
        assert not any(a.startswith("--gpu-memory-utilization") for a in container_argv(c)), key
        assert TOLERATION in spec(w)["tolerations"], key


def test_the_overlays_vllm_pods_have_a_memory_backed_dev_shm_apart_from_the_pools_directory():
    for key in VLLM_WORKLOADS:
        w = gpu()[key]
        c = vllm_container(w)
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (vol,) = [v for v in spec(w)["volumes"] if v["name"] == mount["name"]]
        assert vol["emptyDir"]["medium"] == "Memory", vol
        # Charged to the pod's memory: it must fit in the limit.
        assert memory_bytes(vol["emptyDir"]["sizeLimit"]) < memory_bytes(c["resources"]["limits"]["memory"])
        # The pool's arena is in KVPOOL_SHM_DIR, the node's directory: not inside this mount, not above it.
        for e in c.get("env", []):
            if e["name"] == "KVPOOL_SHM_DIR":
                shm_dir = PurePosixPath(e["value"])
                assert not shm_dir.is_relative_to("/dev/shm") and not PurePosixPath("/dev/shm").is_relative_to(shm_dir)
                (pool,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(shm_dir)]
                (pool_vol,) = [v for v in spec(w)["volumes"] if v["name"] == pool["name"]]
                assert pool_vol["hostPath"]["path"] == "/dev/shm/kvpool"


def test_the_overlay_changes_nothing_else():
    before, after = base(), gpu()
    for key, doc in after.items():
        doc = copy.deepcopy(doc)
        if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            # The toleration: the vLLM pods' and the host pool's, which those pods need on their node.
            tolerations = spec(doc).pop("tolerations", [])
            if key in VLLM_WORKLOADS or key == ("DaemonSet", "kvpool-server"):
                assert tolerations == [TOLERATION], key
            else:
                assert tolerations == [], key
        if key in VLLM_WORKLOADS:
            # Undo what the previous tests checked; everything else must be the base's.
            c, was = vllm_container(doc), vllm_container(before[key])
            shm = {m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"}
            c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] not in shm]
            spec(doc)["volumes"] = [v for v in spec(doc)["volumes"] if v["name"] not in shm]
            del c["resources"]["limits"][GPU]
            c["image"] = was["image"]
            assert c["env"] == [e for e in was["env"] if not e["name"].startswith("VLLM_CPU_")], key
            c["env"] = was["env"]
        assert doc == before[key], key


def test_only_the_vllm_containers_change_image_and_the_rest_keep_the_cpu_one():
    # The `kvpool doctor` init container too: the CUDA build of Mooncake's client needs the GPU
    # driver's library, which a container without a GPU does not get; the CPU build checks the
    # same config against the same master.
    images = {}
    for (kind, name), doc in gpu().items():
        if kind in ("Deployment", "StatefulSet", "DaemonSet"):
            for c in spec(doc).get("initContainers", []) + spec(doc)["containers"]:
                images[(name, c["name"])] = c["image"]
    cuda = {k for k, image in images.items() if image == f"{image_name()}-cuda"}
    assert cuda == {(name, "vllm") for _, name in VLLM_WORKLOADS}
    assert set(images.values()) == {image_name(), f"{image_name()}-cuda"}


def test_every_file_of_the_overlay_is_used_by_its_kustomization():
    overlay = yaml.safe_load((K8S_GPU / KUSTOMIZATION).read_text())
    used = {KUSTOMIZATION} | {p["path"] for p in overlay["patches"]}
    assert {p.name for p in K8S_GPU.iterdir()} == used


def test_the_page_says_how_to_build_and_apply_the_gpu_variant():
    text = DOC.read_text()
    assert f"docker build -f deploy/Dockerfile.cuda -t {image_name()}-cuda ." in text
    assert "kubectl apply -k deploy/k8s-gpu" in text and "kubectl apply -k deploy/k8s" in text


def test_a_change_to_the_overlay_would_be_caught(monkeypatch):
    # The comparison above is the check: one more change, to an object the overlay leaves alone, fails it.
    real = rendered

    def changed(directory):
        docs = real(directory)
        if directory == K8S_GPU:
            proxy = next(doc for _, doc in docs if doc["metadata"]["name"] == "kvpool-proxy" and doc["kind"] == "Deployment")
            spec(proxy)["containers"][0]["args"].append("--verbose")
        return docs

    monkeypatch.setattr(sys.modules[__name__], "rendered", changed)
    with pytest.raises(AssertionError, match="kvpool-proxy"):
        test_the_overlay_changes_nothing_else()
