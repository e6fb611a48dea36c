"""Network namespaces made by a test: a client namespace joined by a veth pair to each
replica's namespace, with 10.200.<k>.x addresses that exist only inside them, and drop
rules (nftables) that cut one replica off and heal it. Nothing touches the host's own
interfaces or rules: every command runs inside a namespace made here, and ``close`` deletes
them (which removes their veths and rules with them)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

#: Why a test cannot run here, or None.


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (apt-get install -y iproute2 nftables)"
    name = f"epprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                          check=False)
    if made.returncode:
        return f"the kernel refused a network namespace: {made.stderr.strip()}"
    try:
        nft = subprocess.run(["ip", "netns", "exec", name, "nft", "list", "ruleset"],
                             capture_output=True, text=True, check=False)
        if nft.returncode:
            return f"nftables is refused inside a namespace: {nft.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
    return None


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


class Namespaces:
    """``client`` and ``replicas`` namespaces; replica ``k`` listens on ``address(k)``."""

    def __init__(self, replicas: int, tag: str = "") -> None:
        base = f"ep{tag or os.getpid() % 100000}"
        self.client = f"{base}c"
        self.replicas = [f"{base}r{k}" for k in range(replicas)]
        self._made: list[str] = []
        try:
            for ns in (self.client, *self.replicas):
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            for k, ns in enumerate(self.replicas):
                here, there = f"{base}v{k}a", f"{base}v{k}b"
                _run("ip", "link", "add", here, "netns", self.client, "type", "veth",
                     "peer", "name", there, "netns", ns)
                _run("ip", "-n", self.client, "addr", "add", f"10.200.{k + 1}.1/24", "dev", here)
                _run("ip", "-n", ns, "addr", "add", f"10.200.{k + 1}.2/24", "dev", there)
                _run("ip", "-n", self.client, "link", "set", here, "up")
                _run("ip", "-n", ns, "link", "set", there, "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def address(k: int) -> str:
        return f"10.200.{k + 1}.2"

    def exec_prefix(self, ns: str) -> Sequence[str]:
        return ("ip", "netns", "exec", ns)

    def cut(self, k: int) -> None:
        """Drop every packet in and out of replica ``k``'s namespace (no reset, no answer:
        as a dead switch port or a partition looks from the client)."""
        ns = self.replicas[k]
        _run("ip", "netns", "exec", ns, "nft", "add", "table", "inet", "partition")
        for hook in ("input", "output"):
            _run("ip", "netns", "exec", ns, "nft", "add", "chain", "inet", "partition", hook,
                 f"{{ type filter hook {hook} priority 0 ; policy drop ; }}")
            # the namespace's own loopback stays up (a replica's workers talk over it)
            _run("ip", "netns", "exec", ns, "nft", "add", "rule", "inet", "partition", hook,
                 "meta", "iifname" if hook == "input" else "oifname", "lo", "accept")

    def heal(self, k: int) -> None:
        _run("ip", "netns", "exec", self.replicas[k], "nft", "delete", "table", "inet",
             "partition")

    def close(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        self._made = []
