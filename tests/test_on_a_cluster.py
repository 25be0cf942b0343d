"""Lesson 15's cluster (helpers.on_a_cluster): a real Slurm of two nodes on this machine, the
capstone submitted to it, requeued mid-run and equal to plain torchrun bit for bit. Marked
`cluster` (make cluster-tests): each test starts a cluster of its own, as root, with Debian's
slurm-wlm and munge; elsewhere they are skipped, except under REQUIRE_CLUSTER=1 (CI), where a
cluster that cannot start fails them."""

import dataclasses
import os
import re
import subprocess
import sys
import time

import pytest

from helpers.capstone.job import arguments_for, records
from helpers.on_a_cluster import cluster as cluster_module
from helpers.on_a_cluster import network as network_module
from helpers.on_a_cluster import slurm, storage, training
from helpers.on_a_cluster.cluster import Cluster, ClusterUnavailable, unavailable
from helpers.on_a_cluster.network import Network, NetworkUnavailable

needs_cluster = pytest.mark.skipif(
    unavailable() is not None and not os.environ.get("REQUIRE_CLUSTER"),
    reason=f"no cluster here: {unavailable()}")


@pytest.mark.parametrize("module, start, error, without_root, install", [
    (cluster_module, Cluster.start, ClusterUnavailable, "not root",
     "apt-get install slurm-wlm munge"),
    (network_module, Network.start, NetworkUnavailable, "needs root", "apt-get install iproute2"),
], ids=["cluster", "network"])
def test_where_the_cluster_or_its_network_cannot_start_it_says_why(monkeypatch, module, start,
                                                                   error, without_root, install):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert "Linux" in module.unavailable()
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert without_root in module.unavailable()
    with pytest.raises(error, match=without_root):
        start()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(module.shutil, "which", lambda name, path=None: None)
    assert install in module.unavailable()


def listening(namespace: str | None) -> list:
    """Every listening TCP socket in a network namespace (None: this machine's own), as
    "address:port program"."""
    command = ["ss", "-Hltnp"] if namespace is None else [
        "nsenter", f"--net={network_module.NETNS_DIR}/{namespace}", "ss", "-Hltnp"]
    lines = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    found = []
    for line in filter(str.strip, lines.splitlines()):
        program = re.search(r'\(\("([^"]+)"', line)
        found.append(f"{line.split()[3]} {program.group(1) if program else '?'}")
    return sorted(found)


@pytest.mark.cluster
@needs_cluster
def test_the_nodes_are_hosts_of_their_own_with_local_disks_and_the_daemons_bind_only_there():
    cluster = Cluster.start()
    namespaces, address = cluster.network.namespaces(), cluster.network.address
    try:
        assert cluster.run(["sinfo", "-h", "-N", "-o", "%N %T %c"]).split() == [
            "n1", "idle", str(cluster_module.CPUS_PER_NODE),
            "n2", "idle", str(cluster_module.CPUS_PER_NODE)]
        # each task on a host of its own name and address, writing to a /tmp of its own
        said = cluster.run(["srun", "--nodes=2", "--ntasks=2", "bash", "-c",
                            "echo $SLURM_PROCID $SLURMD_NODENAME $(hostname) $(hostname -i) "
                            "> /tmp/mine-$SLURM_PROCID; echo $(cat /tmp/mine-*)"])
        assert sorted(said.splitlines()) == [f"0 n1 n1 {address('n1')}",
                                             f"1 n2 n2 {address('n2')}"]
        for rank, node in enumerate(cluster_module.NODES):  # (beside any shared folder's place)
            assert [name for name in os.listdir(cluster.network.scratch(node))
                    if name.startswith("mine-")] == [f"mine-{rank}"]
        # each daemon listens on its own host's address, and this machine's own network has none
        assert {node: listening(cluster.network.namespace(node))
                for node in (*cluster_module.NODES, cluster_module.LOGIN)} == {
            "n1": [f"{address('n1')}:6818 slurmd"], "n2": [f"{address('n2')}:6818 slurmd"],
            "login": [f"{address('login')}:6817 slurmctld"]}
        assert not [line for line in listening(None) if "slurm" in line or "munge" in line]
        # one cluster a process: a second is refused, saying where the first is
        with pytest.raises(ClusterUnavailable, match=f"up in this process already, in "
                                                     f"{re.escape(cluster.directory)}"):
            Cluster.start()
        assert Cluster.running() is cluster
        pids = [process.pid for process in cluster.processes.values()]
        assert len(pids) == 4  # munged, slurmctld, two slurmd
    finally:
        assert cluster.stop() == []
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    assert not os.path.exists(cluster.directory)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not set(namespaces) & {line.split()[0] for line in listed.splitlines() if line}
    for namespace in namespaces:
        for folder in (network_module.HOSTS_DIR, network_module.SCRATCH_DIR):
            assert not os.path.exists(os.path.join(folder, namespace))
    assert Cluster.running() is None


@pytest.mark.cluster
@needs_cluster
def test_a_job_left_running_is_cancelled_and_its_processes_ended_by_stop():
    cluster = Cluster.start()
    try:
        job = slurm.submit(cluster, "#!/bin/bash\nsrun sleep 600\n", cluster.path("sleeper"),
                           nodes=1)
        slurm.follow(cluster, job, until=lambda: bool(cluster.leftover_processes()),
                     timeout=30)
        sleepers = cluster.leftover_processes()
        assert sleepers  # the job's shell, srun, sleep: this cluster's, by their environment
    finally:
        assert cluster.stop() == []  # cancelled and ended by Slurm, none left to kill
    assert not any(os.path.exists(f"/proc/{pid}") for pid in sleepers)


# Both ways a job is requeued, one after the other in one job (each way alone took a cluster and a
# job of its own, and the same reference run): by hand (`scontrol requeue`, as an administrator
# or a preemption does), then by capstone.sbatch's own trap at a time limit's warning (USR1 to the
# batch shell alone, what --signal=B:USR1@120 sends; here scancel --batch sends it), which
# requeues the job itself. Each time Slurm stops the ranks with SIGTERM, they save, and the job
# runs again from there.
@pytest.mark.cluster
@pytest.mark.starts_first  # about 2 minutes: three runs of the job, and plain torchrun's
@needs_cluster
def test_a_job_requeued_by_hand_then_at_a_time_limits_warning_ends_equal_to_plain_torchrun():
    config = training.LESSON_CONFIG
    with Cluster.start() as cluster:
        directory = cluster.path("capstone")
        job = slurm.submit(cluster, slurm.SCRIPT, directory, *arguments_for(config))
        slurm.follow(cluster, job, until=lambda: slurm.last_step(directory) >= 3, timeout=90)
        by_hand_after = slurm.last_step(directory)
        slurm.requeue(cluster, job)

        def second_run_trained_two_steps():
            started = [event["step"] for event in slurm.events(directory)
                       if event["event"] == "started" and event["restart"] == 1]
            return bool(started) and slurm.last_step(directory) >= started[0] + 2

        requeued = slurm.follow(cluster, job, until=second_run_trained_two_steps, timeout=120)
        warned_after = slurm.last_step(directory)
        slurm.warn_of_time_limit(cluster, job)
        warned = slurm.follow(cluster, job, timeout=120)
        assert "PENDING (BeginTime)" in slurm.states(requeued)
        assert "PENDING (BeginTime)" in slurm.states(warned)
        assert slurm.job_fields(cluster, job, ("JobState", "Restarts")) == {
            "JobState": "COMPLETED", "Restarts": "2"}
        with open(os.path.join(directory, f"capstone-{job}.out")) as out:
            assert out.read().count("time limit near: requeueing") == 1
        events = slurm.events(directory)
        steps, _ = records(directory)
    # each time, every rank stopped after the same step, at or after the one seen, and the next
    # run started from it
    stops = {}
    for event in events:
        if event["event"] == "stopping":
            stops.setdefault(event["step"], set()).add(event["rank"])
    assert list(stops.values()) == [{0, 1, 2, 3}] * 2, stops
    for run, (step, seen) in enumerate(zip(sorted(stops), (by_hand_after, warned_after))):
        assert step >= seen
        assert {event["step"] for event in events if event["event"] == "started"
                and event["restart"] == run + 1} == {step}
    # each node ran one torchrun with two ranks, in all three runs
    for run in (0, 1, 2):
        started = [event for event in events
                   if event["event"] == "started" and event["restart"] == run]
        by_node = {}
        for event in started:
            by_node.setdefault(event["node"], []).append(event["local_rank"])
        assert sorted(by_node) == ["n1", "n2"]
        assert all(sorted(ranks) == [0, 1] for ranks in by_node.values())
        assert all(event["torchrun"] for event in started)
    trained = [event["step"] for event in events
               if event["event"] == "step" and event["rank"] == 0]
    assert trained == list(range(1, config.steps + 1))  # no step lost, none trained twice
    reference = training.reference_losses(config)
    assert {step: record["loss"] for step, record in steps.items()} == reference


def test_the_node_list_exercise_is_checked_where_slurm_is_not_installed(monkeypatch):
    """A laptop without Slurm (macOS): the checker takes Slurm's expansion as recorded."""
    from helpers.exercises import check, solution
    from helpers.on_a_cluster import exercises

    monkeypatch.setattr(exercises.shutil, "which", lambda name: None)
    monkeypatch.setattr(exercises, "_slurms_hostnames", None)  # never called
    assert check("hostnames", solution("hostnames")).passed
    unpadded = check("hostnames", lambda nodelist: [
        name.replace("gpu0", "gpu") for name in solution("hostnames")(nodelist)])
    assert not unpadded.passed and "the width of" in repr(unpadded)


def test_every_variable_a_job_gets_beyond_the_kernels_is_explained(tmp_path):
    """What slurm.submit adds to the kernel's environment is what the lesson shows, each with
    what it would do on two real nodes."""
    class Stub:  # job_environment's only use of a cluster
        conf = str(tmp_path / "slurm.conf")

        def environment(self, **extra):
            return {**os.environ, "SLURM_CONF": self.conf, **extra}

    added = slurm.added_environment(Stub())
    assert set(added) <= set(slurm.ADDED)
    assert {"PATH", "PYTHONPATH", "SLURM_CONF"} <= set(added)
    # lesson 12's interface, this machine's loopback, would keep the nodes from meeting
    assert "GLOO_SOCKET_IFNAME" not in slurm.job_environment(Stub())


def test_a_job_followed_past_its_timeout_says_in_which_state_it_was_left():
    class Stub:  # follow's only use of a cluster: squeue's line
        def run(self, command, check=True):
            return "PENDING|ReqNodeNotAvail, UnavailableNodes:n2|\n"

    with pytest.raises(TimeoutError,
                       match=r"^job 7 still PENDING \(ReqNodeNotAvail, UnavailableNodes:n2\) "
                             r"after 0 s$") as raised:
        slurm.follow(Stub(), "7", timeout=0, every=0)
    assert raised.value.state == "PENDING (ReqNodeNotAvail, UnavailableNodes:n2)"


@pytest.mark.cluster
@needs_cluster
def test_an_error_inside_a_cluster_carries_what_slurm_saw():
    with pytest.raises(AssertionError) as raised, Cluster.start() as cluster:
        job = slurm.submit(cluster, "#!/bin/bash\necho started\nsleep 600\n",
                           cluster.path("sleeper"), nodes=1)
        slurm.follow(cluster, job, until=lambda: os.path.exists(
            cluster.path("sleeper", f"slurm-{job}.out")), timeout=30)
        raise AssertionError("the test's own check")
    report = "\n".join(raised.value.__notes__)
    assert f"  job {job} RUNNING on n1" in report.splitlines()
    assert "  node n1 mixed" in report.splitlines()  # one of its CPUs taken
    assert "  node n2 idle" in report.splitlines()
    assert "slurmctld.log, last lines:" in report
    assert f"sleeper/slurm-{job}.out, last lines:" in report


@pytest.mark.cluster
@needs_cluster
def test_a_kernel_killed_with_its_cluster_leaves_no_daemon_and_the_next_start_removes_its_folder():
    child = subprocess.Popen(
        [sys.executable, "-c", "from helpers.on_a_cluster.cluster import Cluster\n"
         "cluster = Cluster.start()\n"
         "print(cluster.directory, *(p.pid for p in cluster.processes.values()), flush=True)\n"
         "import time; time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    folder, *pids = child.stdout.readline().split()
    child.kill()  # no atexit, no stop(): as a kernel killed by its notebook server
    child.wait()
    for _ in range(50):  # Linux sends each daemon SIGTERM as its parent dies (PR_SET_PDEATHSIG)
        if not any(os.path.exists(f"/proc/{pid}") for pid in pids):
            break
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    left = f"{network_module.PREFIX}{child.pid}-"  # its namespaces, which only a start removes
    with Cluster.start():  # (or another test's start in between, on another worker)
        assert not os.path.exists(folder)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert left not in listed
        assert not [name for name in os.listdir(network_module.SCRATCH_DIR)
                    if name.startswith(left)]


def test_what_a_job_said_is_its_errors_not_the_header_of_a_cpp_backtrace():
    """Lesson 15's "it said": the ranks' errors first, else the agents'; c10's backtrace header,
    printed only when a failing call got that far before the job was cancelled, is neither."""
    from helpers.on_a_cluster.failures import errors_in

    agent = ("[W1130 socket.cpp] a warning\n"
             "Exception raised from ping at /__w/pytorch/torch/csrc/TCPStore.cpp:427 (most recent\n"
             "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n")
    assert errors_in([agent]) == ["RendezvousTimeoutError"]
    assert errors_in([agent, "[rank1]: ValueError: a mesh needs 4 ranks, not 2\n"]) == [
        "ValueError: a mesh needs 4 ranks, not 2"]
    assert errors_in(["Exception raised from ping at /x/TCPStore.cpp:427 (most recent\n"]) == []


@pytest.mark.cluster
@needs_cluster
def test_a_checkpoint_in_a_nodes_own_tmp_is_not_found_when_the_job_moves_to_another_node():
    config = dataclasses.replace(training.LESSON_CONFIG, dp=2, tp=1, steps=8, save_every=0)
    with Cluster.start() as cluster:
        moved = storage.moved_to_another_node(cluster, cluster.path("scratch"),
                                              arguments_for(config), after=2)
        assert sorted(moved.nodes) == list(cluster_module.NODES)  # one run on each
        first, second = moved.nodes
        assert moved.stopped_at >= 2
        # the checkpoint was saved, complete, on the first node's disk ...
        saved = os.path.join(cluster.network.scratch(first), storage.CHECKPOINTS,
                             f"step-{moved.stopped_at:04d}")
        assert os.path.exists(os.path.join(saved, ".metadata"))
        # ... where the second node cannot see it: it started over
        assert moved.started_from == 0
        assert moved.log == [f"restart 0 on {first}: newest checkpoint none",
                             f"restart 1 on {second}: newest checkpoint none"]
        assert not os.path.exists(os.path.join(cluster.network.scratch(second),
                                               storage.CHECKPOINTS, f"step-{moved.stopped_at:04d}"))
        assert cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"]).split() == [
            "n1", "idle", "n2", "idle"]  # the drained node back in service


@pytest.mark.cluster
@needs_cluster
def test_gpus_are_slurm_resources_that_each_task_sees_as_on_a_gpu_cluster():
    gpus = cluster_module.GPUS_PER_NODE
    with Cluster.start() as cluster:
        assert cluster.run(["sinfo", "-h", "-N", "-o", "%N %G"]).split() == [
            "n1", f"gpu:{gpus}", "n2", f"gpu:{gpus}"]

        def seen(*options):  # {(node, task on the node): CUDA_VISIBLE_DEVICES}
            said = cluster.run(["srun", "--quiet", "--nodes=2", f"--ntasks-per-node={gpus}",
                                *options,
                                "bash", "-c", "echo $SLURMD_NODENAME $SLURM_LOCALID "
                                              "${CUDA_VISIBLE_DEVICES-unset}"])
            return {(node, int(local)): devices
                    for node, local, devices in map(str.split, said.splitlines())}

        every = ",".join(map(str, range(gpus)))
        tasks = [(node, local) for node in cluster_module.NODES for local in range(gpus)]
        # a node's GPUs for every task on it: a rank takes cuda:<LOCAL_RANK> of them
        assert seen(f"--gpus-per-node={gpus}") == {task: every for task in tasks}
        assert seen(f"--gres=gpu:{gpus}") == {task: every for task in tasks}
        # a GPU a task: each sees its own, as its device 0
        assert seen("--gpus-per-task=1") == {(node, local): str(local) for node, local in tasks}
        assert seen() == {task: "unset" for task in tasks}  # no GPU asked, none given
        with pytest.raises(subprocess.CalledProcessError,
                           match="Requested node configuration is not available"):
            cluster.run(["srun", "--nodes=1", f"--gres=gpu:{gpus + 1}", "true"])


@pytest.mark.cluster
@needs_cluster
def test_the_gpu_batch_script_runs_a_rank_a_gpu_checks_the_link_then_trains():
    config = dataclasses.replace(training.LESSON_CONFIG, steps=3, save_every=0)
    with Cluster.start() as cluster:
        directory = cluster.path("gpu")
        job = slurm.submit(cluster, slurm.GPU_SCRIPT, directory, *arguments_for(config))
        slurm.follow(cluster, job, timeout=120)
        states = [row["State"] for row in slurm.finished(cluster) if row["JobID"] == job]
        with open(os.path.join(directory, f"capstone-gpu-{job}.out")) as out:
            said = out.read()
        assert states == ["COMPLETED"], said[-3000:]
        steps, _ = records(directory)
    given = sorted(line for line in said.splitlines() if re.match(r"rank \d on n\d:", line))
    assert given == [f"rank {rank} on n{1 + rank // 2}: LOCAL_RANK {rank % 2}, "
                     f"CUDA_VISIBLE_DEVICES 0,1, device cpu, backend gloo" for rank in range(4)]
    assert re.search(r"all-reduce of 64 MiB over 4 ranks: busbw \d+\.\d{3} GB/s", said)
    assert sorted(steps) == [1, 2, 3]  # then the training, to its end


@pytest.mark.cluster
@needs_cluster
def test_the_gpu_batch_script_runs_by_hand_in_the_allocation_its_header_says_salloc_gives():
    config = dataclasses.replace(training.LESSON_CONFIG, steps=3, save_every=0)
    with open(slurm.GPU_SCRIPT) as script:
        header = script.read()
    salloc = re.search(r"`(salloc [^`]+)`", header.replace("\n# ", " ")).group(1)
    with Cluster.start() as cluster:
        directory = cluster.path("salloc")
        os.makedirs(directory)
        said = cluster.run([*salloc.split(), "bash", slurm.GPU_SCRIPT, directory,
                            *arguments_for(config)], env=slurm.job_environment(cluster),
                           timeout=150)
        steps, _ = records(directory)
    assert "2 GPUs a node" in said
    assert len(re.findall(r"rank \d on n\d: LOCAL_RANK \d, CUDA_VISIBLE_DEVICES 0,1", said)) == 4
    assert sorted(steps) == [1, 2, 3]
