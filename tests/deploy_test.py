#!/usr/bin/env python3
"""Checks deploy/ against the code it deploys: the Prometheus config and rules pass promtool
and every alert's unit tests (one case that fires, one that does not),
every metric the alerts and the Grafana dashboard query is one llava-server exports, every
setting of the Kubernetes ConfigMap is a llava-server flag, and the manifests agree with each
other (ports, labels, grace period).

usage: deploy_test.py SOURCE_DIR LLAVA_SERVER_BINARY
"""
import json
import os
import re
import subprocess
import sys

import yaml

SRC, SERVER = sys.argv[1], sys.argv[2]
DEPLOY = os.path.join(SRC, "deploy")
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)


def read(*parts):
    with open(os.path.join(SRC, *parts)) as f:
        return f.read()


# --- metrics the server registers (server/metrics.cc) --------------------------------------
exported = set(re.findall(r'"((?:llava|process)_[a-z0-9_]+)"', read("server", "metrics.cc")))
check(len(exported) >= 15, f"found only {len(exported)} metric names in server/metrics.cc")
GRPC_CODES = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
              "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
              "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
              "UNAUTHENTICATED"}


def check_queries(text, where):
    names = {re.sub(r"_(bucket|sum|count)$", "", m) if m not in exported else m
             for m in re.findall(r"\b(?:llava|process)_[a-z0-9_]+", text)}
    check(names, f"{where}: queries no llava_ metric")
    for n in sorted(names - exported):
        failures.append(f"{where}: queries {n}, which llava-server does not export")
    for codes in re.findall(r'code=~?"([^"]+)"', text):
        for c in codes.split("|"):
            check(c in GRPC_CODES, f"{where}: code {c!r} is not a gRPC status code name")


# --- Prometheus -------------------------------------------------------------------------------
r = subprocess.run(["promtool", "check", "config", os.path.join(DEPLOY, "prometheus", "prometheus.yml")],
                   capture_output=True, text=True)
check(r.returncode == 0, "promtool check config failed:\n" + r.stdout + r.stderr)
check_queries(read("deploy", "prometheus", "alerts.yml"), "alerts.yml")
rules = yaml.safe_load(read("deploy", "prometheus", "alerts.yml"))
alerts = set()
for g in rules["groups"]:
    for rule in g["rules"]:
        check("summary" in rule.get("annotations", {}), f"alert {rule.get('alert')} has no summary")
        alerts.add(rule.get("alert"))
# The alerts' unit tests pass, and each alert has one case that fires and one that does not.
r = subprocess.run(["promtool", "test", "rules", "alerts_test.yml"],
                   cwd=os.path.join(DEPLOY, "prometheus"), capture_output=True, text=True)
check(r.returncode == 0, "promtool test rules alerts_test.yml failed:\n" + r.stdout + r.stderr)
fires, quiet = set(), set()
for t in yaml.safe_load(read("deploy", "prometheus", "alerts_test.yml"))["tests"]:
    for case in t.get("alert_rule_test", []):
        (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
for a in sorted(alerts):
    check(a in fires, f"alerts_test.yml: no case in which {a} fires")
    check(a in quiet, f"alerts_test.yml: no case in which {a} stays quiet")

# --- Grafana ----------------------------------------------------------------------------------
dash = json.loads(read("deploy", "grafana", "llava-dashboard.json"))
ids = [p["id"] for p in dash["panels"]]
check(len(ids) == len(set(ids)), "dashboard: duplicate panel ids")
exprs = []
for p in dash["panels"]:
    if p["type"] == "row":
        continue
    targets = [t.get("expr", "") for t in p.get("targets", [])]
    check(targets and all(targets), f"dashboard panel {p['title']!r} has an empty query")
    exprs += targets
check_queries("\n".join(exprs), "llava-dashboard.json")
check(any("llava_kv_cache_budget_bytes" in e for e in exprs), "dashboard does not show the KV budget")

# --- Kubernetes: every overlay as kubectl renders it ----------------------------------------
K8S = os.path.join(DEPLOY, "kubernetes")
flags = subprocess.run([SERVER, "--help"], capture_output=True, text=True).stdout


def render(overlay):
    r = subprocess.run(["kubectl", "kustomize", os.path.join(K8S, "overlays", overlay)],
                       capture_output=True, text=True)
    check(r.returncode == 0, f"kubectl kustomize overlays/{overlay} failed: {r.stderr}")
    docs = {}
    for d in yaml.safe_load_all(r.stdout) if r.returncode == 0 else []:
        if not d:
            continue
        check("apiVersion" in d and "kind" in d and "name" in d.get("metadata", {}),
              f"{overlay}: an object without apiVersion, kind or name")
        check(d.get("metadata", {}).get("namespace", "llava") == "llava" or d["kind"] == "Namespace",
              f"{overlay}: {d['kind']} {d['metadata'].get('name')} outside the llava namespace")
        docs.setdefault(d["kind"], []).append(d)
    return docs


GPU_WEIGHT_BYTES = {"llava-1.5-7b-hf": 7_063_427_072 * 2}


def check_overlay(overlay, docs):
    config = next(c for c in docs["ConfigMap"] if c["metadata"]["name"] == "llava-server")["data"]
    for key, value in config.items():
        check(key.startswith("LLAVA_"), f"{overlay}: ConfigMap key {key} is not an LLAVA_ setting")
        flag = "--" + key[len("LLAVA_"):].lower().replace("_", "-")
        check(re.search(re.escape(flag) + r"\b", flags) is not None,
              f"{overlay}: ConfigMap key {key}: llava-server has no flag {flag}")
        check(isinstance(value, str), f"{overlay}: ConfigMap value of {key} must be a string")

    deploy = docs["Deployment"][0]
    pod = deploy["spec"]["template"]
    check(deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items(),
          "Deployment selector does not match the pod labels")
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    check(ports.get("grpc") == int(config["LLAVA_LISTEN"].rsplit(":", 1)[1]),
          "container port grpc differs from LLAVA_LISTEN")
    check(ports.get("metrics") == int(config["LLAVA_METRICS_LISTEN"].rsplit(":", 1)[1]),
          "container port metrics differs from LLAVA_METRICS_LISTEN")
    check(ports.get("http") == int(config["LLAVA_HTTP_LISTEN"].rsplit(":", 1)[1]),
          "container port http differs from LLAVA_HTTP_LISTEN")
    # TLS and token files come from mounted Secrets, and the kubelet's gRPC probes cannot speak
    # TLS: with it on, the probes must read /healthz.
    mounts = [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts", [])]
    for key in ("LLAVA_TLS_CERT", "LLAVA_TLS_KEY", "LLAVA_TLS_CLIENT_CA", "LLAVA_AUTH_TOKENS_FILE"):
        if key in config:
            check(any(config[key].startswith(m) for m in mounts),
                  f"{overlay}: {key}={config[key]} lies on no mounted volume")
    if "LLAVA_TLS_CERT" in config:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            check("grpc" not in container.get(probe, {}),
                  f"{overlay}: {probe} uses gRPC, which the kubelet cannot speak over TLS")
    check(pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"]),
          "prometheus.io/port annotation differs from the metrics port")
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    check(pre_stop[:1] == ["sleep"], "container has no preStop sleep (endpoints update before SIGTERM)")
    pre_stop_s = float(pre_stop[1]) if len(pre_stop) > 1 else 0
    # After the drain the server closes its ports in up to 4 s (server/main.cc: gRPC 2 s, then
    # the HTTP streams' last chunks 2 s).
    check(pod["spec"]["terminationGracePeriodSeconds"] >=
          pre_stop_s + float(config["LLAVA_SHUTDOWN_GRACE_SECONDS"]) + 4,
          "terminationGracePeriodSeconds must cover the preStop sleep + "
          "LLAVA_SHUTDOWN_GRACE_SECONDS + 4 s to close the ports")
    # Pod Security "restricted" and least privilege.
    check(pod["spec"].get("automountServiceAccountToken") is False,
          "the pod mounts a service-account token it never uses")
    check(pod["spec"].get("securityContext", {}).get("seccompProfile", {}).get("type") == "RuntimeDefault",
          "the pod has no RuntimeDefault seccompProfile (Pod Security restricted)")
    sc = container.get("securityContext", {})
    check(sc.get("allowPrivilegeEscalation") is False and sc.get("readOnlyRootFilesystem") is True
          and sc.get("capabilities", {}).get("drop") == ["ALL"],
          "container securityContext: no privilege escalation, read-only root, all capabilities dropped")
    spread = pod["spec"].get("topologySpreadConstraints", [])
    check(any(c["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
              for c in spread), "no topology spread over the server's pods")
    for np in docs.get("NetworkPolicy", []):
        check(np["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items(),
              f"{overlay}: NetworkPolicy {np['metadata']['name']} selects no llava-server pod")
        for rule in np["spec"].get("ingress", []):
            for p in rule.get("ports", []):
                check(p["port"] in ports, f"{overlay}: NetworkPolicy {np['metadata']['name']}: unknown port {p['port']}")
    check("NetworkPolicy" in docs, "no NetworkPolicy")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = container.get(probe)
        check(p is not None, f"{overlay}: container has no {probe}")
        if p and "grpc" in p:
            check(p["grpc"]["port"] in ports.values(), f"{overlay}: {probe} uses a port the container lacks")
        if p and "httpGet" in p:
            check(p["httpGet"]["port"] in ports, f"{overlay}: {probe} uses a port name the container lacks")
            check(p["httpGet"]["path"] == "/healthz", f"{overlay}: {probe} should probe /healthz")
    for svc in docs["Service"]:
        check(svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items(),
              f"{overlay}: Service {svc['metadata']['name']} selects no llava-server pod")
        for p in svc["spec"]["ports"]:
            check(p["targetPort"] in ports, f"{overlay}: Service {svc['metadata']['name']}: unknown targetPort")
    return ports, config


overlays = sorted(os.listdir(os.path.join(K8S, "overlays")))
check({"cpu", "operator", "gpu"} <= set(overlays), f"overlays: {overlays} lacks cpu, operator or gpu")
rendered = {o: render(o) for o in overlays}
check("keda" in overlays, "no overlays/keda")
for overlay, docs in rendered.items():
    ports, config = check_overlay(overlay, docs)
    deployment = docs["Deployment"][0]["metadata"]["name"]
    image = docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["image"]
    check("/" in image.split(":")[0], f"{overlay}: image {image} names no registry")
    # Memory: the limit holds at least the KV budget (the weights come on top, deploy/README.md).
    pod_spec = docs["Deployment"][0]["spec"]["template"]["spec"]
    res = pod_spec["containers"][0]["resources"]
    gib = {"Gi": 1.0, "Mi": 1 / 1024}
    limit = float(res["limits"]["memory"][:-2]) * gib[res["limits"]["memory"][-2:]]
    kv_gib = float(config.get("LLAVA_KV_CACHE_GIB", "0"))
    gpus = int(res["limits"].get("nvidia.com/gpu", 0))
    if not config.get("LLAVA_DEVICE", "cpu").startswith("cuda"):
        check(gpus == 0, f"{overlay}: asks for a GPU but runs on the CPU (LLAVA_DEVICE)")
        check(limit > kv_gib, f"{overlay}: memory limit {res['limits']['memory']} below the KV budget")
    else:
        # On a GPU the weights and the KV cache live in the GPU's memory: one GPU, a node
        # affinity on NVIDIA's gpu.memory label (MiB) that holds weights + KV budget + 3 GiB
        # (deploy/README.md, "A GPU per pod"), and the GPU nodes' taint tolerated.
        check(gpus == 1 and int(res["requests"].get("nvidia.com/gpu", 0)) == 1,
              f"{overlay}: LLAVA_DEVICE={config['LLAVA_DEVICE']} without nvidia.com/gpu: 1")
        check("cuda" in image, f"{overlay}: runs on CUDA with the CPU image {image}")
        # bf16 weight bytes of the checkpoints a GPU overlay may name (deploy/README.md,
        # "Sizing memory and CPU"); another folder must be added here with its size.
        model = config.get("LLAVA_MODEL", "").rstrip("/").rsplit("/", 1)[-1]
        check(model in GPU_WEIGHT_BYTES, f"{overlay}: no weight size known for {model}")
        weights_gib = GPU_WEIGHT_BYTES.get(model, 0) / 2**30
        terms = (pod_spec.get("affinity", {}).get("nodeAffinity", {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution", {})
                 .get("nodeSelectorTerms", []))
        gpu_mib = [int(e["values"][0]) for t in terms for e in t.get("matchExpressions", [])
                   if e["key"] == "nvidia.com/gpu.memory" and e["operator"] == "Gt"]
        check(len(gpu_mib) == 1 and gpu_mib[0] / 1024 >= weights_gib + kv_gib + 3,
              f"{overlay}: no node affinity for a GPU holding {weights_gib:.1f} GiB of weights "
              f"+ {kv_gib} GiB of KV + 3 GiB (nvidia.com/gpu.memory: {gpu_mib})")
        check(any(t.get("key") == "nvidia.com/gpu" and t.get("operator") == "Exists"
                  for t in pod_spec.get("tolerations", [])),
              f"{overlay}: the GPU nodes' nvidia.com/gpu taint is not tolerated")
    # Exactly one autoscaler, aimed at the Deployment.
    hpas, scaled = docs.get("HorizontalPodAutoscaler", []), docs.get("ScaledObject", [])
    check(len(hpas) + len(scaled) == 1,
          f"{overlay}: {len(hpas)} HorizontalPodAutoscalers and {len(scaled)} ScaledObjects")
    for h in hpas:
        check(h["spec"]["scaleTargetRef"]["name"] == deployment, f"{overlay}: HPA aims elsewhere")
    for so in scaled:
        check(so["spec"]["scaleTargetRef"]["name"] == deployment,
              f"{overlay}: ScaledObject aims elsewhere")
        kinds = [t["type"] for t in so["spec"]["triggers"]]
        check("prometheus" in kinds and "cpu" in kinds,
              f"{overlay}: ScaledObject needs Prometheus triggers and the CPU fallback")
        for t in so["spec"]["triggers"]:
            if t["type"] == "prometheus":
                check_queries(t["metadata"]["query"], f"{overlay}: ScaledObject")
                check(float(t["metadata"]["threshold"]) > 0, f"{overlay}: ScaledObject threshold")
operator = rendered.get("operator", {})
for name in ("operator", "keda", "gpu"):
    check("PodMonitor" in rendered.get(name, {}) and "PrometheusRule" in rendered.get(name, {}),
          f"overlays/{name} renders no PodMonitor or PrometheusRule")
for pm in operator.get("PodMonitor", []):
    pod_labels = operator["Deployment"][0]["spec"]["template"]["metadata"]["labels"]
    check(pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items(),
          "PodMonitor selects no llava-server pod")
    for e in pm["spec"]["podMetricsEndpoints"]:
        check(e["port"] in ports, f"PodMonitor scrapes unknown port {e['port']}")
for pr in operator.get("PrometheusRule", []):
    check(pr["spec"]["groups"] == rules["groups"],
          "deploy/kubernetes/monitoring/prometheusrule.yaml differs from deploy/prometheus/alerts.yml (scripts/sync_deploy.py)")
for name in ("operator", "keda"):
    boards = [c for c in rendered.get(name, {}).get("ConfigMap", [])
              if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    check(len(boards) == 1 and json.loads(boards[0]["data"]["llava-dashboard.json"]) == dash,
          f"overlays/{name}: no dashboard ConfigMap for Grafana's sidecar equal to "
          "deploy/grafana/llava-dashboard.json (scripts/sync_deploy.py)")
docs = operator
for name in ("Dockerfile", "Dockerfile.cuda"):
    text = read(name)
    # Flags on the command line win over LLAVA_* variables: the image must not pass any.
    check(not re.search(r"^(CMD|ENTRYPOINT)[^\n]*--", text, re.M),
          f"{name} passes server flags that would override the ConfigMap's LLAVA_* settings")
    for port in ports.values():
        check(re.search(rf"EXPOSE[^\n]*\b{port}\b", text) is not None,
              f"{name} does not EXPOSE {port}")
    health = re.search(r"^HEALTHCHECK [^\n]*\\\n[^\n]*", text, re.M)
    check(health is not None and "/healthz" in health.group(0)
          and "LLAVA_METRICS_LISTEN" in health.group(0),
          f"{name}: no HEALTHCHECK reading /healthz on the LLAVA_METRICS_LISTEN port")
    for key in re.findall(r"\b(LLAVA_[A-Z_]+)=", text):
        check(key.startswith("LLAVA_DEPS_") or
              re.search(re.escape("--" + key[len("LLAVA_"):].lower().replace("_", "-")) + r"\b",
                        flags) is not None,
              f"{name} sets {key}, which is no llava-server flag")
cuda_dockerfile = read("Dockerfile.cuda")
check("-DLLAVA_WITH_CUDA=ON" in cuda_dockerfile and "LLAVA_DEVICE=cuda" in cuda_dockerfile,
      "Dockerfile.cuda does not build the CUDA kernels or does not run on the GPU")
dockerfile = read("Dockerfile")
ignored = read(".dockerignore").split()
for path in ("build", ".git", "**/node_modules"):
    check(path in ignored, f".dockerignore does not leave out {path}")

# --- deploy/compose: the local stack -----------------------------------------------------------
# Docker is not on these machines, so the stack is checked by its wiring: every mounted file
# exists, Prometheus' config as the container sees it (the mounts laid out in a temporary
# /etc/prometheus) passes promtool, it scrapes the server's metrics port by its service name,
# Grafana's data source is that Prometheus and its dashboard provider reads the mounted dashboard,
# and the server publishes every port the image listens on.
import shutil
import tempfile

compose_dir = os.path.join(DEPLOY, "compose")
compose = yaml.safe_load(read("deploy", "compose", "compose.yaml"))
services = compose["services"]
mounts = {}  # container path -> host path, per service
for name, svc in services.items():
    mounts[name] = {}
    for v in svc.get("volumes", []):
        host, target = v.split(":")[:2]
        host = os.path.normpath(os.path.join(compose_dir, host))
        check(os.path.isfile(host), f"compose: {name} mounts {v}, which does not exist")
        mounts[name][target] = host
image_env = dict(re.findall(r"(LLAVA_[A-Z_]+)=(\S+)", dockerfile))
server_svc = services["llava-server"]
check(os.path.normpath(os.path.join(compose_dir, server_svc["build"]["context"])) == os.path.normpath(SRC),
      "compose: llava-server is not built from the repository's Dockerfile")
published = {int(p.split(":")[1]) for p in server_svc["ports"]}
for key in ("LLAVA_LISTEN", "LLAVA_HTTP_LISTEN", "LLAVA_METRICS_LISTEN"):
    port = int(image_env.get(key, "x:0").rsplit(":", 1)[1])
    check(port in published, f"compose: llava-server does not publish {key}'s port {port}")
for key in server_svc.get("environment", {}):
    check(key in config, f"compose: llava-server sets {key}, which the ConfigMap (and so the "
                         "flag check above) does not know")
prom = services["prometheus"]
prom_args = dict(a.lstrip("-").split("=", 1) for a in prom["command"])
prom_listen = int(prom_args["web.listen-address"].rsplit(":", 1)[1])
with tempfile.TemporaryDirectory() as root:
    for target, host in mounts["prometheus"].items():
        dest = os.path.join(root, target.lstrip("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy(host, dest)
    conf_path = os.path.join(root, prom_args["config.file"].lstrip("/"))
    conf = yaml.safe_load(open(conf_path))
    # Rule paths are absolute in the container: point them into the temporary root.
    conf["rule_files"] = [os.path.join(root, f.lstrip("/")) for f in conf["rule_files"]]
    with open(conf_path, "w") as f:
        yaml.safe_dump(conf, f)
    r = subprocess.run(["promtool", "check", "config", conf_path], capture_output=True, text=True)
    check(r.returncode == 0, "compose: promtool check config failed:\n" + r.stdout + r.stderr)
targets = [t for job in conf["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
metrics_port = image_env["LLAVA_METRICS_LISTEN"].rsplit(":", 1)[1]
check(targets == [f"llava-server:{metrics_port}"],
      f"compose: Prometheus scrapes {targets}, not llava-server:{metrics_port}")
check(any(re.fullmatch(m, job["job_name"]) for job in conf["scrape_configs"]
          for m in re.findall(r'up\{job=~"([^"]+)"\}', read("deploy", "prometheus", "alerts.yml"))),
      "compose: the scrape job's name escapes LlavaServerDown's job selector")
check(f"{prom_listen}:{prom_listen}" in prom["ports"], "compose: Prometheus' port is not published")
graf = services["grafana"]
ds = yaml.safe_load(open(mounts["grafana"]["/etc/grafana/provisioning/datasources/llava.yml"]))
check(ds["datasources"][0]["url"] == f"http://prometheus:{prom_listen}",
      f"compose: Grafana's data source is {ds['datasources'][0]['url']}")
providers = yaml.safe_load(open(next(h for t, h in mounts["grafana"].items()
                                     if t.startswith("/etc/grafana/provisioning/dashboards/"))))
dash_dir = providers["providers"][0]["options"]["path"]
check(any(os.path.dirname(t) == dash_dir and h.endswith("llava-dashboard.json")
          for t, h in mounts["grafana"].items()),
      f"compose: no dashboard mounted in {dash_dir}, the folder Grafana's provider reads")

if failures:
    print("\n".join("FAIL: " + f for f in failures))
    sys.exit(1)
print(f"deploy/ consistent: {len(exported)} exported metrics, {len(exprs)} dashboard queries, "
      f"{sum(len(v) for v in docs.values())} Kubernetes documents, {len(config)} settings")
