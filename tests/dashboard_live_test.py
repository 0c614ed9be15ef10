#!/usr/bin/env python3
"""Every Grafana panel query and every metric the alerts read, against a live scrape: starts
llava-server with the default model, a real Prometheus (Debian's `prometheus`) scraping it every
second, and llava-load with images; then runs each dashboard query through Prometheus' HTTP API
(template variables set to "All") and requires a series with a number. A misspelt metric, a
wrong suffix (a gauge queried as `_bucket`) or a label selector that matches nothing fails it.

usage: dashboard_live_test.py SOURCE_DIR BUILD_DIR
"""
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import yaml

SRC, BUILD = sys.argv[1], sys.argv[2]
failures = []


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_for(what, fn, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if fn():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"FAIL: {what} did not come up in {seconds} s")


def query(prom_port, expr):
    url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(get(url))
    if body.get("status") != "success":
        return None, body.get("error", "query failed")
    return body["data"]["result"], None


def has_number(result):
    for series in result:
        value = float(series["value"][1])
        if not math.isnan(value):
            return True
    return False


def query_until_number(prom_port, expr, tries=20):
    """Instant queries of gauges can be empty by design at a given moment ("memory saved" is
    empty while no request holds cache): asks for ~10 s until one answers with a number."""
    for _ in range(tries):
        result, error = query(prom_port, expr)
        if error or has_number(result):
            return result, error
        time.sleep(0.5)
    return result, error


tmp = tempfile.mkdtemp(prefix="llava-dashboard-")
grpc_port, metrics_port, prom_port = free_port(), free_port(), free_port()
procs = []
try:
    log = open(os.path.join(tmp, "server.log"), "w")
    procs.append(subprocess.Popen(
        [os.path.join(BUILD, "llava-server"), "--model", os.path.join(SRC, "models/shapes-llava"),
         "--listen", f"127.0.0.1:{grpc_port}", "--metrics-listen", f"127.0.0.1:{metrics_port}",
         "--http-listen", "127.0.0.1:0",
         "--threads", "1"], stdout=log, stderr=log))
    wait_for("llava-server", lambda: "ok" in get(f"http://127.0.0.1:{metrics_port}/healthz"), 120)

    config = os.path.join(tmp, "prometheus.yml")
    with open(config, "w") as f:
        yaml.safe_dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                        "scrape_configs": [{"job_name": "llava-server-local", "static_configs": [
                            {"targets": [f"127.0.0.1:{metrics_port}"]}]}]}, f)
    plog = open(os.path.join(tmp, "prometheus.log"), "w")
    procs.append(subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp}/tsdb",
         f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=plog, stderr=plog))
    wait_for("prometheus", lambda: "Ready" in get(f"http://127.0.0.1:{prom_port}/-/ready"), 60)

    # Load that runs through the queries: two streams with images, mixed lengths.
    procs.append(subprocess.Popen(
        [os.path.join(BUILD, "llava-load"), "--server", f"127.0.0.1:{grpc_port}",
         "--concurrency", "2", "--requests", "100000", "--max-tokens", "48", "--min-tokens", "4",
         "--image", os.path.join(SRC, "models/examples/scene1.png")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(12)  # several scrapes with requests finishing between them

    limit, _ = query(prom_port, "llava_memory_limit_bytes")
    unlimited = bool(limit) and all(float(s["value"][1]) == 0 for s in limit)

    dash = json.load(open(os.path.join(SRC, "deploy/grafana/llava-dashboard.json")))
    checked = 0
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            if unlimited and "llava_memory_limit_bytes" in expr:
                continue  # no cgroup memory limit on this machine: the series is 0, filtered out
            expr = re.sub(r"\$(namespace|pod|instance|policy)\b", ".*", expr)
            expr = expr.replace("$__rate_interval", "30s")
            result, error = query_until_number(prom_port, expr)
            checked += 1
            if error:
                failures.append(f"panel {panel['title']!r}: {error}: {expr}")
            elif not has_number(result):
                failures.append(f"panel {panel['title']!r}: no series with a value: {expr}")

    # KEDA's queries (overlays/keda), with the namespace matcher widened: no namespace label
    # on a local scrape.
    keda = yaml.safe_load(open(os.path.join(SRC, "deploy/kubernetes/overlays/keda/scaledobject.yaml")))
    for trigger in keda["spec"]["triggers"]:
        if trigger["type"] != "prometheus":
            continue
        expr = trigger["metadata"]["query"].replace('namespace="llava"', 'namespace=~".*"')
        result, error = query_until_number(prom_port, expr)
        checked += 1
        if error or not has_number(result or []):
            failures.append(f"ScaledObject query answers nothing: {expr} {error or ''}")

    rules = yaml.safe_load(open(os.path.join(SRC, "deploy/prometheus/alerts.yml")))
    for group in rules["groups"]:
        for rule in group["rules"]:
            result, error = query(prom_port, rule["expr"])
            if error:
                failures.append(f"alert {rule['alert']}: {error}")
            for name in sorted(set(re.findall(r"\b(?:llava_[a-z0-9_]+|up)\b", rule["expr"]))):
                series, _ = query(prom_port, name)
                if not series:
                    failures.append(f"alert {rule['alert']}: reads {name}, which the scrape lacks")
            # The alert's own selectors (job, code, ...) must match scraped series; the server
            # counts a RESOURCE_EXHAUSTED or INTERNAL code only once one happens, which healthy
            # load never makes (alerts_test.yml covers those alerts' logic).
            for sel in re.findall(r"\b((?:llava_[a-z0-9_]+|up)\{[^}]*\})", rule["expr"]):
                series, _ = query(prom_port, sel)
                if not series and "RESOURCE_EXHAUSTED" not in sel and "INTERNAL" not in sel:
                    failures.append(f"alert {rule['alert']}: {sel} matches no scraped series")
finally:
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
    if failures:
        for name in ("server.log", "prometheus.log"):
            path = os.path.join(tmp, name)
            if os.path.exists(path):
                print(f"--- {name} (tail)\n" + "".join(open(path).readlines()[-15:]))
    shutil.rmtree(tmp, ignore_errors=True)

if failures:
    print("\n".join("FAIL: " + f for f in failures))
    sys.exit(1)
print(f"{checked} dashboard and autoscaler queries and {sum(len(g['rules']) for g in rules['groups'])} alerts "
      "answered by a live scrape")
