"""`kvferry health`: exit 0 when the kvferry process in this container is healthy (a Docker HEALTHCHECK). One image
runs every role, so it asks the worker health port first, then the gateway's port; the first that answers decides.
Nothing listening on the health port means this container is not a worker, or it is still loading its model.
"""

import sys
import urllib.error
import urllib.request

from kvferry.common import settings
from kvferry.common.errors import ConfigError


def default_urls() -> list[str]:
    health_port = settings.from_env("health_port")
    urls = [f"http://127.0.0.1:{health_port}/health"] if health_port is not None else []
    urls.append(f"http://127.0.0.1:{settings.from_env('port')}/health")
    return urls


def probe(urls: list[str], timeout_s: float = 4.0) -> tuple[int, str]:
    """(exit code, what to print): 0 on a 200, 1 on any other answer or when nothing answers."""
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as reply:
                return 0, f"{url}: {reply.status} {reply.read().decode(errors='replace')}"
        except urllib.error.HTTPError as exc:
            return 1, f"{url}: {exc.code} {exc.read().decode(errors='replace')}"
        except (urllib.error.URLError, OSError):
            continue  # nothing listens there: try the next role's port
    return 1, f"nothing answers at {', '.join(urls)}"


def check(urls: list[str] | None = None) -> int:
    try:
        code, text = probe(urls or default_urls())
    except ConfigError as exc:  # a port variable that is not a port
        code, text = 1, str(exc)
    print(text, file=sys.stdout if code == 0 else sys.stderr)
    return code


if __name__ == "__main__":  # the image's HEALTHCHECK: standard library only, where `kvferry` would import torch
    sys.exit(check())
