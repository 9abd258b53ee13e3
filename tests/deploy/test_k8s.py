"""deploy/k8s/: every manifest parses, and together they agree — one image; Services select
one workload each and target ports it declares; probes and mounts name what exists; the host
pool's socket and shared memory are the same node directories, private to the pool's user, in
the DaemonSet and in the vLLM pods; the proxy's instances are the StatefulSet's pods; the
commands are ones kvpool's parsers, `mooncake_master` and (for vLLM) the multi-host test
accept. The checks that take `rendering` run twice: on the files, and on the GPU overlay as
`kubectl kustomize deploy/k8s-gpu` renders it (test_kustomize.py checks what the overlay changes).
No cluster is needed."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import PurePosixPath

import pytest

import deployfiles
import kvpool.backends.mooncake as mooncake
from deployfiles import K8S, K8S_GPU, comment_above, container_argv, container_env, containers, doc_vllm_argv, flag_value
from deployfiles import flag_values, flags_of, image_name, manifests, memory_bytes, mooncake_master_flags, named
from deployfiles import of_kind, parse_kvpool, pod_spec, rendered
from kvpool.config import ServerSettings, from_flags, load_config, parse_size
from kvpool.proxy.config import config_from_args as proxy_config

NAMESPACE = "kvpool"
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet")


@pytest.fixture(params=["files", "k8s-gpu"])
def rendering(request, monkeypatch) -> str:
    """What the checks read (every reader of deployfiles goes through `manifests()`): the files
    of deploy/k8s/, or the objects of the GPU overlay, deploy/k8s-gpu/, as kustomize renders them."""
    if request.param == "k8s-gpu":
        docs = rendered(K8S_GPU)
        monkeypatch.setattr(deployfiles, "manifests", lambda: docs)
    return request.param


def workloads() -> list[dict]:
    return of_kind(*WORKLOADS)


def all_containers() -> list[tuple[dict, dict]]:
    return [(w, c) for w in workloads() for c in containers(w)]


def ports_of(workload: dict) -> dict[str | int, int]:
    """Declared container ports of a workload, by name and by number."""
    out: dict[str | int, int] = {}
    for c in containers(workload, init=False):
        for p in c.get("ports", []):
            out[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                out[p["name"]] = p["containerPort"]
    return out


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def selected_workloads(service: dict) -> list[dict]:
    return [w for w in workloads() if labels_match(service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]


def kv_config(argv: list[str]) -> dict:
    return json.loads(flag_value(argv, "--kv-transfer-config"))


def vllm_containers() -> list[tuple[dict, dict]]:
    return [(w, c) for w, c in all_containers() if container_argv(c)[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]]


def mount_path(container: dict, volume: str) -> str:
    found = [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] == volume]
    assert len(found) == 1, (container["name"], volume)
    return found[0]


def volume(workload: dict, name: str) -> dict:
    found = [v for v in pod_spec(workload).get("volumes", []) if v["name"] == name]
    assert len(found) == 1, (workload["metadata"]["name"], name)
    return found[0]


def memory_volumes_bytes(workload: dict) -> int:
    """What the pod's memory-backed emptyDirs may hold (their sizeLimit), charged to its memory."""
    return sum(memory_bytes(v["emptyDir"]["sizeLimit"]) for v in pod_spec(workload).get("volumes", [])
               if v.get("emptyDir", {}).get("medium") == "Memory")


def mounted_volume_at(workload: dict, container: dict, path: str) -> dict:
    """The volume that holds `path` in `container` (the mount with the longest matching prefix)."""
    best = None
    for m in container.get("volumeMounts", []):
        if PurePosixPath(path).is_relative_to(m["mountPath"]) and (best is None or len(m["mountPath"]) > len(best["mountPath"])):
            best = m
    assert best is not None, f"{path} is on no volume of {container['name']}"
    return volume(workload, best["name"])


# ---- every document ------------------------------------------------------------------------------


def test_every_document_is_a_named_object_in_the_kvpool_namespace(rendering):
    docs = deployfiles.manifests()
    assert docs, "no manifests"
    seen = Counter()
    for name, doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), name
        meta = doc["metadata"]
        if doc["kind"] == "Namespace":
            assert meta["name"] == NAMESPACE
        else:
            assert meta.get("namespace") == NAMESPACE, (name, meta)
        assert meta.get("labels", {}).get("app.kubernetes.io/part-of") == "kvpool", (name, meta)
        seen[(doc["kind"], meta["name"])] += 1
    assert max(seen.values()) == 1, seen
    assert {k for k, _ in seen} >= {"Namespace", "DaemonSet", "Deployment", "StatefulSet", "Service", "ConfigMap"}


def test_every_container_runs_the_one_image():
    images = {c["image"] for _, c in all_containers()}
    assert images == {image_name()}
    assert f"-t {image_name()}" in (K8S.parents[1] / "docs" / "deploy.md").read_text()


def test_every_workload_selects_its_own_pods_and_runs_unprivileged(rendering):
    for w in workloads():
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert labels_match(w["spec"]["selector"]["matchLabels"], labels), w["metadata"]["name"]
        for c in containers(w):
            ctx = c.get("securityContext", {})
            if ctx.get("runAsUser") == 0:
                # Only to hand the node directories to the pool's user; nothing else runs as root.
                argv = container_argv(c)
                assert argv[:2] == ["install", "-d"] and flag_value(argv, "-m") == "0700", argv
                assert flag_value(argv, "-o") == str(pod_spec(w)["securityContext"]["runAsUser"]), argv


def test_every_service_targets_ports_of_the_one_workload_it_selects(rendering):
    for svc in of_kind("Service"):
        chosen = selected_workloads(svc)
        assert len(chosen) == 1, (svc["metadata"]["name"], [w["metadata"]["name"] for w in chosen])
        declared = ports_of(chosen[0])
        for p in svc["spec"]["ports"]:
            assert p.get("targetPort", p["port"]) in declared, (svc["metadata"]["name"], p)
    for sts in of_kind("StatefulSet"):
        svc = named("Service", sts["spec"]["serviceName"])
        assert svc["spec"].get("clusterIP") == "None", "a StatefulSet's serviceName must be a headless Service"
        assert selected_workloads(svc) == [sts]


def test_every_probe_names_a_declared_port_or_runs_a_command_that_parses(rendering):
    for w, c in all_containers():
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            if "exec" in probe:
                argv = probe["exec"]["command"]
                assert argv[0] == "kvpool", argv
                assert parse_kvpool(argv).cmd == "stats"
                continue
            action = probe.get("httpGet") or probe.get("tcpSocket")
            assert action is not None, (c["name"], kind)
            assert action["port"] in ports_of(w), (c["name"], kind, action)


def test_the_servers_have_probes(rendering):
    for w, c in all_containers():
        if c in pod_spec(w).get("initContainers", []):
            continue
        assert "livenessProbe" in c and "readinessProbe" in c, c["name"]


def test_every_mount_names_a_volume_of_its_pod_and_every_volume_is_mounted(rendering):
    for w in workloads():
        volumes = {v["name"]: v for v in pod_spec(w).get("volumes", [])}
        mounted = set()
        for c in containers(w):
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, (w["metadata"]["name"], c["name"], m)
                mounted.add(m["name"])
        assert mounted == set(volumes), (w["metadata"]["name"], set(volumes) - mounted)
        for v in volumes.values():
            if "configMap" in v:
                named("ConfigMap", v["configMap"]["name"])


def test_every_address_that_is_not_loopback_is_explicit_and_says_why():
    for path in sorted(K8S.glob("*.yaml")):
        for needle in ("0.0.0.0", "$(POD_IP)"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if needle in line and not line.lstrip().startswith("#"):
                    why = comment_above(path, line.strip())
                    assert needle in why, f"{path.name}:{n}: {needle} without a comment above saying why"


# ---- the host pool: kvpool-server.yaml and vllm-host-pool.yaml ---------------------------------


def env_value(container: dict, name: str) -> str | None:
    return next((e.get("value") for e in container.get("env", []) if e["name"] == name), None)


def server_container() -> tuple[dict, dict]:
    ds = named("DaemonSet", "kvpool-server")
    return ds, next(c for c in containers(ds, init=False) if c["name"] == "kvpool-server")


def test_the_host_pool_server_command_parses_and_its_socket_is_on_the_socket_volume(rendering):
    ds, c = server_container()
    args = parse_kvpool(container_argv(c))
    assert args.cmd == "server"
    settings = from_flags(args, ServerSettings)
    vol = mounted_volume_at(ds, c, settings.socket_path)
    assert vol["hostPath"]["path"] == "/run/kvpool"
    # The arena is a file in KVPOOL_SHM_DIR: that must be the node directory every pod of the node
    # mounts, and every pod of the host pool must look for it there.
    shm_dir = env_value(c, "KVPOOL_SHM_DIR")
    assert mounted_volume_at(ds, c, f"{shm_dir}/arena")["hostPath"]["path"] == "/dev/shm/kvpool"
    (_, vllm), = [(w, v) for w, v in vllm_containers()
                  if kv_config(container_argv(v))["kv_connector_extra_config"]["backend"] == "server"]
    assert env_value(vllm, "KVPOOL_SHM_DIR") == shm_dir
    for probe in ("livenessProbe", "readinessProbe"):
        assert flag_value(c[probe]["exec"]["command"], "--socket") == settings.socket_path


def test_the_host_pools_directories_are_made_private_to_the_pools_user_before_it_starts(rendering):
    ds, c = server_container()
    init = pod_spec(ds)["initContainers"]
    assert len(init) == 1
    argv = container_argv(init[0])
    made = [a for a in argv[2:] if a.startswith("/")]
    for m in c["volumeMounts"]:
        assert m["mountPath"] in made, m  # the same paths, mounted from the same volumes
        assert mount_path(init[0], m["name"]) == m["mountPath"]
    assert flag_value(argv, "-o") == str(pod_spec(ds)["securityContext"]["runAsUser"])


def test_vllm_on_the_host_pool_mounts_the_servers_node_directories_at_the_same_paths(rendering):
    ds, server = server_container()
    socket = from_flags(parse_kvpool(container_argv(server)), ServerSettings).socket_path
    (w, c), = [(w, c) for w, c in vllm_containers() if kv_config(container_argv(c))["kv_connector_extra_config"]["backend"] == "server"]
    extra = kv_config(container_argv(c))["kv_connector_extra_config"]
    assert extra["server_socket"] == socket
    for m in server["volumeMounts"]:
        theirs = volume(w, next(x["name"] for x in c["volumeMounts"] if x["mountPath"] == m["mountPath"]))
        assert theirs["hostPath"]["path"] == volume(ds, m["name"])["hostPath"]["path"]
        assert theirs["hostPath"]["type"] == "Directory"  # made by the DaemonSet, not by the vLLM pod
    assert pod_spec(w)["securityContext"]["runAsUser"] == pod_spec(ds)["securityContext"]["runAsUser"]


# ---- Mooncake Store: mooncake-master.yaml, vllm-mooncake.yaml, kvpool-proxy.yaml ----------------


def master() -> tuple[dict, dict, list[str]]:
    dep = named("Deployment", "mooncake-master")
    (c,) = containers(dep)
    return dep, c, container_argv(c)


def test_the_master_command_uses_flags_it_has_and_serves_its_declared_port(rendering):
    dep, c, argv = master()
    assert argv[0] == "mooncake_master"
    flags = {a.split("=", 1)[0].lstrip("-") for a in argv[1:]}
    assert flags <= mooncake_master_flags(), flags - mooncake_master_flags()
    assert int(flag_value(argv, "--rpc_port")) == ports_of(dep)["rpc"]
    assert flag_value(argv, "--metrics_host") == "127.0.0.1"
    assert flag_value(argv, "--rpc_address") == "10.244.1.7"  # $(POD_IP), from the downward API
    env = next(e for e in c["env"] if e["name"] == "POD_IP")
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def mooncake_json() -> dict:
    return json.loads(named("ConfigMap", "mooncake-config")["data"]["mooncake.json"])


def test_mooncake_json_loads_and_names_the_masters_service(rendering, monkeypatch, tmp_path):
    raw = mooncake_json()
    assert "local_hostname" not in raw  # kvpool takes the pod's address (vllm-mooncake.yaml says why)
    # No cluster DNS here: the default address lookup is what tests/vllm/test_multihost.py checks.
    monkeypatch.setattr(mooncake, "default_local_hostname", lambda host: "10.244.1.8")
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(raw))
    cfg = mooncake.load_mooncake_config(str(path), {})
    svc = named("Service", "mooncake-master")
    (port,) = svc["spec"]["ports"]
    assert cfg.master_server_address == f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{port['port']}"
    assert selected_workloads(svc) == [master()[0]]
    assert ports_of(master()[0])[port["targetPort"]] == port["port"]


def test_vllm_on_mooncake_reads_the_configmap_and_has_memory_for_its_segment(rendering):
    (w, c), = [(w, c) for w, c in vllm_containers() if kv_config(container_argv(c))["kv_connector_extra_config"]["backend"] == "mooncake"]
    path = container_env(c)["MOONCAKE_CONFIG_PATH"]
    vol = mounted_volume_at(w, c, path)
    assert vol["configMap"]["name"] == "mooncake-config"
    assert PurePosixPath(path).name in named("ConfigMap", "mooncake-config")["data"]
    segment = parse_size("global_segment_size", mooncake_json()["global_segment_size"])
    # On top of vLLM's own: vLLM-CPU's KV cache (a CPU build only) and a memory-backed /dev/shm
    # (the GPU overlay's), which is charged to the pod's memory too.
    kv_cache = int(container_env(c).get("VLLM_CPU_KVCACHE_SPACE", 0)) << 30
    assert memory_bytes(c["resources"]["limits"]["memory"]) >= segment + kv_cache + memory_volumes_bytes(w)
    # The init container checks the same config, with the same file.
    (doctor,) = pod_spec(w)["initContainers"]
    args = parse_kvpool(container_argv(doctor))
    assert args.cmd == "doctor"
    assert json.loads(args.kv_transfer_config) == kv_config(container_argv(c))
    assert container_env(doctor)["MOONCAKE_CONFIG_PATH"] == path
    assert mounted_volume_at(w, doctor, path) == vol


def test_the_proxy_fronts_the_statefulsets_pods_by_their_stable_names(rendering):
    dep = named("Deployment", "kvpool-proxy")
    (c,) = containers(dep)
    argv = container_argv(c)
    config = proxy_config(parse_kvpool(argv), env={})
    assert config.port == ports_of(dep)["http"]
    sts = named("StatefulSet", "vllm-mooncake")
    name, svc = sts["metadata"]["name"], sts["spec"]["serviceName"]
    vllm_port = ports_of(sts)["http"]
    pods = [f"{name}-{i}.{svc}.{NAMESPACE}.svc.cluster.local" for i in range(sts["spec"]["replicas"])]
    assert [(e.host, e.port) for e in config.instances] == [(p, vllm_port) for p in pods]
    assert config.prefillers == config.decoders == ()


def test_the_proxys_liveness_does_not_depend_on_the_instances(rendering):
    (c,) = containers(named("Deployment", "kvpool-proxy"))
    assert "tcpSocket" in c["livenessProbe"]  # /health is 503 while no instance is healthy
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"


# ---- vLLM --------------------------------------------------------------------------------------


def test_every_vllm_pod_uses_only_flags_the_multihost_test_ran_and_a_config_that_loads(rendering, tmp_path):
    ran = flags_of(doc_vllm_argv(tmp_path))
    pods = vllm_containers()
    assert len(pods) == 2
    for w, c in pods:
        argv = container_argv(c)
        assert flags_of(argv) <= ran, flags_of(argv) - ran
        assert int(flag_value(argv, "--port")) == ports_of(w)["http"]
        model = flag_value(argv, "--model")
        assert mounted_volume_at(w, c, model)["persistentVolumeClaim"]["claimName"] == "models"
        kv = kv_config(argv)
        assert kv["kv_connector"] == "KVPoolConnector" and kv["kv_role"] == "kv_both"
        load_config(kv["kv_connector_extra_config"], kv["kv_role"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("mutation", ["socket", "port", "image"])
def test_a_disagreement_between_the_manifests_would_be_caught(mutation, monkeypatch):
    # The checks above read the manifests through `manifests()`; break one fact and they fail.
    import deployfiles

    docs = manifests()

    def broken():
        out = json.loads(json.dumps(docs))
        for _, doc in out:
            if mutation == "socket" and doc["kind"] == "DaemonSet":
                args = pod_spec(doc)["containers"][0]["args"]
                args[args.index("--socket") + 1] = "/run/kvpool/other.sock"
            if mutation == "port" and doc["kind"] == "Service" and doc["metadata"]["name"] == "kvpool-proxy":
                doc["spec"]["ports"][0]["targetPort"] = "metrics"
            if mutation == "image" and doc["kind"] == "StatefulSet":
                pod_spec(doc)["containers"][0]["image"] = "kvpool:latest"
        return out

    monkeypatch.setattr(deployfiles, "manifests", broken)
    check = {"socket": lambda: test_vllm_on_the_host_pool_mounts_the_servers_node_directories_at_the_same_paths("files"),
             "port": lambda: test_every_service_targets_ports_of_the_one_workload_it_selects("files"),
             "image": test_every_container_runs_the_one_image}[mutation]
    with pytest.raises(AssertionError):
        check()
