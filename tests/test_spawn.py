"""helpers.spawn and run(init_group=False): code that starts its own process group runs unchanged.

The lecture's code and the tutorials' start every worker with a setup() that sets MASTER_ADDR
(and often MASTER_PORT) and calls init_process_group; they launch with mp.spawn(fn, args, nprocs).
"""

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from workers import (
    env_rendezvous_worker,
    leave_group_initialised,
    too_few_processes,
    tutorial_style_worker,
)

from helpers import WorkerError, WorkerTimeout, run, spawn


def expected_tutorial_weight(world_size):
    """One SGD step (lr 0.1) from ones: rank r's inputs are 2 rows of r + 1, so its gradient is
    2 (r + 1) per weight, and DDP averages it over the ranks."""
    mean_gradient = sum(2 * (r + 1) for r in range(world_size)) / world_size
    return torch.full((1, 3), 1 - 0.1 * mean_gradient)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_tutorial_style_worker_runs_unchanged(world_size):
    out = spawn(tutorial_style_worker, args=(world_size,), nprocs=world_size, show_output=False)
    for weight in out:
        torch.testing.assert_close(weight, expected_tutorial_weight(world_size))


@pytest.mark.soak  # repetition: the deadlock hung 2 launches in 12
def test_a_ddp_model_that_outlives_its_group_never_hangs_the_exit():
    # tutorial_style_worker destroys the group in cleanup() while its DDP model is alive; when the
    # model goes at the return, torch 2.13 can deadlock in ~ProcessGroupGloo: 2 launches in 12
    # hung here before the launcher kept destroyed groups alive, none in 36 since.
    for _ in range(12):
        out = spawn(tutorial_style_worker, args=(3,), nprocs=3, timeout=20, show_output=False)
        torch.testing.assert_close(out[0], expected_tutorial_weight(3))


def test_env_rendezvous_gets_every_variable_it_needs():
    out = run(env_rendezvous_worker, 3, init_group=False, show_output=False)
    ports = {result["environ"]["MASTER_PORT"] for result in out}
    assert len(ports) == 1 and 1024 <= int(ports.pop()) < 65536
    for rank, result in enumerate(out):
        assert result["total"] == 0 + 1 + 2
        assert {name: result["environ"][name] for name in
                ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
            "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1"}


def test_a_group_left_initialised_is_cleaned_up():
    for _ in range(3):  # a group left behind would break nothing visible but a later launch
        out = spawn(leave_group_initialised, args=(2,), nprocs=2, show_output=False)
        assert out.results == [2.0, 2.0]


def test_a_rank_that_raises_is_named():
    with pytest.raises(WorkerError) as caught:
        spawn(tutorial_style_worker, args=(2, "not a port"), nprocs=2, show_output=False)
    assert caught.value.rank in (0, 1)
    assert "not a port" in str(caught.value) or "MASTER_PORT" in str(caught.value)


def test_a_rendezvous_waiting_for_missing_ranks_ends_at_the_timeout_with_locations():
    with pytest.raises(WorkerTimeout) as caught:
        spawn(too_few_processes, args=(3,), nprocs=2, timeout=3, show_output=False)
    line = too_few_processes.__code__.co_firstlineno + 2
    for rank in range(2):
        where = caught.value.where[rank]
        assert where.startswith(
            "blocked in torch.distributed.init_process_group(), called from setup")
        assert 'workers.py", line' in where
    assert f'line {line}: setup(rank, world_size_claimed)' not in caught.value.where[0]  # innermost


def test_a_busy_hard_coded_port_fails_at_once_with_a_hint():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(WorkerError) as caught:
            spawn(tutorial_style_worker, args=(2, port), nprocs=2, timeout=60, show_output=False)
    assert caught.value.rank == 0
    assert "EADDRINUSE" in caught.value.message
    assert "Hint: another program already listens on MASTER_PORT" in str(caught.value)


def test_join_false_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="always waits for the processes"):
        spawn(tutorial_style_worker, args=(2,), nprocs=2, join=False)


# The first example of CS336 lecture 8 (setup, cleanup, collective_operations_main), as the
# course's source notes (shared/seeds) give it, long lines included. Around it, stand-ins written
# here for the lecture's own helpers: get_device (cuda:index when there is a GPU, else the CPU),
# text (the lecture renders notes; nothing here), and its spawn, which passes world_size first and
# calls mp.spawn: here helpers.spawn, the one edit a lecture needs.
LECTURE_SCRIPT = '''
import os

import torch
import torch.distributed as dist

import helpers


def get_device(index=0):
    return torch.device("cuda", index) if torch.cuda.is_available() else torch.device("cpu")


def text(note):
    pass


def spawn(function, world_size, **kwargs):
    helpers.spawn(function, args=(world_size, *kwargs.values()), nprocs=world_size, join=True)


def setup(rank: int, world_size: int):
    # Specify where master lives (rank 0), used to coordinate (actual data goes through NCCL)
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "15623"

    if torch.cuda.is_available():
        dist.init_process_group("nccl", rank=rank, world_size=world_size)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

def cleanup():
    torch.distributed.destroy_process_group()

def collective_operations_main(rank: int, world_size: int):
    """This function is running asynchronously for each process (rank = 0, ..., world_size - 1)."""
    setup(rank, world_size)

    # All-reduce
    dist.barrier()  # Waits for all processes to get to this point (in this case, for print statements)

    tensor = torch.tensor([0., 1, 2, 3], device=get_device(rank)) + rank  # Both input and output

    print(f"Rank {rank} [before all-reduce]: {tensor}", flush=True)
    dist.all_reduce(tensor=tensor, op=dist.ReduceOp.SUM, async_op=False)  # Modifies tensor in place
    print(f"Rank {rank} [after all-reduce]: {tensor}", flush=True)

    # Reduce-scatter
    dist.barrier()

    input = torch.arange(world_size, dtype=torch.float32, device=get_device(rank)) + rank  # Input
    output = torch.empty(1, device=get_device(rank))  # Allocate output

    print(f"Rank {rank} [before reduce-scatter]: input = {input}, output = {output}", flush=True)
    dist.reduce_scatter_tensor(output=output, input=input, op=dist.ReduceOp.SUM, async_op=False)
    print(f"Rank {rank} [after reduce-scatter]: input = {input}, output = {output}", flush=True)

    # All-gather
    dist.barrier()

    input = output  # Input is the output of reduce-scatter
    output = torch.empty(world_size, device=get_device(rank))  # Allocate output

    print(f"Rank {rank} [before all-gather]: input = {input}, output = {output}", flush=True)
    dist.all_gather_into_tensor(output_tensor=output, input_tensor=input, async_op=False)
    print(f"Rank {rank} [after all-gather]: input = {input}, output = {output}", flush=True)

    text("Indeed, all-reduce = reduce-scatter + all-gather!")

    cleanup()


if __name__ == "__main__":
    spawn(collective_operations_main, world_size=4)
'''


def test_the_lectures_collective_operations_run_from_a_script(tmp_path):
    script = tmp_path / "lecture.py"
    script.write_text(LECTURE_SCRIPT)
    completed = subprocess.run([sys.executable, str(script)], cwd=tmp_path,
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    world_size = 4
    summed = sum(torch.tensor([0.0, 1, 2, 3]) + r for r in range(world_size))
    inputs = [torch.arange(world_size, dtype=torch.float32) + r for r in range(world_size)]
    shards = sum(inputs)
    for rank in range(world_size):
        assert f"[rank {rank}] Rank {rank} [after all-reduce]: {summed}" in completed.stdout
        assert (f"[rank {rank}] Rank {rank} [after reduce-scatter]: input = {inputs[rank]}, "
                f"output = {shards[rank:rank + 1]}") in completed.stdout
        assert (f"[rank {rank}] Rank {rank} [after all-gather]: input = {shards[rank:rank + 1]}, "
                f"output = {shards}") in completed.stdout


@pytest.mark.soak  # a race between two scripts, in fresh interpreters
def test_two_scripts_on_the_lectures_fixed_port_take_turns(tmp_path):
    """The lecture's setup() binds port 15623: two spawns at once (two notebooks, two test
    workers) would collide; spawn() makes them take turns."""
    script = tmp_path / "lecture.py"
    script.write_text(LECTURE_SCRIPT)
    both = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    for process in both:
        _, stderr = process.communicate(timeout=240)
        assert process.returncode == 0, stderr


TWO_AT_ONCE_SCRIPT = textwrap.dedent(
    '''
    import sys
    from helpers import spawn
    from workers import env_rendezvous_worker

    def by_spawn_convention(rank, world_size):
        return env_rendezvous_worker(rank, world_size)

    if __name__ == "__main__":
        world_size = int(sys.argv[1])
        for _ in range(3):
            out = spawn(by_spawn_convention, args=(world_size,), nprocs=world_size,
                        show_output=False)
        print(sorted({result["total"] for result in out}))
    '''
)


@pytest.mark.soak  # a race between two scripts, in fresh interpreters
def test_two_launches_at_once_pick_different_ports(tmp_path):
    script = tmp_path / "two.py"
    script.write_text(TWO_AT_ONCE_SCRIPT)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", "")}
    processes = {n: subprocess.Popen([sys.executable, str(script), str(n)], cwd=tmp_path, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for n in (2, 3)}
    for world_size, process in processes.items():
        stdout, stderr = process.communicate(timeout=180)
        assert process.returncode == 0, stderr
        assert stdout.strip() == repr([float(sum(range(world_size)))])
