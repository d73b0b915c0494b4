"""NamespaceCluster builds real network namespaces: these tests need root and iproute2 and are skipped without."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_fedshard.bench.netns import ClusterUnavailable, NamespaceCluster, check_available, unavailable_reason

REPO = Path(__file__).resolve().parents[2]


UNAVAILABLE = unavailable_reason()
needs_namespaces = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an orphan's zombie waits for whatever reaps orphans here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def cluster_namespaces(cluster: NamespaceCluster) -> set[str]:
    return {cluster.switch_namespace, *(node.namespace for node in cluster.nodes)}


@pytest.fixture(autouse=True)
def no_leftovers():
    """Delete what a failing test left behind: new cluster namespaces of this process or of a dead one."""
    if UNAVAILABLE is not None:
        yield
        return
    before = namespaces()
    yield
    for name in namespaces() - before:
        match = re.match(r"^fsb(\d+)-", name)
        if match and (int(match.group(1)) == os.getpid() or not running(int(match.group(1)))):
            subprocess.run(["ip", "netns", "del", name], check=False)


def tbf_rates(namespace: str, dev: str) -> list[float]:
    """Rates in Mbit/s of the tbf qdiscs on ``dev`` (`tc -j` reports rates in bytes per second)."""
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", "-j", "qdisc", "show", "dev", dev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [q["options"]["rate"] * 8 / 1e6 for q in json.loads(out) if q["kind"] == "tbf"]


SERVER = textwrap.dedent("""
    import socket, sys
    server = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("LISTENING", flush=True)
    conn, _ = server.accept()
    received = 0
    while chunk := conn.recv(1 << 16):
        received += len(chunk)
    print(received, flush=True)
""")

CLIENT = textwrap.dedent("""
    import socket, sys
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as conn:
        conn.sendall(bytes(int(sys.argv[3])))
""")


@needs_namespaces
def test_tcp_transfer_between_nodes_is_counted():
    payload, port = 2_000_000, 29500
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with NamespaceCluster(2) as cluster:
        assert cluster_namespaces(cluster) <= namespaces()
        receiver = cluster.nodes[1].address
        server = cluster.popen(
            1, [sys.executable, "-c", SERVER, receiver, str(port)], stdout=subprocess.PIPE, text=True
        )
        assert server.stdout.readline().strip() == "LISTENING"
        sent_before = cluster.tx_bytes(0)
        client = cluster.command(0, [sys.executable, "-c", CLIENT, receiver, str(port), str(payload)])
        subprocess.run(client, check=True, timeout=20)
        received, _ = server.communicate(timeout=20)
        sent = cluster.tx_bytes(0) - sent_before

        assert int(received) == payload
        assert payload <= sent <= payload * 1.1 + 64 * 1024  # TCP/IP and Ethernet headers
        assert cluster.rx_bytes(1) >= payload
    assert not cluster_namespaces(cluster) & namespaces()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


@needs_namespaces
def test_set_rate_shapes_both_ends_of_every_link():
    with NamespaceCluster(2) as cluster:
        for node in cluster.nodes:
            assert tbf_rates(node.namespace, node.interface) == []
        cluster.set_rate(50)
        for node in cluster.nodes:
            assert tbf_rates(node.namespace, node.interface) == [50]
            assert tbf_rates(cluster.switch_namespace, node.switch_port) == [50]
        cluster.set_rate(None)
        cluster.set_rate(None)  # removing shaping that is not there is fine
        for node in cluster.nodes:
            assert tbf_rates(node.namespace, node.interface) == []
            assert tbf_rates(cluster.switch_namespace, node.switch_port) == []


@needs_namespaces
def test_rate_given_to_the_constructor_is_applied():
    with NamespaceCluster(1, rate_mbit=0.5) as cluster:
        node = cluster.nodes[0]
        assert tbf_rates(node.namespace, node.interface) == [0.5]
        assert tbf_rates(cluster.switch_namespace, node.switch_port) == [0.5]


@needs_namespaces
def test_exception_in_block_tears_down_and_kills_processes():
    with pytest.raises(ValueError, match="boom"), NamespaceCluster(2) as cluster:
        sleeper = cluster.popen(0, ["sleep", "1000"])
        untracked = subprocess.Popen(cluster.command(1, ["sleep", "1000"]))
        raise ValueError("boom")
    assert sleeper.returncode == -signal.SIGTERM
    assert untracked.wait(timeout=5) == -signal.SIGKILL  # found inside its namespace
    assert not cluster_namespaces(cluster) & namespaces()
    cluster.teardown()  # again: nothing left to delete is not an error


@needs_namespaces
def test_failed_build_names_the_command_and_tears_down():
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    cluster = NamespaceCluster(2, subnet_prefix="10.213.300")
    command = r"`ip -n fsb\S+-n0 addr add 10\.213\.300\.1/24 dev eth0` failed with exit code \d+: \S+"
    with pytest.raises(RuntimeError, match=command), cluster:
        pytest.fail("the block must not run")
    assert not cluster_namespaces(cluster) & namespaces()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


SIGNALLED = textwrap.dedent("""
    import signal, time
    from lightning_fedshard.bench.netns import NamespaceCluster

    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if started in the background
    with NamespaceCluster(2) as cluster:
        sleeper = cluster.popen(1, ["sleep", "1000"])
        print(cluster.switch_namespace, *(node.namespace for node in cluster.nodes), flush=True)
        print(sleeper.pid, flush=True)
        print("READY", flush=True)
        time.sleep(60)
""")


@needs_namespaces
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_tears_down(signum):
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    names: set[str] = set()
    try:
        names = set(proc.stdout.readline().split())
        sleeper_pid = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "READY"
        assert names <= namespaces()
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
        for name in names & namespaces():
            subprocess.run(["ip", "netns", "del", name], check=False)

    if signum == signal.SIGINT:
        assert "KeyboardInterrupt" in stderr
    else:
        assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert not names & namespaces()
    assert not running(sleeper_pid)


@needs_namespaces
def test_stale_namespaces_of_dead_processes_are_removed():
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    stale = f"fsb{reaped.pid}-0-n0"
    kept = ["fsb1-0-n0", "fsbtest-not-a-cluster"]  # pid 1 is alive; the other does not match the pattern
    try:
        for name in [stale, *kept]:
            subprocess.run(["ip", "netns", "add", name], check=True)
        with NamespaceCluster(1):
            assert stale not in namespaces()
            assert set(kept) <= namespaces()
    finally:
        for name in [stale, *kept]:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


@needs_namespaces
def test_leftovers_of_a_killed_run_are_removed_with_their_processes():
    proc = subprocess.Popen([sys.executable, "-c", SIGNALLED], cwd=REPO, stdout=subprocess.PIPE, text=True)
    names: set[str] = set()
    try:
        names = set(proc.stdout.readline().split())
        orphan = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "READY"
        proc.kill()  # SIGKILL: no teardown, the sleeper lives on inside its namespace
        proc.wait()
        assert names <= namespaces()
        assert running(orphan)
        with NamespaceCluster(1):
            assert not names & namespaces()
        assert not running(orphan)
    finally:
        proc.kill()
        proc.wait()
        for name in names & namespaces():
            subprocess.run(["ip", "netns", "del", name], check=False)


def test_check_available_wants_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterUnavailable, match="root"):
        check_available()


def test_check_available_wants_tc(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "tc" else real_which(name) or f"/bin/{name}")
    with pytest.raises(ClusterUnavailable, match="`tc`") as err:
        check_available()
    assert "`ip`" not in str(err.value)
