"""deploy/k8s: every manifest parses, and every name, port, probe and flag refers to something that exists —
Service selectors match a workload's pod labels, target ports and probe ports are container ports, mounted
volumes and secrets are declared, $(VARS) in args are defined in env, and the server flags parse with
`dsjax serve`'s own argument parser."""

import os
import re

import yaml

K8S = os.path.join(os.path.dirname(__file__), "..", "deploy", "k8s")


def _docs():
    kust = yaml.safe_load(open(os.path.join(K8S, "kustomization.yaml")))
    files = sorted(f for f in os.listdir(K8S) if f.endswith(".yaml") and f != "kustomization.yaml")
    assert sorted(kust["resources"]) == files, "kustomization.yaml must list every manifest"
    return [d for f in files for d in yaml.safe_load_all(open(os.path.join(K8S, f))) if d]


DOCS = _docs()
WORKLOADS = [d for d in DOCS if d["kind"] in ("Deployment", "StatefulSet")]
SERVICES = {d["metadata"]["name"]: d for d in DOCS if d["kind"] == "Service"}


def _ports(container) -> dict:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _pods_matching(selector):
    return [w for w in WORKLOADS if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]


def test_services_select_workloads_and_ports_exist():
    for name, svc in SERVICES.items():
        pods = _pods_matching(svc["spec"]["selector"])
        assert pods, f"Service {name} selects no workload"
        ports = {n: v for w in pods for c in w["spec"]["template"]["spec"]["containers"] for n, v in _ports(c).items()}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports or p["targetPort"] in ports.values(), f"{name}: {p}"
    for w in WORKLOADS:
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        if w["kind"] == "StatefulSet":
            assert SERVICES[w["spec"]["serviceName"]]["spec"].get("clusterIP") == "None"


def test_probes_volumes_and_env_refer_to_what_exists():
    for w in WORKLOADS:
        spec = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            ports = _ports(c)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe:
                    port = next(v["port"] for v in probe.values() if isinstance(v, dict) and "port" in v)
                    assert port in ports or port in ports.values(), f"{c['name']} {kind} port {port}"
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{c['name']} mounts undeclared volume {m['name']}"
            env = {e["name"] for e in c.get("env", [])}
            for arg in c.get("args", []):
                for var in re.findall(r"\$\((\w+)\)", arg):
                    assert var in env, f"{c['name']}: $({var}) is not in env"


def test_server_flags_parse_and_match_the_manifests():
    from dsjax import cli
    from dsjax.serving.config import ServeConfig

    (server,) = [w for w in WORKLOADS if w["metadata"]["name"] == "dsjax"]
    c = server["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["dsjax", "serve"]
    args = [re.sub(r"\$\(\w+\)", "10.0.0.7", a) for a in c["args"]]
    ns = cli.build_parser().parse_args(["serve", *args])
    ports = _ports(c)
    assert (ns.port, ns.grpc_port, ns.kv_peer_port) == (ports["http"], ports["grpc"], ports["kv-peer"])
    host, port = re.match(r"redis://([\w-]+):(\d+)/", ns.redis_url).groups()
    assert host in SERVICES and int(port) in [p["port"] for p in SERVICES[host]["spec"]["ports"]]
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    for path in (ns.cluster_token_file, ns.api_key_file):
        assert os.path.dirname(path) in mounts
    fields = {k: v for k, v in vars(ns).items() if k in ServeConfig.__dataclass_fields__}
    ServeConfig(**{**fields, "cluster_token": "x" * 32, "model": "tiny-v4"}).validate()
