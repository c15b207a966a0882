"""The autoscaling chain, run for real: Prometheus scrapes a kvferry stack as deploy/k8s has it scraped (the gateway's
/metrics, labelled with the namespace and name of its Service), and the prometheus-adapter rules behind the HPAs'
metrics, read from deploy/k8s/prometheus-adapter/values.yaml, are discovered and rendered as the adapter does it and
evaluated by Prometheus's query API while load comes and goes."""

import http.client
import json
import os
import random
import re
import signal
import socket
import threading
import time
from pathlib import Path

import yaml

from tests.e2e.prometheus_server import Prometheus, cached_binary, find_binary
from tests.e2e.stack import tiny_stack
from tests.environment import lacking

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCRAPE = "200ms"  # Prometheus's scrape and evaluation interval here: a gauge's change shows within a few polls
NUM_REQUESTS = 4
HEARTBEAT_S = 1.0  # a stopped worker is dropped after 3: the time Prometheus has to see the burst it holds
PROMPT_TOKENS = 600


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def hpa_metrics() -> dict[str, dict]:
    """Every metric the HPAs in deploy/k8s read, by name: its HPA's namespace and the object it is described on."""
    metrics = {}
    for path in sorted(K8S.glob("*-hpa.yaml")):
        for hpa in documents(path):
            for m in hpa["spec"]["metrics"]:
                assert m["type"] == "Object", f"{path.name}: this test follows the adapter for Object metrics only"
                metrics[m["object"]["metric"]["name"]] = {
                    "namespace": hpa["metadata"]["namespace"],
                    "object": m["object"]["describedObject"],
                }
    return metrics


def _resource(name: str) -> str:
    return name.lower().removesuffix("s")  # the adapter's overrides take `service` or `services` alike


def adapter_metric_name(rule: dict, series: str) -> str | None:
    """The custom-metrics name the adapter gives a discovered series (name.matches, rewritten with name.as), or None
    when the rule's regex does not take it."""
    matches, rename = rule["name"]["matches"], rule["name"]["as"]
    if not re.search(matches, series):
        return None
    return re.sub(matches, re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", rename), series)  # Go's $1 is Python's \g<1>


def adapter_query(rule: dict, series: str, namespace: str, kind: str, name: str) -> str:
    """The PromQL the adapter sends for an Object metric on one named object (its naming.metricsQuery.Build): the
    label matchers are the namespace's, then the object's resource label (`label="value"`, Go's %q); the group-by is
    the resource label."""
    label_of = {_resource(spec["resource"]): label for label, spec in rule["resources"]["overrides"].items()}
    resource_label = label_of[_resource(kind)]
    fields = {
        "Series": series,
        "LabelMatchers": f"{label_of['namespace']}={json.dumps(namespace)},{resource_label}={json.dumps(name)}",
        "GroupBy": resource_label,
    }
    query = re.sub(r"<<\s*\.(\w+)\s*>>", lambda m: fields[m.group(1)], rule["metricsQuery"])
    assert "<<" not in query and ">>" not in query, f"a template this test does not render: {rule['metricsQuery']}"
    return query


def alive(stack) -> bool:
    """Raises, with its log, when a process of the stack has exited: a wait for it would only time out."""
    for name, proc in stack.procs.items():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{stack.log(name)[-3000:]}")
    return True


def registered(stack) -> bool:
    assert "prefill-a" in stack.workers(), (
        "the gateway dropped the stopped prefill worker before Prometheus saw its queue"
    )
    return True


class HeldStream(threading.Thread):
    """A streamed completion that keeps generating until close(), which hangs up as a leaving client does."""

    def __init__(self, port: int, body: dict):
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.body, self.status, self.events, self.stopping = body, None, 0, threading.Event()

    def run(self) -> None:
        try:
            self.conn.request(
                "POST",
                "/v1/completions",
                json.dumps({**self.body, "stream": True}),
                {"content-type": "application/json"},
            )
            response = self.conn.getresponse()
            self.status = response.status
            while not self.stopping.is_set() and (line := response.readline()):
                self.events += line.startswith(b"data: ")
        except OSError:
            pass  # close() hung up

    def close(self) -> None:
        self.stopping.set()
        if self.conn.sock is not None:
            try:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self.ident is not None:  # started
            self.join(timeout=30)
        self.conn.close()


def test_the_adapter_rules_behind_the_hpas_follow_load_on_a_real_prometheus(tmp_path):
    binary = find_binary()
    if binary is None:
        lacking(
            f"no prometheus on PATH or at {cached_binary()}: `make prometheus` (part of `make test`) puts Debian's "
            "package there where apt can download it"
        )
    rules = documents(K8S / "prometheus-adapter" / "values.yaml")[0]["rules"]["custom"]
    metrics = hpa_metrics()
    # The HPAs read their metrics on one object, the gateway's Service; Prometheus scrapes through it.
    [described] = {(m["object"]["kind"], m["object"]["name"]) for m in metrics.values()}
    [service] = [
        d
        for p in sorted(K8S.glob("*.yaml"))
        for d in documents(p)
        if (d.get("kind"), d.get("metadata", {}).get("name")) == described
    ]

    stack = tiny_stack(tmp_path, heartbeat_interval=HEARTBEAT_S)
    held: list[HeldStream] = []
    prometheus = None
    try:
        stack.start_gateway()
        prefill = stack.start_worker("prefill-a", "prefill")
        stack.start_worker("decode-a", "decode")
        stack.start_worker("decode-b", "decode")
        # As the annotations on the Service have Prometheus scrape the gateway, and as Kubernetes service discovery
        # labels the series: with the Service's namespace and name.
        annotations = service["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        prometheus = Prometheus(
            binary,
            {
                "global": {"scrape_interval": SCRAPE, "scrape_timeout": SCRAPE, "evaluation_interval": SCRAPE},
                "scrape_configs": [
                    {
                        "job_name": "kubernetes-service-endpoints",
                        "metrics_path": annotations["prometheus.io/path"],
                        "static_configs": [
                            {
                                "targets": [f"127.0.0.1:{stack.port}"],
                                "labels": {
                                    "namespace": service["metadata"]["namespace"],
                                    "service": service["metadata"]["name"],
                                },
                            }
                        ],
                    }
                ],
            },
            tmp_path,
        )
        prometheus.wait_ready()
        stack.wait_for(lambda: alive(stack) and len(stack.workers()) == 3, 180, "the workers")

        # Discovery, as the adapter does it: each rule's seriesQuery, its series renamed by name.matches/as. Every
        # metric an HPA reads must come from exactly one rule.
        found: dict[str, tuple[dict, str]] = {}

        def discovered() -> bool:
            for rule in rules:
                for labels in prometheus.api("series", **{"match[]": rule["seriesQuery"]}):
                    if (name := adapter_metric_name(rule, labels["__name__"])) is not None:
                        assert found.setdefault(name, (rule, labels["__name__"])) == (rule, labels["__name__"])
            return set(metrics) <= set(found)

        stack.wait_for(discovered, 60, f"Prometheus to hold series for {sorted(metrics)}")
        queries = {
            name: adapter_query(
                found[name][0], found[name][1], m["namespace"], m["object"]["kind"], m["object"]["name"]
            )
            for name, m in metrics.items()
        }

        last: dict[str, float | None] = {}

        def values() -> dict[str, float | None]:
            """Each HPA metric as the adapter would read it: one sample, labelled with the Service's name (None while
            Prometheus has no series for it yet)."""
            for name, query in queries.items():
                result = prometheus.query(query)
                labels = [r["metric"] for r in result]
                assert labels in ([], [{"service": service["metadata"]["name"]}]), (query, result)
                last[name] = result[0]["value"] if result else None
            return dict(last)

        def wait(condition, what: str) -> None:
            try:
                stack.wait_for(lambda: alive(stack) and condition(), 30, what)
            except TimeoutError as exc:
                raise AssertionError(f"{exc}; the values last read: {last}; the queries: {queries}") from None

        idle = {name: 0.0 for name in metrics}
        wait(lambda: values() == idle, f"the idle values {idle}")

        by_series = {found[name][1]: name for name in metrics}
        queued, usage, running = (
            by_series[f"kvferry:{s}"] for s in ("queued_prompt_tokens", "kv_cache_usage_perc", "num_requests_running")
        )

        def now(name: str, condition) -> bool:
            value = values()[name]
            return value is not None and condition(value)

        # A burst while the prefill worker is stopped, as a saturated one is: the gateway routes the prompts to it
        # and counts them as queued until the worker's next heartbeat, which cannot come yet. (Stopped for longer
        # than MISSED_HEARTBEATS intervals, it would be dropped: the wait below is far shorter.)
        os.kill(prefill.pid, signal.SIGSTOP)
        time.sleep(0.2)  # let a heartbeat the worker sent just before it stopped land first
        rng = random.Random(0)
        for _ in range(NUM_REQUESTS):
            prompt = [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]  # no shared prefix: no cache hits
            held.append(HeldStream(stack.port, {"prompt": prompt, "max_tokens": 4000, "ignore_eos": True}))
            held[-1].start()
        total = NUM_REQUESTS * PROMPT_TOKENS
        try:
            wait(lambda: registered(stack) and now(queued, lambda v: v == total), f"{queued} == {total}")
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
        # The worker computes them and says so; each request then decodes until its client hangs up.
        wait(
            lambda: now(running, lambda v: v == NUM_REQUESTS) and last[queued] == 0,
            f"{running} == {NUM_REQUESTS} and {queued} == 0: every prompt computed, every request decoding",
        )
        assert 0 < last[usage] < 1
        # Each stream's head left the gateway with its first token; its client thread reads it in its own time.
        stack.wait_for(lambda: all(s.status is not None for s in held), 30, "every stream's response head")
        assert [s.status for s in held] == [200] * NUM_REQUESTS and all(s.is_alive() for s in held)

        # The clients leave: every request ends on every worker, and the metrics fall back to idle.
        for stream in held:
            stream.close()
        wait(lambda: values() == idle, f"the idle values {idle} again")
    finally:
        for stream in held:
            stream.close()
        if prometheus is not None:
            prometheus.close()
        stack.close()  # SIGKILL: a stopped worker too
