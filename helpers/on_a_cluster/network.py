"""Nodes that are network hosts: each node of the course's cluster in a Linux network namespace
of its own, with its own address, loopback and host name, the nodes joined through a switch by
links of a bandwidth the course sets, as a cluster's nodes are joined by its network.

    network = Network.start(("n1", "n2"), link_mbit=800)   # as root; NetworkUnavailable elsewhere
    network.address("n1")                   # "10.77.0.1"
    subprocess.run(network.command("n1", ["hostname"]))    # runs on n1: prints n1
    network.stop()                          # the namespaces, their links and hosts files, gone

The layout, all of it inside namespaces this module makes and removes:

    n1: lo, eth0 10.77.0.1 --veth--+
                                   switch (a bridge, in a namespace of its own)
    n2: lo, eth0 10.77.0.2 --veth--+

A node's eth0 sends at most `link_mbit` megabits a second (tc's token bucket filter on its way
out: each direction of a link is shaped by the node that sends), its loopback as fast as this
machine copies memory: ranks within a node talk many times faster than ranks across nodes, as
over NVLink and InfiniBand. The addresses are one private range, NETWORK, that exists only in
these namespaces: the switch has no link to this machine's own network, so nothing a node sends
can reach another address, and this machine cannot reach the nodes but through `command`.

Each node's /etc/hosts (/etc/netns/<namespace>/hosts, bound over it where `command` runs)
names every node at its address, and `command` runs in a UTS namespace whose host name is the
node's, so `hostname` and `socket.gethostbyname(socket.gethostname())` on a node give its own
name and address, as on a cluster configured well.

With `scratch=True`, each node also has a disk of its own: its /tmp is a folder of this machine,
`scratch(node)` (/tmp/dpc<pid>-<node>), bound over /tmp in the node's mount namespace (`command`
gives each command one), so that what a node writes to /tmp no other node sees, as on a cluster's
node-local disk. A folder of this machine's /tmp that every node must still see (`shared`: the
repository, when it was cloned into /tmp) is bound back into each node's /tmp, at its own path.
Every other folder is this machine's, seen alike by every node: the shared file system.

Namespaces are named `dpc<pid>-<node>` after the process that made them: a second Network in
the same process, or in another, takes other names, and `start` first removes those whose process
is gone (a kernel killed before its `stop`), with their scratch folders.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

NETWORK = ipaddress.ip_network("10.77.0.0/24")  # the cluster's range: the nodes' addresses
PREFIX = "dpc"  # the course's namespaces: dpc<pid>-<node>, dpc<pid>-switch
SWITCH = "switch"
NETNS_DIR = "/run/netns"  # where `ip netns add` names each namespace
HOSTS_DIR = "/etc/netns"  # a node's hosts file: /etc/netns/<namespace>/hosts, iproute2's place
# A node's /tmp, with scratch=True: /tmp/<namespace> of this machine. Within /tmp, so that no node
# sees another's: each node's /tmp is its own folder.
SCRATCH_DIR = "/tmp"
# tc's token bucket: how many bytes may pass at once above the rate (a burst), and how long a
# packet may wait in the queue before it is dropped. Too small a burst keeps a link under its
# rate; with 256 KiB, two ranks' all-reduce over an 800 Mbit/s link ran at 0.096 GB/s of its
# 0.1 (benchmarks/README.md).
BURST, LATENCY_MS = "256kb", 50
_started = []  # this process's networks, for atexit


class NetworkUnavailable(RuntimeError):
    """This machine cannot make the cluster's network (not Linux, not root, no iproute2)."""


def unavailable() -> str | None:
    """Why this machine cannot make the network, or None where it can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's; this is {sys.platform}"
    if os.geteuid() != 0:
        return "making network namespaces needs root (sudo), as a real cluster's network does"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2's {' and '.join(missing)} not found (apt-get install iproute2)"
    return None


def _ip(*args: str, namespace: str | None = None) -> str:
    command = ["ip"] + (["-n", namespace] if namespace else []) + list(args)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetworkUnavailable(f"{' '.join(command)}: {done.stderr.strip()}")
    return done.stdout


def _namespaces() -> list:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _owner(namespace: str) -> int | None:
    """The process id in a course namespace's name, or None for a namespace not the course's."""
    head = namespace.split("-", 1)[0]
    return int(head[len(PREFIX):]) if head.startswith(PREFIX) and head[len(PREFIX):].isdigit() \
        else None


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def remove_abandoned() -> list:
    """Remove the course's namespaces whose process has ended; return their names."""
    gone = [name for name in _namespaces()
            if _owner(name) is not None and not _alive(_owner(name))]
    for name in gone:
        _remove_namespace(name)
    return gone


def _within_tmp(folders) -> tuple:
    """The folders that lie in this machine's /tmp (SCRATCH_DIR), as real paths, none inside
    another."""
    tmp = os.path.realpath(SCRATCH_DIR)
    inside = sorted({path for path in map(os.path.realpath, folders)
                     if path != tmp and os.path.commonpath([path, tmp]) == tmp})
    return tuple(path for path in inside
                 if not any(path.startswith(other + os.sep) for other in inside))


def _remove_namespace(name: str) -> None:
    # Its veth ends go with it; a process still inside keeps the namespace alive, unnamed, until
    # it ends (the caller ends its processes first).
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    shutil.rmtree(os.path.join(HOSTS_DIR, name), ignore_errors=True)
    shutil.rmtree(os.path.join(SCRATCH_DIR, name), ignore_errors=True)


@dataclass(eq=False)
class Network:
    nodes: tuple
    link_mbit: float
    scratch_disks: bool = False
    shared: tuple = ()  # folders under /tmp that every node sees, over its own /tmp
    owner: int = field(default_factory=os.getpid)
    stopped: bool = False

    @classmethod
    def start(cls, nodes=("n1", "n2"), link_mbit: float = 800, scratch: bool = False,
              shared: tuple = ()) -> Network:
        """Make a namespace for each node and one for the switch, and join them: node k has
        address k of NETWORK, its eth0 shaped to `link_mbit` megabits a second. `scratch`: each
        node's /tmp its own (`scratch(node)`), but the folders of `shared` that lie in this
        machine's /tmp, which every node still sees there."""
        problem = unavailable()
        if problem:
            raise NetworkUnavailable(problem)
        if not 0 < len(nodes) < NETWORK.num_addresses - 2:
            raise ValueError(f"{len(nodes)} nodes: NETWORK {NETWORK} holds 1 to "
                             f"{NETWORK.num_addresses - 3}")
        if link_mbit <= 0:
            raise ValueError(f"link_mbit is {link_mbit}; a link's megabits a second are > 0")
        remove_abandoned()
        network = cls(tuple(nodes), link_mbit, scratch, _within_tmp(shared))
        if any(name in _namespaces() for name in network.namespaces()):
            raise NetworkUnavailable(f"this process has a network already: "
                                     f"{network.namespace(SWITCH)}; stop() it first")
        _started.append(network)
        try:
            network._make()
        except BaseException:
            network.stop()
            raise
        return network

    def namespace(self, node: str) -> str:
        return f"{PREFIX}{self.owner}-{node}"

    def namespaces(self) -> list:
        return [self.namespace(node) for node in (*self.nodes, SWITCH)]

    def address(self, node: str) -> str:
        return str(NETWORK[1 + self.nodes.index(node)])

    def scratch(self, node: str) -> str:
        """The folder of this machine that is `node`'s /tmp (with scratch=True)."""
        return os.path.join(SCRATCH_DIR, self.namespace(node))

    def _in_scratch(self, node: str, folder: str) -> str:
        return os.path.join(self.scratch(node), os.path.relpath(folder, SCRATCH_DIR))

    def hosts(self) -> str:
        """Every node's /etc/hosts: localhost, and each node at its address, never at a loopback
        address (Debian's own /etc/hosts puts a machine's name at 127.0.1.1)."""
        return "127.0.0.1\tlocalhost\n" + "".join(
            f"{self.address(node)}\t{node}\n" for node in self.nodes)

    def _make(self) -> None:
        switch = self.namespace(SWITCH)
        _ip("netns", "add", switch)
        _ip("link", "add", "br0", "type", "bridge", namespace=switch)
        _ip("link", "set", "br0", "up", namespace=switch)
        for node in self.nodes:
            namespace, port = self.namespace(node), f"to-{node}"
            _ip("netns", "add", namespace)
            # the pair is made in the switch's namespace, its node end moved into the node's
            _ip("link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", namespace, namespace=switch)
            _ip("link", "set", port, "master", "br0", "up", namespace=switch)
            _ip("addr", "add", f"{self.address(node)}/{NETWORK.prefixlen}", "dev", "eth0",
                namespace=namespace)
            for device in ("lo", "eth0"):
                _ip("link", "set", device, "up", namespace=namespace)
            shaped = subprocess.run(
                ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", "eth0", "root",
                 "tbf", "rate", f"{self.link_mbit:g}mbit", "burst", BURST,
                 "latency", f"{LATENCY_MS}ms"], capture_output=True, text=True)
            if shaped.returncode != 0:
                raise NetworkUnavailable(f"tc could not shape {node}'s link: "
                                         f"{shaped.stderr.strip()}")
            folder = os.path.join(HOSTS_DIR, namespace)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "hosts"), "w") as hosts:
                hosts.write(self.hosts())
            if self.scratch_disks:
                os.makedirs(self.scratch(node), exist_ok=True)
                os.chmod(self.scratch(node), 0o1777)  # as /tmp: everyone's, each their own files
                for folder in self.shared:  # where each is bound back, in the node's /tmp
                    os.makedirs(self._in_scratch(node, folder), exist_ok=True)

    def command(self, node: str, argv: list) -> list:
        """`argv` as a command that runs on `node`: in its network namespace, with its hosts file,
        under its host name (a UTS namespace of its own), with its own /tmp (scratch=True). For
        subprocess's functions: the process started is `argv`'s own (each step execs the next)."""
        if node not in self.nodes:
            raise ValueError(f"no node {node!r}; the nodes are {', '.join(self.nodes)}")
        namespace = self.namespace(node)
        # In a mount namespace of its own, whose binds are this command's alone: the node's hosts
        # file over /etc/hosts, its scratch over /tmp. (Not `ip netns exec`, which does the same
        # but also mounts a /sys of the namespace's own, without the cgroup file systems that
        # slurmd needs.)
        binds = [(os.path.join(HOSTS_DIR, namespace, "hosts"), "/etc/hosts")]
        if self.scratch_disks:  # the shared folders into the scratch, then all of it over /tmp
            binds += [(folder, self._in_scratch(node, folder)) for folder in self.shared]
            binds.append((self.scratch(node), "/tmp"))
        mounts = "".join(f"mount --rbind {shlex.quote(source)} {shlex.quote(target)} && "
                         for source, target in binds)
        return ["nsenter", f"--net={NETNS_DIR}/{namespace}", "unshare", "--mount", "--uts",
                "sh", "-c", f'{mounts}hostname "$0" && exec "$@"', node, *map(str, argv)]

    def stop(self) -> None:
        """Remove every namespace this network made, with its links and hosts file. A process
        still running on a node is the caller's to end first."""
        if self.stopped:
            return
        self.stopped = True
        for name in self.namespaces():
            _remove_namespace(name)
        if self in _started:
            _started.remove(self)


@atexit.register
def _stop_all() -> None:
    for network in list(_started):
        network.stop()
