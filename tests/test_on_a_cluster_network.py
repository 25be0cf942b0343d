"""The cluster's network (helpers.on_a_cluster.network): nodes that are network hosts, each in a
network namespace of its own, joined through a switch by shaped links. Marked `cluster` (make
cluster-tests): it needs root; elsewhere skipped, except under REQUIRE_CLUSTER=1 (CI). Where it
cannot start, what it says: tests/test_on_a_cluster.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.on_a_cluster import network as network_module
from helpers.on_a_cluster.network import NETWORK, Network, unavailable

needs_root = pytest.mark.skipif(
    unavailable() is not None and not os.environ.get("REQUIRE_CLUSTER"),
    reason=f"no network namespaces here: {unavailable()}")


@pytest.fixture
def network():
    made = Network.start(("n1", "n2"), link_mbit=400)
    yield made
    made.stop()


def on(network, node, *argv, **kwargs):
    return subprocess.run(network.command(node, list(argv)), capture_output=True, text=True,
                          timeout=60, **kwargs)


def namespaces():
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


@pytest.mark.cluster
@needs_root
def test_each_node_is_a_host_with_its_own_name_and_address(network):
    for index, node in enumerate(("n1", "n2")):
        address = str(NETWORK[1 + index])
        assert network.address(node) == address
        said = on(network, node, sys.executable, "-c",
                  "import socket; name = socket.gethostname(); "
                  "print(name, socket.gethostbyname(name), socket.gethostbyname('n1'), "
                  "socket.gethostbyname('n2'))")
        assert said.stdout.split() == [node, address, str(NETWORK[1]), str(NETWORK[2])], said
        devices = json.loads(on(network, node, "ip", "-j", "addr").stdout)
        assert {device["ifname"]: [a["local"] for a in device["addr_info"] if a["family"] ==
                                   "inet"] for device in devices} == {
            "lo": ["127.0.0.1"], "eth0": [address]}
    assert on(network, "n1", "hostname").stdout.strip() == "n1"
    assert os.uname().nodename not in ("n1", "n2")  # the machine's own name is untouched


@pytest.mark.cluster
@needs_root
def test_a_nodes_link_is_shaped_to_the_rate_set_and_its_loopback_is_not(network):
    for node in network.nodes:
        shaped = json.loads(on(network, node, "tc", "-j", "qdisc", "show", "dev", "eth0").stdout)
        assert [(q["kind"], q["options"]["rate"]) for q in shaped] == [
            ("tbf", 400 * 10**6 // 8)]  # tc reports bytes a second: 400 megabits
        loopback = json.loads(on(network, node, "tc", "-j", "qdisc", "show", "dev", "lo").stdout)
        assert [q["kind"] for q in loopback] == ["noqueue"]


@pytest.mark.cluster
@needs_root
def test_a_node_reaches_the_other_nodes_and_no_other_address(network):
    reach = ("import errno, socket, sys\n"
             "try:\n"
             "    socket.create_connection((sys.argv[1], 9), timeout=5)\n"
             "except OSError as error:\n"
             "    print(errno.errorcode[error.errno])\n")
    # the other node answers (nothing listens on its port 9: refused, so it was reached)
    said = on(network, "n1", sys.executable, "-c", reach, network.address("n2"))
    assert said.stdout.split() == ["ECONNREFUSED"], said
    # an address outside the cluster's range has no route from a node: nothing is sent
    for outside in ("10.0.0.1", "192.168.1.1", "8.8.8.8"):
        said = on(network, "n1", sys.executable, "-c", reach, outside)
        assert said.stdout.split() == ["ENETUNREACH"], (outside, said)


ALL_REDUCE = """
import os, sys, torch, torch.distributed as dist
rank, world_size, master, port, out = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                        world_size=world_size)
tensor = torch.arange(6, dtype=torch.float32) * (rank + 1)
dist.all_reduce(tensor)
torch.save({"rank": rank, "host": os.uname().nodename, "sum": tensor}, f"{out}/{rank}.pt")
dist.destroy_process_group()
"""


@pytest.mark.cluster
@needs_root
def test_ranks_on_two_nodes_all_reduce_over_the_link(network, tmp_path):
    port = "29500"  # each network is a host of its own: the port is free on n1 whatever runs here
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}
    ranks = [subprocess.Popen(network.command(node, [sys.executable, "-c", ALL_REDUCE, rank,
                                                     network.address("n1"), port, tmp_path]),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for rank, node in enumerate(("n1", "n2"))]
    said = [process.communicate(timeout=120)[0] for process in ranks]
    assert [process.returncode for process in ranks] == [0, 0], said
    expected = torch.arange(6, dtype=torch.float32) * (1 + 2)  # rank 0's part plus rank 1's
    for rank, node in enumerate(("n1", "n2")):
        result = torch.load(tmp_path / f"{rank}.pt")
        assert result["host"] == node
        torch.testing.assert_close(result["sum"], expected, rtol=0, atol=0)  # small integers


@pytest.mark.cluster
@needs_root
def test_stop_removes_every_namespace_and_hosts_file_and_start_sweeps_abandoned_ones():
    network = Network.start(("a", "b", "c"), link_mbit=100)
    made = set(network.namespaces())
    assert made <= namespaces() and len(made) == 4  # three nodes and the switch
    network.stop()
    assert not made & namespaces()
    assert not any(os.path.exists(os.path.join(network_module.HOSTS_DIR, name)) for name in made)
    # a namespace whose process ended without stop(): the next start removes it
    ended = subprocess.Popen(["true"])
    ended.wait()
    abandoned = f"{network_module.PREFIX}{ended.pid}-n1"
    subprocess.run(["ip", "netns", "add", abandoned], check=True)
    again = Network.start()
    try:
        assert abandoned not in namespaces()
    finally:
        again.stop()


@pytest.mark.cluster
@needs_root
def test_a_nodes_tmp_is_its_own_but_a_shared_folder_within_tmp_is_seen_by_every_node(tmp_path):
    shared = tmp_path / "repository"  # as a clone in /tmp, where CI may put one
    shared.mkdir()
    (shared / "code.py").write_text("print('shared')\n")
    network = Network.start(("n1", "n2"), link_mbit=100, scratch=True, shared=(str(shared),))
    try:
        for node in network.nodes:
            said = on(network, node, "sh", "-c", f"echo {node} > /tmp/mine; ls /tmp/mine; "
                                                 f"cat {shared}/code.py")
            assert said.stdout.split() == ["/tmp/mine", "print('shared')"], said
            with open(os.path.join(network.scratch(node), "mine")) as mine:
                assert mine.read() == f"{node}\n"  # each node's own /tmp, one file each
        assert not (tmp_path / "mine").exists() and not os.path.exists("/tmp/mine")
    finally:
        network.stop()
    assert not any(os.path.exists(network.scratch(node)) for node in network.nodes)
