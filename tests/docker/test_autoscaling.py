"""The autoscalers in docker/k8s/ scale the scriptserve Deployment on the queue depth a real
server exports: KEDA's ScaledObject (keda-scaledobject.yaml), and the HPA (hpa-queue-depth.yaml)
on the custom metric that the Prometheus adapter's rule (prometheus-adapter-rules.yaml) makes
of it. Their queries run in Prometheus's own engine (`promtool test rules`) over series labelled
as a real scrape of the server is, with the labels Prometheus adds to a pod's series. The
manifests' schemas are checked with the others, in test_manifests.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serving import ServerProcess

from tests.docker import test_dashboard as dashboard
from tests.docker.promql import metric_names
from tests.docker.test_manifests import DEFAULTS, IMAGE_CONFIG, K8S, ROOT, one

# Slow: a server started for a few tests.
pytestmark = pytest.mark.slow

promtool = dashboard.promtool  # the fixture (skips where promtool is missing, fails on CI)

DEPLOYMENT = one(K8S["deployment.yaml"], "Deployment")
SCALED_OBJECT = one(K8S["keda-scaledobject.yaml"], "ScaledObject")
(TRIGGER,) = SCALED_OBJECT["spec"]["triggers"]
KEDA_QUERY: str = TRIGGER["metadata"]["query"]
HPA = one(K8S["hpa-queue-depth.yaml"], "HorizontalPodAutoscaler")
(HPA_METRIC,) = HPA["spec"]["metrics"]
CPU_HPA = one(K8S["hpa-cpu.yaml"], "HorizontalPodAutoscaler")
ADAPTER_CONFIG = one(K8S["prometheus-adapter-rules.yaml"], "ConfigMap")["data"]["config.yaml"]
(RULE,) = yaml.safe_load(ADAPTER_CONFIG)["rules"]
AUTOSCALERS = ("keda-scaledobject.yaml", "hpa-queue-depth.yaml", "hpa-cpu.yaml")
QUEUE_DEPTH = "scriptserve_queue_depth"
# What Prometheus adds to each series of a pod it scrapes on Kubernetes (the community chart's
# `kubernetes-pods` job and the Prometheus Operator's PodMonitor alike): not the server's labels.
TARGET_LABELS = ("job", "instance", "namespace", "pod")


def render(template: str, series: str, matchers: str, group_by: str) -> str:
    """The adapter's metricsQuery for one request, as it fills the template."""
    query = (
        template.replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", matchers)
        .replace("<<.GroupBy>>", group_by)
    )
    assert "<<" not in query, f"a template field the test does not fill: {query}"
    return query


def selector(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


@pytest.fixture(scope="module")
def queue_depth(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`scriptserve_queue_depth`'s type and label sets, and every label name of the scrape,
    from one scrape of a real server that serves a model and has answered a request."""
    work = tmp_path_factory.mktemp("autoscaling")
    store = work / "store"
    dashboard.archive(work, store, "tiny")
    server = ServerProcess(store, "--workers", "1").start()
    try:
        assert httpx.post(f"{server.url}/predictions/tiny", json=[0.5] * 8).status_code == 200
        text = httpx.get(f"{server.metrics_url}/metrics").text
    finally:
        server.stop()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families[QUEUE_DEPTH]
    return {
        "type": family.type,
        "labels": [dict(s.labels) for s in family.samples],
        "all_label_names": {k for f in families.values() for s in f.samples for k in s.labels},
    }


# --- what the queries read is what the server exports ----------------------------------------


def test_the_queries_read_the_queue_depth_gauge(queue_depth: dict[str, Any]) -> None:
    series_query = RULE["seriesQuery"]
    metrics_query = render(RULE["metricsQuery"], QUEUE_DEPTH, 'namespace="default"', "pod")
    for query in (KEDA_QUERY, series_query, metrics_query):
        assert metric_names(query) == {QUEUE_DEPTH}, query
    assert queue_depth["type"] == "gauge"  # avg_over_time, not rate: a level, not a count
    assert queue_depth["labels"] == [{"model": "tiny", "version": "1.0"}]
    # A label of the server's own named like a target label would reach Prometheus renamed to
    # exported_<name>, and the pod matchers would select nothing.
    assert not queue_depth["all_label_names"] & set(TARGET_LABELS)


def test_the_adapter_serves_the_metric_the_hpa_reads() -> None:
    assert re.fullmatch(RULE["name"]["matches"], QUEUE_DEPTH)
    served = re.sub(RULE["name"]["matches"], RULE["name"]["as"], QUEUE_DEPTH)
    assert HPA_METRIC["type"] == "Pods"
    assert HPA_METRIC["pods"]["metric"]["name"] == served
    # The chart's default rules already serve every namespaced gauge under its own name.
    assert served != QUEUE_DEPTH
    overrides = RULE["resources"]["overrides"]
    assert overrides == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert set(overrides) <= set(TARGET_LABELS)


# --- the queries, run by Prometheus -----------------------------------------------------------


def test_prometheus_computes_the_queue_of_the_deployments_pods(
    queue_depth: dict[str, Any], promtool: str, tmp_path: Path
) -> None:
    """Two Deployment pods, one with two versions of the model; KServe predictor pods (both
    modes) and a pod of another namespace, all named like the Deployment's; a series scraped
    without Kubernetes labels. KEDA's query is the Deployment's total, the adapter's gives each
    of its pods its own, and the adapter's series query finds every pod's series."""
    namespace = DEPLOYMENT["metadata"].get("namespace", "default")
    name = DEPLOYMENT["metadata"]["name"]
    (served,) = queue_depth["labels"]
    pod_a, pod_b = f"{name}-7d9c5b4f8-x2kqp", f"{name}-7d9c5b4f8-9wz4h"

    def pod(namespace: str, pod: str, **labels: str) -> dict[str, str]:
        return {
            **served,
            **labels,
            "job": "kubernetes-pods",
            "instance": "10.0.0.1:8082",
            "namespace": namespace,
            "pod": pod,
        }

    depths = {
        selector(QUEUE_DEPTH, pod(namespace, pod_a)): 30,
        selector(QUEUE_DEPTH, pod(namespace, pod_a, version="2.0")): 10,
        selector(QUEUE_DEPTH, pod(namespace, pod_b)): 100,
        selector(QUEUE_DEPTH, pod("staging", f"{name}-5f6d7c8b9-q4w2z")): 700,
    }
    for isvc in (d for d in K8S["kserve.yaml"] if d["kind"] == "InferenceService"):
        predictor = f"{isvc['metadata']['name']}-predictor"
        # A Knative revision's pod (serverless mode), and a raw deployment's.
        for suffix in ("00001-deployment-6c5b8d7f9-k2x7p", "5d8f7c9b6-h7j8k"):
            depths[selector(QUEUE_DEPTH, pod(namespace, f"{predictor}-{suffix}"))] = 500
    static = selector(QUEUE_DEPTH, {**served, "job": "static", "instance": "10.0.0.9:8082"})
    matchers = f'namespace="{namespace}",pod=~"{pod_a}|{pod_b}"'
    metrics_query = render(RULE["metricsQuery"], QUEUE_DEPTH, matchers, "pod")
    tests = [
        {
            "interval": "15s",
            "input_series": [
                {"series": s, "values": f"{v}x12"} for s, v in [*depths.items(), (static, 900)]
            ],
            "promql_expr_test": [
                {
                    "expr": KEDA_QUERY,
                    "eval_time": "2m",
                    "exp_samples": [{"labels": "{}", "value": 140}],
                },
                {
                    "expr": metrics_query,
                    "eval_time": "2m",
                    "exp_samples": [
                        {"labels": f'{{pod="{pod_a}"}}', "value": 40},
                        {"labels": f'{{pod="{pod_b}"}}', "value": 100},
                    ],
                },
                {
                    "expr": RULE["seriesQuery"],
                    "eval_time": "2m",
                    "exp_samples": [{"labels": s, "value": v} for s, v in depths.items()],
                },
            ],
        }
    ]
    path = tmp_path / "autoscaling_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [], "tests": tests}))
    dashboard.run(promtool, "test", "rules", str(path))


# --- the autoscalers and the Deployment agree ------------------------------------------------


def test_every_autoscaler_scales_the_deployment_within_the_same_bounds() -> None:
    deployment = (DEPLOYMENT["apiVersion"], DEPLOYMENT["kind"], DEPLOYMENT["metadata"]["name"])
    bounds = set()
    for hpa in (HPA, CPU_HPA):
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"], target["name"]) == deployment
        bounds.add((hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]))
    target = SCALED_OBJECT["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == deployment
    spec = SCALED_OBJECT["spec"]
    bounds.add((spec["minReplicaCount"], spec["maxReplicaCount"]))
    ((low, high),) = bounds
    assert 2 <= low < high  # two replicas, so that one can restart while the other serves
    assert spec["fallback"]["replicas"] >= low
    # The two HPAs share a name: applying one replaces the other instead of adding a second.
    assert HPA["metadata"]["name"] == CPU_HPA["metadata"]["name"]


def test_the_target_is_one_batch_per_worker() -> None:
    """KEDA's threshold (on the Deployment's total, which it divides by the replicas: metric type
    AverageValue) and the HPA's per-pod average are the same: what one pod's workers take in one
    round of batches, well under the queue size at which the server answers 503."""
    assert TRIGGER["type"] == "prometheus" and TRIGGER["metricType"] == "AverageValue"
    assert HPA_METRIC["pods"]["target"]["type"] == "AverageValue"
    threshold = float(TRIGGER["metadata"]["threshold"])
    assert float(HPA_METRIC["pods"]["target"]["averageValue"]) == threshold
    (container,) = DEPLOYMENT["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    workers = int(env["SCRIPTSERVE_WORKERS_PER_MODEL"])
    max_batch = int(
        env.get("SCRIPTSERVE_MAX_BATCH_SIZE")
        or IMAGE_CONFIG.get("max_batch_size", DEFAULTS.max_batch_size)
    )
    assert threshold == workers * max_batch
    assert threshold < IMAGE_CONFIG.get("queue_size", DEFAULTS.queue_size) / 4


def kubectl_apply_commands(text: str) -> list[str]:
    """Each `kubectl apply` command in `text`, continuation lines joined, comment marks off."""
    lines = [re.sub(r"^\s*#\s?", "", line) for line in text.splitlines()]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [line.strip() for line in joined.splitlines() if "kubectl apply" in line]


def command_blocks() -> dict[str, list[str]]:
    """'where' -> the `kubectl apply` commands given together there: each code block of the
    deployment docs, and each manifest's comments."""
    docs = (ROOT / "docs" / "deployment.md").read_text()
    blocks = re.findall(r"^[ \t]*```[\w-]*\n(.*?)^[ \t]*```", docs, re.M | re.S)
    found = {
        f"deployment.md, code block {i}": kubectl_apply_commands(b) for i, b in enumerate(blocks)
    }
    for path in sorted((ROOT / "docker" / "k8s").glob("*.yaml")):
        found[path.name] = kubectl_apply_commands(path.read_text())
    return found


def test_the_documented_commands_apply_one_autoscaler_at_a_time() -> None:
    blocks = command_blocks()
    named = {f for cmds in blocks.values() for cmd in cmds for f in AUTOSCALERS if f in cmd}
    assert named == set(AUTOSCALERS), "the docs should show how to apply each autoscaler"
    for where, cmds in blocks.items():
        applied = {f for cmd in cmds for f in AUTOSCALERS if f in cmd}
        assert len(applied) <= 1, (where, cmds)
        for cmd in cmds:
            # The whole folder holds every autoscaler, and the KServe and KEDA kinds.
            assert not re.search(r"-f\s+\S*docker/k8s/?(\s|$)", cmd), (where, cmd)
