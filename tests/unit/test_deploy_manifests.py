"""The deployment files, checked offline: every Kubernetes manifest against the Kubernetes schemas (strict),
the metrics adapter's rules against the schema kept in the repo, the Dockerfile and compose file, and how the
pieces fit: addresses, ports, probe paths, grace periods, environment variables and autoscaling metrics."""

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from kvferry.common import protocol as p

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKER = ROOT / "deploy" / "docker"
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")  # the oldest release still commonly run, and the newest known here
ADAPTER_VALUES = K8S / "prometheus-adapter" / "values.yaml"
ADAPTER_SCHEMA = K8S / "schemas" / "prometheus-adapter-rules.schema.json"


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomization() -> dict:
    return documents(K8S / "kustomization.yaml")[0]


def objects() -> dict[tuple[str, str], dict]:
    """(kind, name) -> object, for what the kustomization deploys."""
    found = {}
    for resource in kustomization()["resources"]:
        for doc in documents(K8S / resource):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def config() -> dict[str, str]:
    return objects()[("ConfigMap", "kvferry-config")]["data"]


def container(deployment: str) -> dict:
    [c] = objects()[("Deployment", deployment)]["spec"]["template"]["spec"]["containers"]
    return c


def pod(deployment: str) -> dict:
    return objects()[("Deployment", deployment)]["spec"]["template"]["spec"]


def tcp_port(address: str) -> tuple[str, int]:
    host, port = re.fullmatch(r"tcp://(.+):(\d+)", address).groups()
    return host, int(port)


def named_port(c: dict, port) -> int:
    """A probe's or Service's port, by number or by the container port's name."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c["ports"] if p["name"] == port)


WORKERS = {"kvferry-prefill": "prefill", "kvferry-decode": "decode"}
ROLES = {"kvferry-gateway": "gateway", **WORKERS}


def test_every_manifest_validates_strictly_against_the_kubernetes_schemas():
    paths = sorted(K8S.glob("*.yaml"))
    assert len(paths) >= 9
    for path in paths:
        if path.name == "kustomization.yaml":
            continue
        for doc in documents(path):
            for version in KUBERNETES_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)  # raises on any error
    # The command line too, as an operator would run it before `kubectl apply`.
    command = Path(sys.executable).with_name("kubernetes-validate")
    files = [str(path) for path in paths if path.name != "kustomization.yaml"]
    done = subprocess.run(
        [str(command), "--strict", "-k", KUBERNETES_VERSIONS[0], *files], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    bad = {**objects()[("Service", "kvferry-gateway")], "spec": {"portz": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_kustomization_deploys_every_manifest_but_the_secret_example():
    resources = kustomization()["resources"]
    assert all((K8S / r).is_file() for r in resources)
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert set(resources) == on_disk
    assert kustomization()["namespace"] == objects()[("Namespace", "kvferry")]["metadata"]["name"]
    kinds = {kind for kind, _ in objects()}
    assert {"Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler"} <= kinds


def test_the_adapter_rules_match_the_schema_kept_in_the_repo():
    schema, values = json.loads(ADAPTER_SCHEMA.read_text()), documents(ADAPTER_VALUES)[0]
    jsonschema.validate(values, schema)
    broken = json.loads(json.dumps(values))
    del broken["rules"]["custom"][0]["metricsQuery"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)
    broken["rules"]["custom"][0].update(metricsQuery="x", seriesQueryy="typo")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_workers_reach_the_gateway_through_its_service_and_advertise_their_pod_ip():
    host, port = tcp_port(config()["KVFERRY_GATEWAY"])
    service = objects()[("Service", host)]
    gateway = container("kvferry-gateway")
    assert (
        service["spec"]["selector"].items()
        <= objects()[("Deployment", "kvferry-gateway")]["spec"]["template"]["metadata"]["labels"].items()
    )
    [service_port] = [sp for sp in service["spec"]["ports"] if sp["port"] == port]
    assert named_port(gateway, service_port["targetPort"]) == tcp_port(config()["KVFERRY_CONTROL"])[1] == port
    # The gateway is ready only once workers have registered, so they must reach it before it is ready.
    assert service["spec"]["publishNotReadyAddresses"] is True
    api = objects()[("Service", "kvferry-gateway")]
    assert api["spec"]["selector"] == service["spec"]["selector"]
    [http] = [sp for sp in api["spec"]["ports"] if sp["name"] == "http"]
    assert named_port(gateway, http["targetPort"]) == int(config()["KVFERRY_PORT"])
    assert api["metadata"]["annotations"]["prometheus.io/port"] == config()["KVFERRY_PORT"]
    assert objects()[("Deployment", "kvferry-gateway")]["spec"]["strategy"]["type"] == "Recreate"
    for name in ROLES:
        env_from = container(name)["envFrom"]
        assert {"configMapRef": {"name": "kvferry-config"}} in env_from
    decode_env = {e["name"]: e for e in container("kvferry-decode")["env"]}
    assert decode_env["KVFERRY_ADVERTISE_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    kv_port = tcp_port(config()["KVFERRY_KV_BIND"])[1]
    assert kv_port in [p["containerPort"] for p in container("kvferry-decode")["ports"]]
    assert tcp_port(config()["KVFERRY_KV_BIND"])[0] == "0.0.0.0"  # reachable at the pod IP it advertises


def test_probes_ask_the_paths_and_ports_the_processes_serve(gateway_api):
    from kvferry.services.worker_health import PATHS

    gateway = container("kvferry-gateway")
    routes = {route.path for route in gateway_api.routes()}
    ready = gateway["readinessProbe"]["httpGet"]
    assert ready["path"] in routes and named_port(gateway, ready["port"]) == int(config()["KVFERRY_PORT"])
    # The gateway's /health is 503 while it drains or has no workers: restarting it then would not help.
    assert "httpGet" not in gateway["livenessProbe"] or gateway["livenessProbe"]["httpGet"]["path"] != "/health"
    for name in WORKERS:
        c = container(name)
        ready, live, startup = (c[k]["httpGet"] for k in ("readinessProbe", "livenessProbe", "startupProbe"))
        assert (ready["path"], live["path"], startup["path"]) == ("/health", "/live", "/live")
        assert {ready["path"], live["path"]} <= set(PATHS)
        for probe in (ready, live, startup):
            assert named_port(c, probe["port"]) == int(config()["KVFERRY_HEALTH_PORT"])
        # Liveness must outlast a stall report: the pod restarts only when the loop has stopped for good.
        liveness = c["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 10


def test_grace_periods_cover_the_prestop_pause_and_the_drain():
    drain = float(config()["KVFERRY_DRAIN_TIMEOUT"])
    for name in ROLES:
        c, spec = container(name), pod(name)
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        assert spec["terminationGracePeriodSeconds"] >= float(command[1]) + drain + 5, name
        assert c["resources"]["requests"] and c["resources"]["limits"]
        assert spec["securityContext"]["runAsNonRoot"] is True


def reads(role: str, name: str, value: str, monkeypatch) -> bool:
    """Whether `kvferry ROLE` takes the variable, and takes it exactly as the matching flag."""
    from kvferry.tools.cli import build_parser

    for key in [k for k in __import__("os").environ if k.startswith("KVFERRY_")]:
        monkeypatch.delenv(key)
    flag = "--" + name.removeprefix("KVFERRY_").lower().replace("_", "-")
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    options = {o: a for a in subparsers.choices[role]._actions for o in a.option_strings}
    if flag not in options:
        return False
    by_flag = vars(build_parser().parse_args([role, flag] + ([] if options[flag].nargs == 0 else [value])))
    monkeypatch.setenv(name, value)
    by_env = vars(build_parser().parse_args([role]))
    monkeypatch.delenv(name)
    return by_env == by_flag


SAMPLE_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "kvferry-decode-7f9c-x2"}


def sample_value(entry: dict) -> str:
    """A container's env entry's value, or a sample of what its valueFrom gives."""
    if "value" in entry:
        return entry["value"]
    source = entry["valueFrom"]
    return SAMPLE_VALUES[source["fieldRef"]["fieldPath"]] if "fieldRef" in source else "a-secret-value"


def test_every_variable_the_manifests_set_is_one_kvferry_reads(monkeypatch):
    shared = config()  # loaded whole by every container (envFrom)
    users = {k: [] for k in shared}
    for name, role in ROLES.items():
        c = container(name)
        assert c["envFrom"] == [{"configMapRef": {"name": "kvferry-config"}}]
        for key in shared:
            users[key].append(role)
        for entry in c.get("env", []):  # set for this role alone: this role must read it
            assert reads(role, entry["name"], sample_value(entry), monkeypatch), f"{role} does not read {entry['name']}"
    for key, roles in users.items():
        assert any(reads(role, key, shared[key], monkeypatch) for role in roles), f"nothing reads {key}"
    # A value no role accepts is caught too, not only a name.
    assert not reads("decode", "KVFERRY_KV_BINDZ", "tcp://0.0.0.0:1", monkeypatch)


@pytest.fixture(scope="module")
def gateway_api():
    """The real gateway API over a real core, with one live worker of each role registered."""
    from tests.gateway_api import in_process_api

    with in_process_api() as api:
        register_live_workers(api.core)
        yield api


def register_live_workers(core) -> None:
    for role in (p.Role.PREFILL, p.Role.DECODE):
        core.registry.register(
            p.Register(
                role=int(role),
                worker_id=f"{role.name.lower()}-0",
                model="SmolLM2-135M-Instruct",
                dtype="float32",
                block_size=16,
                num_blocks=100,
                max_model_len=2048,
                kv_address="tcp://10.0.0.9:5600",
            ),
            b"id",
            time.time(),
        )


def test_the_autoscalers_read_metrics_the_gateway_exposes(gateway_api):
    rules = {rule["name"]["as"]: rule for rule in documents(ADAPTER_VALUES)[0]["rules"]["custom"]}
    exposition = gateway_api.metrics.exposition().decode()
    hpas = [obj for (kind, _), obj in objects().items() if kind == "HorizontalPodAutoscaler"]
    assert {hpa["spec"]["scaleTargetRef"]["name"] for hpa in hpas} == set(WORKERS)
    for hpa in hpas:
        target = hpa["spec"]["scaleTargetRef"]
        assert ("Deployment", target["name"]) in objects()
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "Object"
            described = metric["object"]["describedObject"]
            assert (described["kind"], described["name"]) == ("Service", "kvferry-gateway")  # the /metrics it reads
            rule = rules[metric["object"]["metric"]["name"]]
            series = rule["name"]["matches"].strip("^$")
            assert rule["seriesQuery"].startswith(series + "{")
            role = re.search(r'role="(\w+)"', rule["metricsQuery"]).group(1)
            assert role == WORKERS[target["name"]], "an autoscaler reads its own role's figures"
            assert re.search(rf'^{re.escape(series)}{{[^}}]*role="{role}"', exposition, re.M), (
                f"/metrics has no {series} for {role}"
            )


def test_the_dockerfile_is_well_formed_and_copies_only_what_exists(monkeypatch):
    parser = DockerfileParser(path=str(DOCKER / "Dockerfile"))
    steps = [step for step in parser.structure if step["instruction"] != "COMMENT"]
    assert steps[0]["instruction"] in ("FROM", "ARG") and parser.baseimage
    for step in steps:
        if step["instruction"] in ("COPY", "ADD") and "--from=" not in step["value"]:
            *sources, _ = step["value"].split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository (the build context)"
    users = [s["value"].split(":")[0] for s in steps if s["instruction"] == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image runs as a non-root user"
    [check] = [s["value"] for s in steps if s["instruction"] == "HEALTHCHECK"]
    command = json.loads(check[check.index("CMD") + 3 :])
    assert command[:2] == ["python", "-m"] and importlib.util.find_spec(command[2]) is not None, command
    assert command[2] == "kvferry.services.health_probe"
    assert json.loads(next(s["value"] for s in steps if s["instruction"] == "ENTRYPOINT")) == ["kvferry"]
    exposed = {int(port) for s in steps if s["instruction"] == "EXPOSE" for port in s["value"].split()}
    assert {
        int(config()["KVFERRY_PORT"]),
        int(config()["KVFERRY_HEALTH_PORT"]),
        tcp_port(config()["KVFERRY_CONTROL"])[1],
        tcp_port(config()["KVFERRY_KV_BIND"])[1],
    } <= exposed
    env = parser.envs
    from kvferry.common.model_files import cache_root

    monkeypatch.setenv("KVFERRY_CACHE_DIR", env["KVFERRY_CACHE_DIR"])
    assert cache_root() == Path(env["KVFERRY_CACHE_DIR"])  # where the build put the embedded model
    for key, value in env.items():
        if key.startswith("KVFERRY_") and key != "KVFERRY_CACHE_DIR":
            assert any(reads(role, key, value, monkeypatch) for role in ROLES.values()), f"nothing reads {key}"


def test_compose_runs_a_gateway_two_prefill_and_two_decode_workers():
    compose = documents(DOCKER / "compose.yaml")[0]
    services = compose["services"]
    assert services["gateway"]["command"] == ["gateway"]
    env_of = DockerfileParser(path=str(DOCKER / "Dockerfile")).envs
    for role in ("prefill", "decode"):
        service = services[role]
        assert service["command"] == [role] and service["deploy"]["replicas"] == 2
        env = service["environment"]
        host, port = tcp_port(env["KVFERRY_GATEWAY"])
        assert host == "gateway" and port == tcp_port(env_of["KVFERRY_CONTROL"])[1]
        assert service["depends_on"]["gateway"]["condition"] == "service_started"  # healthy needs workers
        assert service["depends_on"]["keys"]["condition"] == "service_completed_successfully"


def documented_secrets(made: Path) -> dict[str, dict[str, bytes]]:
    """The CURVE Secrets as secret.example.yaml's kubectl commands make them from a `kvferry keys` folder (keys/):
    Secret name -> its data. kubectl's --from-file=FILE adds FILE under its name, --from-file=DIR/ each file in DIR."""
    comments = [line.lstrip("#").strip() for line in (K8S / "secret.example.yaml").read_text().splitlines()]
    text = " ".join(line for line in comments if line).replace(" \\ ", " ")
    secrets = {}
    for name, sources in re.findall(r"create secret generic (kvferry-curve-\S+)((?: --from-file=\S+)+)", text):
        data = secrets[name] = {}
        for source in re.findall(r"--from-file=(\S+)", sources):
            path = made / Path(source).relative_to("keys")
            for file in [path] if path.is_file() else sorted(path.iterdir()):
                data[file.name] = file.read_bytes()
    return secrets


def test_each_role_mounts_a_mandatory_curve_secret_of_its_own_that_loads_as_its_keys(tmp_path):
    """Each pod's volume must give back the folder that its role loads (CurveKeys.for_role, as `kvferry ROLE` does),
    from its own Secret as the documented commands make it, with no secret key it does not use; the volume is not
    optional, and its files are 0440 (the pod's fsGroup reads them, and the world-readable check passes)."""
    from kvferry.common.curve import CurveKeys, generate

    made = tmp_path / "keys"
    generate(made)
    secrets = documented_secrets(made)
    needs_secret = {"gateway": {"server"}, "prefill": {"prefill"}, "decode": {"server", "decode"}}
    admitted = {"gateway": {"prefill", "decode"}, "prefill": set(), "decode": {"prefill"}}
    assert documents(K8S / "secret.example.yaml") == []  # commands only: no key in the repository
    curve_dir = config()["KVFERRY_CURVE_KEYS"]  # the ConfigMap: every pod
    for name, role in ROLES.items():
        [volume] = [v for v in pod(name)["volumes"] if v["name"] == "curve"]
        secret = volume["secret"]
        assert secret["secretName"] == f"kvferry-curve-{role}" and "optional" not in secret, (
            "a Secret per role, mandatory"
        )
        assert secret["defaultMode"] == 0o440 and all("mode" not in item for item in secret["items"])
        [mount] = [m for m in container(name)["volumeMounts"] if m["name"] == "curve"]
        assert mount["mountPath"] == curve_dir and mount["readOnly"] is True
        data = secrets[secret["secretName"]]
        assert {key.removesuffix(".key_secret") for key in data if key.endswith("_secret")} == needs_secret[role]
        mounted = tmp_path / name  # what the kubelet would project
        for item in secret["items"]:
            (mounted / item["path"]).parent.mkdir(parents=True, exist_ok=True)
            (mounted / item["path"]).write_bytes(data[item["key"]])
            (mounted / item["path"]).chmod(secret["defaultMode"])
        keys, expected = CurveKeys.for_role(mounted, role), CurveKeys.for_role(made, role)
        assert keys.server_public == expected.server_public and keys.server_secret == expected.server_secret
        assert (keys.client_public, keys.client_secret) == (expected.client_public, expected.client_secret)
        assert {holder.name for holder in keys.admitted.values()} == admitted[
            role
        ] and keys.admitted == expected.admitted


def reachable(source: dict | None, target: str, port) -> bool:
    """Whether the NetworkPolicies let a pod with the labels `source` (None: outside the namespace) reach `port` (a
    number or a name) of the target Deployment's pods, as Kubernetes reads them."""
    c, labels = container(target), objects()[("Deployment", target)]["spec"]["template"]["metadata"]["labels"]
    number = named_port(c, port)

    def selects(selector: dict, pod_labels: dict) -> bool:
        assert set(selector) <= {"matchLabels"}, "the test reads matchLabels only"
        return selector.get("matchLabels", {}).items() <= pod_labels.items()

    policies = [
        obj["spec"]
        for (kind, _), obj in objects().items()
        if kind == "NetworkPolicy"
        and "Ingress" in obj["spec"]["policyTypes"]
        and selects(obj["spec"]["podSelector"], labels)
    ]
    if not policies:
        return True  # a pod no policy selects takes everything
    for rule in (rule for policy in policies for rule in policy.get("ingress", [])):
        if rule.get("ports") and number not in [named_port(c, p["port"]) for p in rule["ports"]]:
            continue
        peers = rule.get("from") or []
        if not peers:
            return True  # from anywhere
        for peer in peers:
            assert set(peer) == {"podSelector"}, "the test reads podSelector peers only (this namespace)"
            if source is not None and selects(peer["podSelector"], source):
                return True
    return False


def test_only_kvferry_pods_reach_the_zeromq_ports_and_only_those_that_talk_to_them():
    """The gateway's control port takes the workers only, a decode worker's KV port the prefill workers only; the
    HTTP API and the worker health ports (the kubelet) take anyone."""
    labels = {
        role: objects()[("Deployment", name)]["spec"]["template"]["metadata"]["labels"] for name, role in ROLES.items()
    }
    sources = {**labels, "stranger": {"app": "other"}, "outside": None}
    allowed = {
        ("kvferry-gateway", "http"): set(sources),
        ("kvferry-gateway", "control"): {"prefill", "decode"},
        ("kvferry-decode", "kv"): {"prefill"},
        ("kvferry-decode", "health"): set(sources),
        ("kvferry-prefill", "health"): set(sources),
    }
    # Every port each pod listens on is listed: a new one must be thought about here.
    assert {(name, p["name"]) for name in ROLES for p in container(name)["ports"]} == set(allowed)
    for (target, port), who in allowed.items():
        got = {source for source, source_labels in sources.items() if reachable(source_labels, target, port)}
        assert got == who, (target, port, got)
    # The ports checked are the ones the ZeroMQ sockets bind.
    assert named_port(container("kvferry-gateway"), "control") == tcp_port(config()["KVFERRY_CONTROL"])[1]
    assert named_port(container("kvferry-decode"), "kv") == tcp_port(config()["KVFERRY_KV_BIND"])[1]


def test_no_zeromq_socket_of_the_image_compose_or_manifests_listens_beyond_loopback_without_curve(tmp_path):
    """A bind beyond loopback without keys refuses to start: every such bind must come with keys (or --insecure, said
    in plain view). In compose, a one-shot service writes the keys the first time, and every other service waits."""
    from kvferry.common.bind_check import is_local

    binds = {"gateway": "KVFERRY_CONTROL", "decode": "KVFERRY_KV_BIND"}
    assert not is_local(config()["KVFERRY_CONTROL"]) and not is_local(config()["KVFERRY_KV_BIND"])
    assert config()["KVFERRY_CURVE_KEYS"] and "KVFERRY_INSECURE" not in config()
    image_env = DockerfileParser(path=str(DOCKER / "Dockerfile")).envs
    assert not is_local(image_env["KVFERRY_CONTROL"]) and "KVFERRY_INSECURE" not in image_env
    services = documents(DOCKER / "compose.yaml")[0]["services"]
    keys = services["keys"]
    [folder] = re.findall(r"kvferry keys (\S+)", keys["entrypoint"][-1])
    [volume] = [v.split(":")[0] for v in keys["volumes"] if v.split(":")[1] == folder]
    for role in ("gateway", "prefill", "decode"):
        service = services[role]
        env = {**image_env, **service["environment"]}
        assert role not in binds or not is_local(env[binds[role]])
        assert env["KVFERRY_CURVE_KEYS"] == folder and f"{volume}:{folder}:ro" in service["volumes"], role
        assert service["depends_on"]["keys"]["condition"] == "service_completed_successfully", role
    # The keys service, run twice (a second `compose up`): the keys of the first run stay, and it succeeds.
    command = keys["entrypoint"][-1].replace(folder, str(tmp_path / "curve"))
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    subprocess.run(["sh", "-c", command], check=True, env=env, capture_output=True, timeout=120)
    first = (tmp_path / "curve" / "server.key_secret").read_bytes()
    subprocess.run(["sh", "-c", command], check=True, env=env, capture_output=True, timeout=120)
    assert (tmp_path / "curve" / "server.key_secret").read_bytes() == first


def interpolate(value: str, environment: dict) -> str:
    """compose's ${VAR}, ${VAR:-default} and ${VAR:?error} (an error when VAR is unset or empty), as compose does."""

    def one(match: re.Match) -> str:
        name, operator, word = match.group(1), match.group(2), match.group(3)
        if operator == ":?" and not environment.get(name):
            raise LookupError(word)
        if operator == ":-" and not environment.get(name):
            return word
        return environment.get(name, "")

    return re.sub(r"\$\{(\w+)(?:(:[?-])([^}]*))?\}", one, value)


def gateway_args(environment: dict, monkeypatch):
    """`kvferry gateway`'s settings from these variables alone, as the process would read them."""
    from kvferry.tools.cli import build_parser

    for key in [k for k in __import__("os").environ if k.startswith("KVFERRY_")]:
        monkeypatch.delenv(key)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    return build_parser().parse_args(["gateway"])


def test_no_http_api_of_the_image_compose_or_manifests_listens_beyond_loopback_without_a_key(monkeypatch):
    """The API listens on every interface of the pod and of the container, so a key is mandatory: Kubernetes reads it
    from a Secret that must exist (made with the documented command, no default in the repository), compose refuses
    to start without KVFERRY_API_KEY. Without the key, the gateway would refuse to start."""
    from kvferry.common.bind_check import check_http_exposed, is_loopback_host
    from kvferry.common.errors import ConfigError

    deploy = ROOT / "deploy"
    for path in sorted(deploy.rglob("*")):
        if path.is_file():
            assert "change-me" not in path.read_text(), path
    image_env = DockerfileParser(path=str(DOCKER / "Dockerfile")).envs
    assert not is_loopback_host(config()["KVFERRY_HOST"]) and not is_loopback_host(image_env["KVFERRY_HOST"])
    for env in (config(), image_env):
        assert "KVFERRY_API_KEY" not in env and "KVFERRY_INSECURE" not in env

    # Kubernetes: the gateway's key from a Secret, not optional, made by the command secret.example.yaml gives.
    [entry] = [e for e in container("kvferry-gateway").get("env", []) if e["name"] == "KVFERRY_API_KEY"]
    ref = entry["valueFrom"]["secretKeyRef"]
    assert not ref.get("optional"), "the pod waits for the Secret"
    comments = " ".join(line.lstrip("#").strip() for line in (K8S / "secret.example.yaml").read_text().splitlines())
    made = re.findall(r"create secret generic (\S+) --from-literal=(\w+)=", comments)
    assert (ref["name"], ref["key"]) in made, made
    for name in WORKERS:
        assert all(e["name"] != "KVFERRY_API_KEY" for e in container(name).get("env", []))
    pod_env = {**config(), "KVFERRY_API_KEY": sample_value(entry)}
    args = gateway_args(pod_env, monkeypatch)
    check_http_exposed(args.host, args.port, args.api_key, args.insecure)

    # compose: no key, no start; with one, the gateway has it.
    gateway = documents(DOCKER / "compose.yaml")[0]["services"]["gateway"]
    assert any(port.split(":")[-1] == image_env["KVFERRY_PORT"] for port in gateway["ports"])
    raw = gateway["environment"]["KVFERRY_API_KEY"]
    for unset in ({}, {"KVFERRY_API_KEY": ""}):
        with pytest.raises(LookupError, match="KVFERRY_API_KEY"):
            interpolate(raw, unset)
    assert interpolate(raw, {"KVFERRY_API_KEY": "k3y"}) == "k3y"
    args = gateway_args({**image_env, "KVFERRY_API_KEY": "k3y"}, monkeypatch)
    check_http_exposed(args.host, args.port, args.api_key, args.insecure)

    # What the check above would say without the key.
    args = gateway_args(config(), monkeypatch)
    with pytest.raises(ConfigError, match="--api-key"):
        check_http_exposed(args.host, args.port, args.api_key, args.insecure)
