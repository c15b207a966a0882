"""Hosts on one machine: Linux network namespaces joined by veth pairs, each end with its own address.

Needs `ip` (Debian's iproute2) and the privilege to create namespaces (root, or CAP_SYS_ADMIN and
CAP_NET_ADMIN). `ensure_ip()` installs iproute2 when it is missing and apt-get can run; otherwise the
caller skips, with the reason this module gives.
"""

import os
import secrets
import shutil
import subprocess


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def ensure_ip() -> str | None:
    """None when namespaces can be made here; else why not."""
    if shutil.which("ip") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            return "the `ip` command (Debian's iproute2) is missing, and installing it needs root and apt-get"
        done = subprocess.run(
            ["apt-get", "install", "-y", "-q", "iproute2"],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        if done.returncode != 0:  # a fresh image has no package lists yet
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600)
            done = subprocess.run(
                ["apt-get", "install", "-y", "-q", "iproute2"],
                capture_output=True,
                text=True,
                timeout=600,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            )
        if shutil.which("ip") is None:
            return f"could not install iproute2: {done.stderr.strip()[-300:]}"
    probe = f"kvfprobe{secrets.token_hex(3)}"
    made = run("ip", "netns", "add", probe)
    if made.returncode != 0:
        return f"no privilege to create network namespaces (`ip netns add`: {made.stderr.strip()})"
    run("ip", "netns", "del", probe)
    return None


class Hosts:
    """Named namespaces ("hosts") and point-to-point links between them, torn down by close()."""

    ROOT = ""  # the test's own namespace, as one end of a link

    def __init__(self):
        self.tag = secrets.token_hex(2)
        self.names: dict[str, str] = {}  # host -> namespace
        self.ends: dict[tuple[str, str], str] = {}  # (host, peer) -> the interface on host towards peer
        self.addresses: dict[tuple[str, str], str] = {}
        self.subnet = 100 + secrets.randbelow(100)  # 10.<subnet>.<link>.0/24: unlikely to meet a real network

    def ns(self, host: str) -> str:
        return self.names[host]

    def _ip(self, host: str, *args: str) -> None:
        cmd = ("ip", *args) if host == self.ROOT else ("ip", "-n", self.names[host], *args)
        done = run(*cmd)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")

    def add(self, host: str) -> None:
        name = f"kvf{self.tag}{host}"
        done = run("ip", "netns", "add", name)
        if done.returncode != 0:
            raise RuntimeError(f"ip netns add {name}: {done.stderr.strip()}")
        self.names[host] = name
        self._ip(host, "link", "set", "lo", "up")

    def link(self, a: str, b: str) -> tuple[str, str]:
        """A veth pair between hosts a and b; returns their addresses (a's, b's)."""
        index = len(self.ends) // 2
        end_a, end_b = f"kvf{self.tag}l{index}a", f"kvf{self.tag}l{index}b"
        self._ip(self.ROOT, "link", "add", end_a, "type", "veth", "peer", "name", end_b)
        for host, end in ((a, end_a), (b, end_b)):
            if host != self.ROOT:
                self._ip(self.ROOT, "link", "set", end, "netns", self.names[host])
        addr_a, addr_b = f"10.{self.subnet}.{index}.1", f"10.{self.subnet}.{index}.2"
        for host, end, addr in ((a, end_a, addr_a), (b, end_b, addr_b)):
            self._ip(host, "addr", "add", f"{addr}/24", "dev", end)
            self._ip(host, "link", "set", end, "up")
            self.ends[(host, b if host == a else a)] = end
        self.addresses[(a, b)], self.addresses[(b, a)] = addr_a, addr_b
        return addr_a, addr_b

    def address(self, host: str, seen_from: str) -> str:
        """host's address on its link with seen_from."""
        return self.addresses[(host, seen_from)]

    def set_links(self, host: str, up: bool) -> None:
        """Bring every link of host down (cut it off) or up again."""
        for (owner, _), end in self.ends.items():
            if owner == host:
                self._ip(host, "link", "set", end, "up" if up else "down")

    def exec_prefix(self, host: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.names[host])

    def close(self) -> None:
        for name in self.names.values():  # deleting a namespace deletes its veth ends, and their peers
            run("ip", "netns", "del", name)
        for (owner, _), end in self.ends.items():
            if owner == self.ROOT:
                run("ip", "link", "del", end)
