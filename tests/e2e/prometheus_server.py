"""A real Prometheus for the tests: the Debian package's binary.

It is found on PATH, or in kvferry's cache folder (`~/.cache/kvferry/prometheus/`, or under `$KVFERRY_CACHE_DIR`),
where `make prometheus` puts it: `python -m tests.e2e.prometheus_server` downloads the package with apt (the system's
package lists, else lists of its own: no root needed) and unpacks its binary with dpkg-deb. Where apt is missing or
fails, it says why and exits 0, and the test that needs Prometheus skips with that reason.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from kvferry.common.model_files import cache_root
from kvferry.services.launcher import free_port

PACKAGE = "prometheus"  # Debian's; bookworm has 2.42
APT_TIMEOUT_S = 600


def cached_binary() -> Path:
    return cache_root() / "prometheus" / "prometheus"


def find_binary() -> str | None:
    cached = cached_binary()
    return shutil.which("prometheus") or (str(cached) if os.access(cached, os.X_OK) else None)


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=APT_TIMEOUT_S)


def install() -> str:
    """Puts Prometheus's binary into the cache folder unless one is found already; says what happened. Never raises
    for a missing or failing apt: the test then skips, naming the cause."""
    if found := find_binary():
        return f"prometheus: {found} is there already"
    missing = [tool for tool in ("apt-get", "dpkg-deb") if shutil.which(tool) is None]
    if missing:
        return f"prometheus: not installed: no {' or '.join(missing)} here (tests/e2e/test_prometheus.py will skip)"
    with tempfile.TemporaryDirectory(prefix="kvferry-prometheus-") as tmp:
        tmp = Path(tmp)
        got = _run(["apt-get", "-q", "download", PACKAGE], tmp)
        if got.returncode != 0:  # no lists, or stale ones: fetch lists of its own, into tmp, as any user may
            own = ["-o", f"Dir::State::Lists={tmp}/lists", "-o", f"Dir::Cache={tmp}/cache"]
            for sub in ("lists/partial", "cache/archives/partial"):
                (tmp / sub).mkdir(parents=True)
            update = _run(["apt-get", "-q", *own, "-o", "Debug::NoLocking=1", "update"], tmp)
            got = _run(["apt-get", "-q", *own, "download", PACKAGE], tmp)
            if got.returncode != 0:
                why = (update.stderr + got.stderr).strip().splitlines()[-3:]
                return f"prometheus: not installed: apt-get download failed ({' / '.join(why)})"
        [deb] = tmp.glob(f"{PACKAGE}_*.deb")
        unpacked = _run(["dpkg-deb", "-x", str(deb), str(tmp / "root")], tmp)
        if unpacked.returncode != 0:
            return f"prometheus: not installed: dpkg-deb -x {deb.name} failed ({unpacked.stderr.strip()})"
        target = cached_binary()
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        shutil.copy2(tmp / "root" / "usr" / "bin" / "prometheus", partial)
        partial.replace(target)  # whole or absent, even if two installs race
        (target.parent / "VERSION").write_text(deb.name + "\n")
        return f"prometheus: installed {target} from {deb.name}"


class Prometheus:
    """One Prometheus server on a free 127.0.0.1 port, with this config (a dict, written as JSON: YAML reads it),
    its data in folder; always stopped by close()."""

    def __init__(self, binary: str, config: dict, folder: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (folder / "prometheus.yml").write_text(json.dumps(config, indent=1))
        self.log_path = folder / "prometheus.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready:\n{self.log_path.read_text()[-3000:]}")

    def api(self, path: str, **params) -> list | dict:
        """GET /api/v1/<path>; its data, or an AssertionError with Prometheus's own error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read())
        assert body["status"] == "success", f"{path} {params}: {body.get('errorType')}: {body.get('error')}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's vector: [{'metric': labels, 'value': float}]."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return [{"metric": r["metric"], "value": float(r["value"][1])} for r in data["result"]]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()

    def __enter__(self) -> "Prometheus":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    try:
        print(install(), file=sys.stderr)
    except Exception as exc:  # noqa: BLE001 - `make test` goes on without it, and the test says why it skips
        print(f"prometheus: not installed: {type(exc).__name__}: {exc}", file=sys.stderr)
