"""A real, shaped network link between two local ranks (Linux, root, iproute2 with tc).

Two network namespaces joined by one veth pair, created straight inside the namespaces (the
root namespace is never touched): addresses 198.18.0.1/30 and 198.18.0.2/30 (the
benchmarking range, RFC 2544), loopback up in each, and a token-bucket filter (``tbf``) on
both ends limiting each direction to the given rate. Each rank runs under ``ip netns exec``
with gloo bound to its veth (``GLOO_SOCKET_IFNAME``), so every byte of its collectives
crosses the shaped link. Leaving the ``with`` block (or an error) deletes both namespaces,
which deletes the veth pair and its shaping. Latency is not shaped (no ``netem`` here): it
is the veth's own, a few microseconds.

Each namespace may also be a *node* of several ranks (:meth:`ShapedPair.popen_node`): ranks
inside one namespace bind gloo to its veth address too, but traffic between two addresses of
the same namespace goes over its loopback (the kernel's local route), so only the traffic
between the two nodes crosses the shaped pair. :meth:`ShapedPair.counters` reads the veth's
byte and packet counters (``ip -s -j link``) to set against what thinwire's meter counted.

Not part of the package.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

ADDRESSES = ("198.18.0.1", "198.18.0.2")


def unavailable() -> str | None:
    """Why a shaped pair cannot be made here, or None when it can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    probe = f"twprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class ShapedPair:
    """Two namespaces and a veth pair shaped to ``rate_mbit`` Mbit/s each way."""

    def __init__(self, rate_mbit: float, burst_kbyte: int = 32) -> None:
        tag = f"tw{os.getpid() % 100000}"
        self.namespaces = (f"{tag}a", f"{tag}b")
        self.devices = (f"{tag}a0", f"{tag}b0")  # interface names stay under 16 characters
        self.rate_mbit, self.burst_kbyte = rate_mbit, burst_kbyte

    def __enter__(self) -> ShapedPair:
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
            (a, b), (da, db) = self.namespaces, self.devices
            _ip("link", "add", da, "netns", a, "type", "veth", "peer", "name", db, "netns", b)
            for ns, dev, addr in zip(self.namespaces, self.devices, ADDRESSES):
                _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                      f"{self.rate_mbit:.3f}mbit", "burst", f"{self.burst_kbyte}kb", "latency", "200ms"])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.namespaces:  # deleting a namespace deletes its veth end and the qdisc
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def popen(self, rank: int, cmd: Sequence[str], env: dict[str, str], **kw) -> subprocess.Popen:
        """Start ``cmd`` as rank ``rank`` inside its namespace, gloo bound to its veth, rank 0
        the rendezvous (``MASTER_ADDR`` = its address)."""
        env = dict(env, MASTER_ADDR=ADDRESSES[0], RANK=str(rank), WORLD_SIZE="2",
                   GLOO_SOCKET_IFNAME=self.devices[rank])
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[rank], *cmd], env=env, **kw)


    def popen_node(self, node: int, local: int, per_node: int, cmd: Sequence[str], env: dict[str, str],
                   **kw) -> subprocess.Popen:
        """Start ``cmd`` as local rank ``local`` of node ``node`` (its namespace), with
        ``per_node`` ranks on each of the two nodes, numbered as torchrun numbers them (rank =
        node * per_node + local; ``LOCAL_RANK``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE`` set)."""
        rank = node * per_node + local
        env = dict(env, MASTER_ADDR=ADDRESSES[0], RANK=str(rank), WORLD_SIZE=str(2 * per_node),
                   LOCAL_RANK=str(local), GROUP_RANK=str(node), LOCAL_WORLD_SIZE=str(per_node),
                   GLOO_SOCKET_IFNAME=self.devices[node])
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *cmd], env=env, **kw)

    def counters(self) -> dict[str, int]:
        """The first namespace's veth counters: ``tx_bytes``/``tx_packets`` (node 0 to node 1)
        and ``rx_bytes``/``rx_packets`` (node 1 to node 0), headers included."""
        return veth_counters(self.devices[0])


def veth_counters(device: str, namespace: str | None = None) -> dict[str, int]:
    """``device``'s byte and packet counters (``ip -s -j link show``), in ``namespace`` or the
    caller's own (a rank inside a namespace reads its own veth)."""
    import json

    cmd = ["ip", *(["-n", namespace] if namespace else []), "-s", "-j", "link", "show", "dev", device]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    stats = json.loads(done.stdout)[0]["stats64"]
    return {"tx_bytes": stats["tx"]["bytes"], "tx_packets": stats["tx"]["packets"],
            "rx_bytes": stats["rx"]["bytes"], "rx_packets": stats["rx"]["packets"]}


def run_nodes(rate_mbit: float, per_node: int, cmd: Sequence[str], *, port: int, timeout: float, tag: str) -> dict:
    """``cmd`` (a rank's command line, given ``--result PATH``) as ``per_node`` ranks in each of
    two namespaces joined by a veth shaped to ``rate_mbit`` Mbit/s (1 torch thread each, this
    folder on their path); returns what rank 0 wrote to ``PATH`` as JSON. Raises naming the
    rate, with the ranks' last output, when no result was written."""
    out = Path(tempfile.gettempdir()) / f"thinwire-{tag}-{os.getpid()}-{rate_mbit:g}.json"
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=path)
    with ShapedPair(rate_mbit) as pair:
        procs = [pair.popen_node(node, local, per_node, [*cmd, "--result", str(out)], env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for node in (0, 1) for local in range(per_node)]
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    if not out.exists():
        raise RuntimeError(f"a rank failed at {rate_mbit:g} Mbit/s:\n" + "\n".join(log[-3000:] for log in logs))
    result = json.loads(out.read_text())
    out.unlink()
    return result


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
