#!/usr/bin/env python3
"""Regenerates the Kubernetes copies of the monitoring sources after an edit:
deploy/kubernetes/monitoring/prometheusrule.yaml from deploy/prometheus/alerts.yml and
grafana-dashboard.yaml from deploy/grafana/llava-dashboard.json (tests/deploy_test.py fails
while they differ).

usage: scripts/sync_deploy.py
"""
import os

import yaml

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deploy")
OUT = os.path.join(ROOT, "kubernetes", "monitoring")


class Literal(str):
    pass


yaml.add_representer(
    Literal, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|"))

alerts = yaml.safe_load(open(os.path.join(ROOT, "prometheus", "alerts.yml")))
with open(os.path.join(OUT, "prometheusrule.yaml"), "w") as f:
    f.write("# deploy/prometheus/alerts.yml for the Prometheus Operator (kept equal by "
            "tests/deploy_test.py;\n# regenerate with scripts/sync_deploy.py).\n")
    yaml.dump({"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
               "metadata": {"name": "llava-server", "namespace": "llava",
                            "labels": {"app.kubernetes.io/name": "llava-server"}},
               "spec": {"groups": alerts["groups"]}}, f, sort_keys=False, width=100)

dashboard = open(os.path.join(ROOT, "grafana", "llava-dashboard.json")).read()
with open(os.path.join(OUT, "grafana-dashboard.yaml"), "w") as f:
    f.write("# deploy/grafana/llava-dashboard.json for Grafana's dashboard sidecar (label "
            "grafana_dashboard);\n# kept equal by tests/deploy_test.py; regenerate with "
            "scripts/sync_deploy.py.\n")
    yaml.dump({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "llava-dashboard", "namespace": "llava",
                            "labels": {"grafana_dashboard": "1",
                                       "app.kubernetes.io/name": "llava-server"}},
               "data": {"llava-dashboard.json": Literal(dashboard)}}, f, sort_keys=False,
              width=1000)
print("wrote", os.path.join(OUT, "prometheusrule.yaml"), "and grafana-dashboard.yaml")
