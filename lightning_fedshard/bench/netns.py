"""A cluster of "nodes" on one Linux machine, built from network namespaces.

Each node is a network namespace with its own loopback and one ``eth0``; all ``eth0`` are veth pairs whose other
ends are ports of one bridge in a separate "switch" namespace. A benchmark launches one ``torchrun`` per node
namespace: traffic between ranks of a node stays on that node's loopback, traffic between nodes crosses the
bridge over links shaped by ``tc``, like a rack of machines with rate-limited NICs. Nothing is added to the host's
own network namespace, and every namespace is deleted again on exit, on an exception, on SIGINT and on SIGTERM
(leftovers of a run killed with SIGKILL are removed by the next run).

Needs root and iproute2 (``ip``, ``tc``); :func:`check_available` says why not when a cluster cannot be built.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs Python 3.11

# Namespace names carry the pid of the process that created them, so that a later run can tell leftovers of a
# dead process from namespaces that are still in use; the per-process counter lets one process hold several
# clusters at once.
_NAME_PREFIX = "fsb"
_NAME_PATTERN = re.compile(rf"^{_NAME_PREFIX}(\d+)-\d+-(?:sw|n\d+)$")
_cluster_ids = itertools.count()
# Namespaces built by clusters of this process that have not been torn down yet: a namespace carrying this
# process's pid but missing here is a leftover of an earlier, dead process that had the same pid.
_live_namespaces: set[str] = set()

_BRIDGE = "br0"
_NODE_INTERFACE = "eth0"
_ETHERNET_HEADER = 14
_TIMER_SLACK_S = 0.002
_QUEUE_LATENCY = "100ms"


class ClusterUnavailable(RuntimeError):
    """Why network namespaces cannot be built here (not root, iproute2 missing, not permitted)."""


def check_available() -> None:
    """Raise :class:`ClusterUnavailable`, naming every missing prerequisite, unless this process can build a cluster."""
    problems = []
    if os.geteuid() != 0:
        problems.append(f"network namespaces need root, but this process runs as uid {os.geteuid()}")
    problems += [f"`{tool}` is not on PATH (install iproute2)" for tool in ("ip", "tc") if shutil.which(tool) is None]
    if problems:
        raise ClusterUnavailable("cannot build a namespace cluster: " + "; ".join(problems))
    # root inside a container may still lack CAP_NET_ADMIN: only creating a namespace tells. The name follows
    # the cluster pattern, so that a probe left behind by a killed process is removed as stale.
    probe = f"{_NAME_PREFIX}{os.getpid()}-{next(_cluster_ids)}-n0"
    _run(["ip", "netns", "add", probe])
    _run(["ip", "netns", "del", probe])


def unavailable_reason() -> str | None:
    """Why :func:`check_available` fails here, or None when a cluster can be built (for skip conditions)."""
    try:
        check_available()
    except ClusterUnavailable as why:
        return str(why)
    return None


@dataclass(frozen=True)
class Node:
    """One node of a :class:`NamespaceCluster`."""

    index: int
    namespace: str
    address: str  # IPv4 address of ``interface``, e.g. "10.213.0.1"
    interface: str  # the node's link, inside ``namespace``
    switch_port: str  # the other end of the link: a bridge port in the switch namespace


class NamespaceCluster:
    """``num_nodes`` network namespaces joined by veth pairs to one bridge that lives in its own switch namespace.

    Every node link is shaped in both directions with a tc token bucket (tbf): on egress of the node's ``eth0``
    (uplink) and on egress of its bridge port (downlink), i.e. a full-duplex NIC of ``rate_mbit`` megabits per
    second. ``rate_mbit=None`` leaves the links unshaped. Node ``i`` has address ``{subnet_prefix}.{i + 1}``.

    Usage::

        with NamespaceCluster(2, rate_mbit=100) as cluster:
            master = cluster.nodes[0].address
            procs = [
                cluster.popen(node.index, ["torchrun", "--nnodes=2", f"--node-rank={node.index}",
                                           f"--master-addr={master}", "--nproc-per-node=2", "train.py"])
                for node in cluster.nodes
            ]
            for proc in procs:
                proc.wait()
            print(cluster.tx_bytes(0), "bytes left node 0")
        # all namespaces, and every process started with popen, are gone here

    Processes started with :meth:`popen` are killed (their whole process group) on teardown.
    """

    def __init__(
        self,
        num_nodes: int,
        rate_mbit: float | None = None,
        *,
        subnet_prefix: str = "10.213.0",
        mtu: int = 1500,
        kill_grace_s: float = 5.0,
    ) -> None:
        if not 1 <= num_nodes <= 254:
            raise ValueError(f"num_nodes must be in 1..254 (one /24 subnet), got {num_nodes}")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive or None, got {rate_mbit}")
        self.rate_mbit = rate_mbit
        self.mtu = mtu
        self.kill_grace_s = kill_grace_s
        prefix = f"{_NAME_PREFIX}{os.getpid()}-{next(_cluster_ids)}"
        self.switch_namespace = f"{prefix}-sw"
        self.nodes = [
            Node(
                index=i,
                namespace=f"{prefix}-n{i}",
                address=f"{subnet_prefix}.{i + 1}",
                interface=_NODE_INTERFACE,
                switch_port=f"p{i}",
            )
            for i in range(num_nodes)
        ]
        self._created: list[str] = []  # namespaces that exist because of this cluster, in creation order
        self._processes: list[subprocess.Popen] = []
        self._previous_handlers: dict[int, Any] = {}
        self._entered = False

    def __enter__(self) -> Self:
        if self._entered:
            raise RuntimeError("this NamespaceCluster is already entered")
        check_available()
        remove_stale_namespaces()
        self._entered = True
        self._install_signal_handlers()
        atexit.register(self.teardown)
        try:
            self._build()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.teardown()
        finally:
            self._restore_signal_handlers()
            atexit.unregister(self.teardown)
            self._entered = False

    def _build(self) -> None:
        sw = self.switch_namespace
        self._add_namespace(sw)
        _ip(sw, "link", "add", _BRIDGE, "type", "bridge")
        _ip(sw, "link", "set", _BRIDGE, "up")
        for node in self.nodes:
            ns, port, dev = node.namespace, node.switch_port, node.interface
            self._add_namespace(ns)
            _ip(ns, "link", "set", "lo", "up")
            # Created from inside the switch namespace with the peer placed straight into the node's namespace,
            # so that neither end ever appears in the host's namespace.
            _ip(sw, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns)
            _ip(sw, "link", "set", port, "mtu", str(self.mtu), "master", _BRIDGE, "up")
            _ip(ns, "link", "set", dev, "mtu", str(self.mtu))
            _ip(ns, "addr", "add", f"{node.address}/24", "dev", dev)
            _ip(ns, "link", "set", dev, "up")
        if self.rate_mbit is not None:
            self.set_rate(self.rate_mbit)

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _live_namespaces.add(name)

    def set_rate(self, rate_mbit: float | None) -> None:
        """Shape both directions of every node link to ``rate_mbit`` megabits per second; ``None`` removes shaping."""
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive or None, got {rate_mbit}")
        if not self._entered:
            raise RuntimeError("set_rate needs an entered cluster; pass rate_mbit to NamespaceCluster() instead")
        self.rate_mbit = rate_mbit
        for node in self.nodes:
            # uplink: out of the node's eth0; downlink: out of its bridge port towards the node
            for ns, dev in ((node.namespace, node.interface), (self.switch_namespace, node.switch_port)):
                if rate_mbit is None:
                    _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], missing_ok=True)
                else:
                    _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *_tbf_args(rate_mbit, self.mtu)])

    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.nodes[node].namespace, *argv]

    def popen(self, node: int, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace in a new session; teardown kills its process group."""
        proc = subprocess.Popen(self.command(node, argv), start_new_session=True, **kwargs)
        self._processes.append(proc)
        return proc

    def tx_bytes(self, node: int) -> int:
        """Bytes sent so far by node ``node``'s link (the kernel's counter, Ethernet headers included)."""
        return self._link_stats(node)["tx"]["bytes"]

    def rx_bytes(self, node: int) -> int:
        """Bytes received so far by node ``node``'s link (the kernel's counter, Ethernet headers included)."""
        return self._link_stats(node)["rx"]["bytes"]

    def _link_stats(self, node: int) -> dict[str, Any]:
        n = self.nodes[node]
        out = _ip(n.namespace, "-j", "-s", "link", "show", "dev", n.interface)
        return json.loads(out)[0]["stats64"]

    def teardown(self) -> None:
        """Kill the processes started with :meth:`popen` and delete this cluster's namespaces; safe to call again.

        Processes still inside a namespace after that (started with :meth:`command`, say) are killed with SIGKILL.
        """
        self._kill_processes()
        failures = []
        while self._created:
            name = self._created.pop()
            _live_namespaces.discard(name)
            try:
                _kill_and_delete(name)
            except RuntimeError as err:
                failures.append(str(err))
        if failures:
            raise RuntimeError("could not delete all namespaces: " + "; ".join(failures))

    def _kill_processes(self) -> None:
        procs, self._processes = self._processes, []
        # The whole group, also when its leader has exited already: torchrun's workers can outlive torchrun.
        for proc in procs:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace_s
        for proc in procs:
            proc.poll()  # reap the leader, or the group still counts as alive
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
                proc.poll()
        for proc in procs:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()

    def _install_signal_handlers(self) -> None:
        # Python only lets the main thread install handlers; a cluster entered elsewhere relies on atexit.
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(signum)
            # An ignored signal (e.g. SIGINT of a background job) stays ignored: it would not have stopped us.
            if previous is not signal.SIG_IGN:
                self._previous_handlers[signum] = previous
                signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        while self._previous_handlers:
            signum, previous = self._previous_handlers.popitem()
            signal.signal(signum, previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_handlers.get(signum, signal.SIG_DFL)
        try:
            self.teardown()
        finally:
            if callable(previous):
                previous(signum, frame)  # Python's default SIGINT handler raises KeyboardInterrupt here
            else:
                # SIG_DFL would have killed the process: exit with the shell's code for that, but let finally run
                raise SystemExit(128 + signum)


def _tbf_args(rate_mbit: float, mtu: int) -> list[str]:
    rate_bytes_per_s = rate_mbit * 1e6 / 8
    # The bucket must hold a whole frame (tbf drops larger frames it cannot segment), with room for the rounding of
    # the burst to timer ticks; at high rates it must also hold what the link sends while tbf waits for its timer
    # (about 2 ms of slack), or the link never reaches its rate.
    burst = max(2 * (mtu + _ETHERNET_HEADER), round(rate_bytes_per_s * _TIMER_SLACK_S))
    # Queue up to ~100 ms of traffic before dropping: a short queue overflows at every burst of a TCP window, and
    # TCP, halving its window at each drop, would leave the link idle part of the time.
    return ["tbf", "rate", f"{round(rate_mbit * 1e6)}bit", "burst", str(burst), "latency", _QUEUE_LATENCY]


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces of clusters whose process has died (killed with SIGKILL, say); return their names.

    Only names of the form ``fsb{pid}-{k}-sw`` / ``fsb{pid}-{k}-n{i}`` are considered; every other namespace is
    left alone.
    """
    stale = []
    for name in _list_namespaces():
        match = _NAME_PATTERN.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if (pid == os.getpid() and name not in _live_namespaces) or (pid != os.getpid() and not _pid_alive(pid)):
            _kill_and_delete(name)
            stale.append(name)
    return stale


def _list_namespaces() -> list[str]:
    # `ip netns list` prints "name" or "name (id: N)", one a line
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _kill_and_delete(name: str) -> None:
    # Deleting a namespace only deletes its name: processes still inside (like the torchrun, in its own session, of
    # a parent killed with SIGKILL) would keep running, and keep the namespace and its links alive.
    for pid in _run(["ip", "netns", "pids", name], missing_ok=True).split():
        _signal_process(int(pid), signal.SIGKILL)
    _run(["ip", "netns", "del", name], missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def _signal_process(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


# stderr of `ip` / `tc` when what a command removes or inspects is already gone
_GONE_MESSAGES = ("No such file or directory", "Cannot delete qdisc with handle of zero", "Cannot find device")
_PERMISSION_MESSAGES = ("Operation not permitted", "Permission denied")


def _ip(namespace: str, *args: str) -> str:
    return _run(["ip", "-n", namespace, *args])


def _run(argv: list[str], *, missing_ok: bool = False) -> str:
    """Run an ``ip``/``tc`` command and return its stdout; ``missing_ok`` accepts failures saying it is gone."""
    result = subprocess.run(argv, check=False, capture_output=True, text=True)
    if result.returncode == 0:
        return result.stdout
    stderr = result.stderr.strip()
    if missing_ok and any(message in stderr for message in _GONE_MESSAGES):
        return ""
    message = f"`{shlex.join(argv)}` failed with exit code {result.returncode}: {stderr or '(no stderr)'}"
    if any(text in stderr for text in _PERMISSION_MESSAGES):
        raise ClusterUnavailable(message)
    raise RuntimeError(message)
