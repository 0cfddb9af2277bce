"""The Grafana dashboard (k8s/grafana/diloco-dashboard.json) queries exactly the metrics
and labels the real-Prometheus test checks (tests/cluster/test_prometheus.py, which also
runs each of its queries against a live run): a renamed metric fails here, not on a blank
panel."""

import json
import re

from tests.cluster.test_prometheus import DASHBOARD, LABELS, METRICS


def test_the_dashboard_queries_exactly_the_metrics_and_labels_the_prometheus_test_checks():
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [(panel["title"], target) for panel in dashboard["panels"] for target in panel["targets"]]
    assert queries and len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    for title, target in queries:
        assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
    names = {name for _, target in queries for text in (target["expr"], target.get("legendFormat", ""))
             for name in re.findall(r"\bdiloco_\w+", text)}
    assert names - set(LABELS) == set(METRICS)
    assert names & set(LABELS) == set(LABELS)
    titles = " / ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for subject in ("loss", "tokens per second", "latency", "rounds", "pushes", "bytes", "members"):
        assert subject in titles, subject
