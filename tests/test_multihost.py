"""Two hosts, for real: two network namespaces joined by a veth pair, one torchrun each.

Each namespace is a host with its own network stack and address; the nodes meet
through torchrun's c10d rendezvous on host A's address and train the README's
example through fastreduce with 2 processes per node (world size 4). The example
itself fails unless every rank ends with bit-identical parameters.

Needs root and iproute2 (``ip netns``); skipped elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Yield ``[(namespace, interface, address), ...]`` for hosts A and B; remove them after."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = os.getpid() % 10000
    subnet = f"10.231.{tag % 250}"
    hosts = [(f"frA{tag}", f"frA{tag}v", f"{subnet}.1"), (f"frB{tag}", f"frB{tag}v", f"{subnet}.2")]
    made: list[str] = []
    try:
        for ns, _, _ in hosts:
            _ip("netns", "add", ns)
            made.append(ns)
        (ns_a, if_a, _), (ns_b, if_b, _) = hosts
        _ip("link", "add", if_a, "type", "veth", "peer", "name", if_b)
        for ns, ifname, addr in hosts:
            _ip("link", "set", ifname, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {e.stderr.strip()}")
    yield hosts
    for ns in made:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_hosts_train_in_sync_through_torchrun(two_hosts):
    (_, _, addr_a), _ = two_hosts
    endpoint = f"{addr_a}:29{os.getpid() % 1000:03d}"
    procs = []
    for k, (ns, ifname, addr) in enumerate(two_hosts):
        # The namespaces share the machine's hostname, so torchrun can tell neither which
        # node serves the rendezvous store (is_host: host A) nor which address a node's
        # workers are reached at (--local-addr): both are said explicitly.
        cmd = ["ip", "netns", "exec", ns, "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"',
               "host", "env", f"GLOO_SOCKET_IFNAME={ifname}",
               sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "fastreduce-test",
               "--rdzv-conf", f"is_host={int(k == 0)},join_timeout=60", "--local-addr", addr,
               str(ROOT / "examples" / "train.py"), "--steps", "20", "--wire", "fp32"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=180)
            outputs.append(out)
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    summary = [line for out in outputs for line in out.splitlines() if "parameters identical" in line]
    assert len(summary) == 1, outputs  # printed by global rank 0 only, on one of the hosts
    assert summary[0].startswith("4 ranks on cpu (gloo)"), summary
    assert summary[0].endswith("parameters identical on all ranks: True"), summary
    text = "".join(outputs)
    assert "shared-memory transport off" in text and "several hosts" in text, text[-3000:]
    assert "shared memory)" not in text  # no reducer averaged through /dev/shm
