"""The Grafana dashboard and the Prometheus alert rules in docker/ query only what the server
exports, the compose file provisions them, and promtool accepts them: every expression parses,
the configuration with its rules loads as compose lays it out, and each alert fires on a case
made for it and stays quiet on one just under its threshold."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serving import ServerProcess
from testmodels import save_torchscript

from scriptserve.archiver.cli import model_archiver_main
from tests.docker.promql import metric_names, variable_metric_names

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DASHBOARD_FILE = DOCKER / "grafana" / "dashboards" / "scriptserve.json"
ALERTS_FILE = DOCKER / "prometheus" / "alerts.yml"
DASHBOARD: dict[str, Any] = json.loads(DASHBOARD_FILE.read_text())
ALERTS: dict[str, Any] = yaml.safe_load(ALERTS_FILE.read_text())
COMPOSE: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text())
# Series Prometheus makes itself for every target: not the server's to export.
PROMETHEUS_MADE = {"up"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Grafana's variables, as a dashboard with every model and instance selected expands them.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1h",
    "${datasource}": "prometheus",
    "$datasource": "prometheus",
    "$job": "scriptserve",
    "$instance": ".*",
    "$model": ".*",
}


def panels(items: list[dict[str, Any]] | None = None) -> Iterator[dict[str, Any]]:
    """Every panel, the panels of collapsed rows included."""
    for panel in DASHBOARD["panels"] if items is None else items:
        yield panel
        yield from panels(panel.get("panels") or [])


def dashboard_exprs() -> dict[str, str]:
    """'panel title / refId' -> the target's PromQL, as written."""
    return {
        f"{p['title']} / {t['refId']}": t["expr"] for p in panels() for t in p.get("targets", [])
    }


def variable_queries() -> dict[str, str]:
    found = {}
    for v in DASHBOARD["templating"]["list"]:
        if v["type"] == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            found[v["name"]] = query
    return found


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in ALERTS["groups"] for rule in group["rules"]]


def expand(expr: str) -> str:
    """Grafana's variables replaced by values, longest names first (`$__range` before ...)."""
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    assert "$" not in expr, f"a variable the test does not know: {expr}"
    return expr


def queried_names() -> dict[str, set[str]]:
    """metric name -> where it is queried."""
    where: dict[str, set[str]] = {}
    sources = {
        **{f"panel {k}": v for k, v in dashboard_exprs().items()},
        **{f"alert {r['alert']}": r["expr"] for r in alert_rules()},
    }
    for source, expr in sources.items():
        for name in metric_names(expr):
            where.setdefault(name, set()).add(source)
    for var, query in variable_queries().items():
        for name in variable_metric_names(query):
            where.setdefault(name, set()).add(f"variable {var}")
    return where


# --- the extractor itself: a checker that cannot see names would pass anything -------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up == 0", {"up"}),
        ('sum by (le) (rate(a_bucket{x="{y}", le!="1"}[5m]))', {"a_bucket"}),
        ("histogram_quantile(0.99, sum(rate(b_bucket[$__rate_interval])) by (le, model))",
         {"b_bucket"}),
        ("a / on(instance) group_left(version) b offset 5m > bool 0.99", {"a", "b"}),
        ("(sum(rate(c_total{s=~'5..'}[1m])) or vector(0)) / sum without (s) (c_total)",
         {"c_total"}),
        ("max_over_time(d[1h:1m]) unless e @ start() and 1e3 > f", {"d", "e", "f"}),
        ('{job="x"} + count(g)', {"g"}),
    ],
)  # fmt: skip
def test_the_extractor_finds_metric_names_and_only_them(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


@pytest.mark.parametrize(
    "expr", ["ratee(x[5m])", 'x{__name__="y"}', "sum(rate(x[5m])", "x{a='b'", "x $y"]
)
def test_the_extractor_refuses_what_it_cannot_check(expr: str) -> None:
    with pytest.raises(ValueError):
        metric_names(expr)


def test_variable_queries_name_their_metric() -> None:
    assert variable_metric_names('label_values(m{job=~"$job"}, instance)') == {"m"}
    assert variable_metric_names("label_values(job)") == set()
    assert variable_metric_names("query_result(topk(3, n))") == {"n"}


# --- against a real server -------------------------------------------------------------------


def archive(work: Path, store: Path, name: str, config: dict[str, str] | None = None) -> None:
    (work / "sample.json").write_text(json.dumps([0.5] * 8))
    argv = [
        "--model-name", name, "--version", "1.0", "--serialized-file",
        str(save_torchscript(work / f"{name}.pt")), "--handler", "tensor",
        "--sample-input", str(work / "sample.json"), "--export-path", str(store),
    ]  # fmt: skip
    if config:
        (work / f"{name}.yaml").write_text(json.dumps(config))
        argv += ["--config-file", str(work / f"{name}.yaml")]
    assert model_archiver_main(argv) == 0


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One scrape of a real server that answered good and bad requests, with a thread-worker
    and a process-worker model (whose workers have CPU and memory series of their own)."""
    work = tmp_path_factory.mktemp("dashboard")
    store = work / "store"
    archive(work, store, "tiny")
    archive(work, store, "isolated", {"workerMode": "process"})
    server = ServerProcess(store, "--workers", "1").start()
    try:
        x = np.linspace(-1, 1, 8, dtype=np.float32).tolist()
        for model in ("tiny", "isolated"):
            for _ in range(3):
                assert httpx.post(f"{server.url}/predictions/{model}", json=x).status_code == 200
        assert httpx.post(f"{server.url}/predictions/tiny", json=x[:7]).status_code == 400
        assert httpx.post(f"{server.url}/predictions/nope", json=x).status_code == 404
        text = httpx.get(f"{server.metrics_url}/metrics").text
    finally:
        server.stop()
    families = list(text_string_to_metric_families(text))
    return {
        "samples": {s.name for f in families for s in f.samples},
        "types": {f.name: f.type for f in families},
        "text": text,
    }


@pytest.mark.slow
def test_every_queried_metric_is_exported(exported: dict[str, Any]) -> None:
    where = queried_names()
    # The dashboard's and rules' core series, so that an extractor gone blind fails here.
    assert {
        "scriptserve_requests_total",
        "scriptserve_request_latency_seconds_bucket",
        "scriptserve_queue_depth",
        "scriptserve_batch_size_bucket",
        "scriptserve_batch_size_sum",
        "scriptserve_worker_restarts_total",
        "scriptserve_worker_busy",
        "process_resident_memory_bytes",
        "up",
    } <= set(where)
    samples, types = exported["samples"], exported["types"]
    missing = {}
    for name, sources in sorted(where.items()):
        if name in samples or name in PROMETHEUS_MADE:
            continue
        # A histogram's series have no samples of the family's own name: match the family.
        family = next((name.removesuffix(s) for s in HISTOGRAM_SUFFIXES if name.endswith(s)), None)
        if family is not None and types.get(family) == "histogram":
            continue
        missing[name] = sorted(sources)
    assert not missing, f"queried but not exported by the server: {missing}"
    # The failing request made error series, so "Errors by status" reads real ones.
    assert re.search(r'^scriptserve_requests_total\{[^}]*status="400"', exported["text"], re.M)


@pytest.mark.slow
def test_histogram_quantiles_read_buckets_of_histograms(exported: dict[str, Any]) -> None:
    exprs = [*dashboard_exprs().values(), *(r["expr"] for r in alert_rules())]
    quantile_exprs = [e for e in exprs if "histogram_quantile" in e]
    assert quantile_exprs
    for expr in quantile_exprs:
        (name,) = metric_names(expr)
        assert name.endswith("_bucket"), expr
        assert exported["types"][name.removesuffix("_bucket")] == "histogram", expr
        assert re.search(r"sum by \([^)]*\ble\b[^)]*\) \(rate\(", expr), expr


# --- the dashboard's own shape ---------------------------------------------------------------


def test_dashboard_is_a_provisionable_grafana_dashboard() -> None:
    assert DASHBOARD["uid"] == "scriptserve" and 36 <= DASHBOARD["schemaVersion"] <= 41
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["type"] == "query" and variables["model"]["includeAll"]
    assert variable_queries()["model"].startswith("label_values(")
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels():
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, p["title"]
        area = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not area & cells, f"{p['title']} overlaps another panel"
        cells |= area
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            if "model" not in t["expr"] and "process_" not in t["expr"]:
                pytest.fail(f"{p['title']}: every scriptserve series should follow $model")
    titles = {p["title"] for p in panels()}
    for wanted in (
        "Request rate by model",
        "Request rate by status",
        "Request latency",
        "Errors by status",
        "Queue depth",
        "Batch size distribution",
        "Mean batch size",
        "Worker busy share",
        "Worker restarts and stuck workers",
        "CPU",
        "Resident memory",
    ):
        assert wanted in titles


def test_alert_rules_follow_prometheus_naming() -> None:
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert re.fullmatch(r"Scriptserve[A-Z][A-Za-z0-9]+", rule["alert"])
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    prometheus = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (job,) = prometheus["scrape_configs"]
    by_name = {r["alert"]: r for r in rules}
    assert by_name["ScriptserveTargetDown"]["expr"] == f'up{{job="{job["job_name"]}"}} == 0'


# --- compose provisions them -----------------------------------------------------------------


def mounts(service: str) -> dict[str, Path]:
    """Container path -> host path (relative to docker/) of a service's bind mounts."""
    found = {}
    for volume in COMPOSE["services"][service]["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            found[target] = (DOCKER / source).resolve()
    return found


def test_compose_mounts_the_rules_into_prometheus() -> None:
    bound = mounts("prometheus")
    for source in bound.values():
        assert source.exists(), source
    config_target = next(
        arg.split("=", 1)[1]
        for arg in COMPOSE["services"]["prometheus"]["command"]
        if arg.startswith("--config.file=")
    )
    assert bound[config_target] == DOCKER / "prometheus.yml"
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (rule_file,) = config["rule_files"]
    rules_target = str(Path(config_target).parent / rule_file)
    assert bound[rules_target] == ALERTS_FILE


def test_compose_provisions_grafana_with_the_dashboard() -> None:
    grafana = COMPOSE["services"]["grafana"]
    assert grafana["image"].startswith("grafana/grafana:")
    bound = mounts("grafana")
    provisioning = bound["/etc/grafana/provisioning"]
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus"
    url = httpx.URL(source["url"])
    assert url.host in COMPOSE["services"] and url.host == "prometheus"
    assert any(p.endswith(f":{url.port}") for p in COMPOSE["services"]["prometheus"]["ports"])
    providers = yaml.safe_load((provisioning / "dashboards" / "scriptserve.yaml").read_text())
    (provider,) = providers["providers"]
    dashboards = bound[provider["options"]["path"]]
    assert (dashboards / DASHBOARD_FILE.name).read_bytes() == DASHBOARD_FILE.read_bytes()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert bound[str(Path(home).parent)] / Path(home).name == DASHBOARD_FILE
    # The admin password is a compose secret from a file that git ignores, as the keys are.
    password = grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"]
    (secret,) = grafana["secrets"]
    assert password == f"/run/secrets/{secret}"
    assert COMPOSE["secrets"][secret]["file"].startswith("./secrets/")


def test_every_service_is_loopback_only_and_hardened() -> None:
    for name, service in COMPOSE["services"].items():
        for port in service["ports"]:
            assert port.startswith("127.0.0.1:"), (name, port)
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith(".") or source in COMPOSE.get("volumes", {}), (name, volume)


# --- promtool --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def promtool() -> str:
    """promtool (Debian package `prometheus`, which .ci/run installs)."""
    path = shutil.which("promtool")
    if path is None:
        # CI installs it: there the checks must run, not skip.
        skip = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
        skip("promtool is not installed: apt-get install -y prometheus")
    return str(path)


def run(promtool: str, *args: str, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [promtool, *args], capture_output=True, text=True, cwd=cwd, timeout=60, check=False
    )
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def test_promtool_accepts_the_rules(promtool: str) -> None:
    out = run(promtool, "check", "rules", str(ALERTS_FILE))
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


def test_promtool_accepts_the_config_as_compose_mounts_it(promtool: str, tmp_path: Path) -> None:
    for target, source in mounts("prometheus").items():
        placed = tmp_path / target.lstrip("/")
        placed.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, placed)
    out = run(promtool, "check", "config", str(tmp_path / "etc/prometheus/prometheus.yml"))
    assert f"SUCCESS: {len(alert_rules())} rules found" in out


def test_promtool_parses_every_dashboard_query(promtool: str, tmp_path: Path) -> None:
    """Each panel's and variable's PromQL, variables expanded, as a recording rule: promtool
    parses it with Prometheus's own parser."""
    exprs = [expand(e) for e in dashboard_exprs().values()]
    exprs += [
        expand(q).removeprefix("label_values(").rsplit(",", 1)[0]
        for q in variable_queries().values()
    ]
    rules = [{"record": f"dashboard:query_{i}:check", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = run(promtool, "check", "rules", str(path))
    assert f"SUCCESS: {len(rules)} rules found" in out


# Series of each case at a 1-minute interval, the evaluation time, and the labels the alert
# should fire with (severity comes from the rule); None: it should stay quiet.
S = 'job="scriptserve", instance="host:8082", model="mlp", version="1.0"'
R = f'{S}, protocol="rest"'
Case = tuple[str, dict[str, str], str, dict[str, str] | None]
CASES: list[Case] = [
    ("ScriptserveTargetDown", {'up{job="scriptserve", instance="host:8082"}': "1 1 0 0 0 0 0"},
     "5m", {"job": "scriptserve", "instance": "host:8082"}),
    ("ScriptserveTargetDown", {'up{job="scriptserve", instance="host:8082"}': "1x10"},
     "5m", None),
    ("ScriptserveHighErrorRatio", {
        f'scriptserve_requests_total{{{R}, status="200"}}': "0+900x20",
        f'scriptserve_requests_total{{{R}, status="500"}}': "0+100x20",
    }, "15m", {"job": "scriptserve", "instance": "host:8082", "model": "mlp"}),
    ("ScriptserveHighErrorRatio", {
        f'scriptserve_requests_total{{{R}, status="200"}}': "0+960x20",
        f'scriptserve_requests_total{{{R}, status="500"}}': "0+40x20",
    }, "15m", None),
    ("ScriptserveLatencyP99High", {
        f'scriptserve_request_latency_seconds_bucket{{{R}, le="0.25"}}': "0+0x30",
        f'scriptserve_request_latency_seconds_bucket{{{R}, le="1.0"}}': "0+100x30",
        f'scriptserve_request_latency_seconds_bucket{{{R}, le="+Inf"}}': "0+100x30",
    }, "20m", {"job": "scriptserve", "instance": "host:8082", "model": "mlp"}),
    ("ScriptserveLatencyP99High", {
        f'scriptserve_request_latency_seconds_bucket{{{R}, le="0.25"}}': "0+100x30",
        f'scriptserve_request_latency_seconds_bucket{{{R}, le="1.0"}}': "0+100x30",
        f'scriptserve_request_latency_seconds_bucket{{{R}, le="+Inf"}}': "0+100x30",
    }, "20m", None),
    ("ScriptserveQueueNearFull", {f"scriptserve_queue_depth{{{S}}}": "900x10"}, "5m",
     {"job": "scriptserve", "instance": "host:8082", "model": "mlp", "version": "1.0"}),
    ("ScriptserveQueueNearFull", {f"scriptserve_queue_depth{{{S}}}": "700x10"}, "5m", None),
    ("ScriptserveRejectingRequests",
     {f'scriptserve_requests_total{{{R}, status="503"}}': "0+30x20"}, "10m",
     {"job": "scriptserve", "instance": "host:8082", "model": "mlp"}),
    ("ScriptserveRejectingRequests",
     {f'scriptserve_requests_total{{{R}, status="503"}}': "0x20"}, "10m", None),
    ("ScriptserveWorkerRestartLoop",
     {f"scriptserve_worker_restarts_total{{{S}}}": "0 1 2 3 4 5 6"}, "6m",
     {"job": "scriptserve", "instance": "host:8082", "model": "mlp", "version": "1.0"}),
    ("ScriptserveWorkerRestartLoop",
     {f"scriptserve_worker_restarts_total{{{S}}}": "0 0 1 1 1 1 1"}, "6m", None),
    ("ScriptserveWorkerStuck", {f"scriptserve_workers_stuck_total{{{S}}}": "0 0 1 1 1"}, "4m",
     {"job": "scriptserve", "instance": "host:8082", "model": "mlp", "version": "1.0"}),
    ("ScriptserveWorkerStuck", {f"scriptserve_workers_stuck_total{{{S}}}": "0x10"}, "4m", None),
    ("ScriptserveModelFailed",
     {f'scriptserve_model_state{{{S}, state="FAILED"}}': "1x10"}, "6m",
     {"job": "scriptserve", "instance": "host:8082", "model": "mlp", "version": "1.0"}),
    ("ScriptserveModelFailed",
     {f'scriptserve_model_state{{{S}, state="READY"}}': "1x10"}, "6m", None),
]  # fmt: skip
_LABEL_TEMPLATE = re.compile(r"\{\{\s*\$labels\.(\w+)\s*\}\}")


def expected_alert(rule: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    """The alert promtool should see: the rule's labels and its annotations' templates filled
    (the annotations use only `$labels`, so this is all their expansion)."""
    annotations = {}
    for key, template in rule["annotations"].items():
        text = _LABEL_TEMPLATE.sub(lambda m: labels[m.group(1)], template)
        assert "{{" not in text, f"{rule['alert']}: a template the test cannot expand"
        annotations[key] = text
    return {"exp_labels": {**labels, **rule["labels"]}, "exp_annotations": annotations}


def test_every_alert_fires_on_its_case_and_not_below_it(promtool: str, tmp_path: Path) -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    assert {c[0] for c in CASES if c[3] is not None} == set(rules)
    assert {c[0] for c in CASES if c[3] is None} == set(rules)
    tests = [
        {
            "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "alert_rule_test": [{
                "eval_time": at, "alertname": name,
                "exp_alerts": [] if labels is None else [expected_alert(rules[name], labels)],
            }],
        }
        for name, series, at, labels in CASES
    ]  # fmt: skip
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [str(ALERTS_FILE)], "tests": tests}))
    run(promtool, "test", "rules", str(path))
