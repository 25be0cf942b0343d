"""Lesson 12, saving and resharding (helpers.checkpoints_and_failures.sharded): DCP's files tile
their map and a load reads exactly the pieces a rank holds; a full state dict is written and read
by rank 0 alone; a checkpoint saved by FSDP on 4 ranks loads into FSDP on 2, DP x TP on 2 x 2 and
one process, equal to what was saved and to one process. The other topics: the files
test_checkpoints_and_failures_<topic>.py.

No rounding can change these results (counts, messages, bit-for-bit comparisons of runs on the
same kernels, float64 against one process): the file is not marked numerical."""

import collections
import functools
import os

import pytest
import torch
from compare import assert_same_state

from helpers import reference, run
from helpers.checkpoints_and_failures import sharded

SHOWN = "model.blocks.0.feed_forward.down.weight"  # 32 x 128: FSDP cuts rows, TP columns


def model_and_batches():
    return reference.in_float64(reference.make_lm(seed=0),
                                reference.lm_data(seed=1, batch_size=8, steps=2))


@functools.cache
def saved(how, ranks, directory):
    return run(sharded.save_worker, ranks, args=(*model_and_batches(), directory, how),
               show_output=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The model trained 2 steps by FSDP on 4 ranks, saved with DCP."""
    directory = str(tmp_path_factory.mktemp("dcp4"))
    return directory, saved("dcp", 4, directory)


# --- saving -------------------------------------------------------------------------------------

def test_each_dcp_file_is_exactly_its_pieces_and_the_pieces_tile_every_tensor(checkpoint):
    directory, out = checkpoint
    rows = sharded.pieces(directory)
    for rank in range(4):
        name = f"__{rank}_0.distcp"
        mine = sorted((row["offset"], row["length"]) for row in rows if row["file"] == name)
        assert mine[0][0] == 0
        assert all(a[0] + a[1] == b[0] for a, b in zip(mine, mine[1:]))  # back to back
        assert mine[-1][0] + mine[-1][1] == os.path.getsize(os.path.join(directory, name))
        assert out[rank]["written"][name] == os.path.getsize(os.path.join(directory, name))
    assert set(out[0]["written"]) == {"__0_0.distcp", ".metadata"}
    model = model_and_batches()[0]
    for name, parameter in model.named_parameters():
        covered = torch.zeros(parameter.shape, dtype=torch.int)
        for row in rows:
            if row["name"] == f"model.{name}":
                assert row["shape"] == tuple(parameter.shape)
                covered[tuple(slice(s, s + n) for s, n in zip(row["start"], row["piece"]))] += 1
        assert (covered == 1).all(), name  # every element stored exactly once


def test_a_full_state_dict_is_written_and_read_by_rank_0_alone(tmp_path):
    out = saved("full", 4, str(tmp_path))
    size = os.path.getsize(tmp_path / sharded.FULL_FILE)
    assert [rank["written"] for rank in out] == [{sharded.FULL_FILE: size}, {}, {}, {}]
    loaded = run(sharded.load_worker, 2, args=(model_and_batches()[0], str(tmp_path), "full"),
                 show_output=False)
    assert [rank["bytes read"] for rank in loaded] == [size, 0]
    assert_same_state(loaded[1]["state"], out[0]["state"])


# --- resharding ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layout, ranks", [("fully_shard", 2), ("dp_tp", 4), ("one_process", 1)])
def test_a_4_rank_fsdp_checkpoint_loads_into_another_layout(checkpoint, layout, ranks):
    directory, out = checkpoint
    model, batches = model_and_batches()
    loaded = run(sharded.load_worker, ranks, show_output=False,
                 kwargs=dict(model=model, directory=directory, how="dcp", layout=layout))
    for rank in range(ranks):
        assert_same_state(loaded[rank]["state"], out[0]["state"])
    torch.testing.assert_close(loaded[0]["state"], sharded.one_process_state(model, batches))
    # the part of the shown weight each rank read is exactly the part it holds: FSDP on n ranks
    # holds 32/n rows; DP x TP (rank = 2 dp + tp) 16 rows and 64 columns (a row-parallel layer)
    for rank in range(ranks):
        held = torch.zeros(32, 128, dtype=torch.int)
        for piece in loaded[rank]["read"]:
            if piece.name == SHOWN:
                held[tuple(slice(s, s + n) for s, n in zip(piece.start, piece.sizes))] += 1
        expected = torch.zeros(32, 128, dtype=torch.int)
        if layout == "dp_tp":
            dp, tp = divmod(rank, 2)
            expected[16 * dp:16 * (dp + 1), 64 * tp:64 * (tp + 1)] = 1
        else:
            rows = 32 // ranks
            expected[rows * rank:rows * (rank + 1)] = 1
        assert torch.equal(held, expected), rank
        files = {piece.file for piece in loaded[rank]["read"] if piece.name == SHOWN}
        expected_files = ({f"__{2 * dp}_0.distcp", f"__{2 * dp + 1}_0.distcp"}
                          if layout == "dp_tp" else
                          {f"__{r}_0.distcp" for r in range(4 // ranks * rank,
                                                            4 // ranks * (rank + 1))})
        assert files == expected_files


# --- interoperability ---------------------------------------------------------------------------

def test_dcp_to_torch_save_makes_one_file_that_loads_into_a_plain_model(checkpoint, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory, out = checkpoint
    path = tmp_path / "consolidated.pt"
    dcp_to_torch_save(directory, path)
    state = torch.load(path, weights_only=True)
    plain = model_and_batches()[0]
    plain.load_state_dict(state["model"])  # strict: every name, every shape
    saved = out[0]["state"]
    assert_same_state({"model": dict(plain.state_dict()),
                       "optimizer": {name: state["optimizer"]["state"][name]
                                     for name in saved["optimizer"]}}, saved)


def test_a_hand_built_tensor_parallel_block_saved_with_dcp_loads_whole_in_one_process(tmp_path):
    """Lesson 08's parallelize_block on a 2 x 2 (dp, tp) mesh, its pieces given to DCP as
    DTensors; read back in one process into a whole Block's tensors: equal to the Block."""
    import torch.distributed.checkpoint as dcp

    block = reference.make_block(dim=32, heads=4, seed=3)
    run(sharded.tensor_parallel_save_worker, 4, args=(block, str(tmp_path), 2),
        show_output=False)
    whole = {name: torch.zeros_like(param) for name, param in block.named_parameters()}
    dcp.load(whole, checkpoint_id=str(tmp_path), no_dist=True)
    for name, param in block.named_parameters():
        torch.testing.assert_close(whole[name], param.detach(), rtol=0, atol=0, msg=name)
    # each cut tensor is stored as 2 pieces (one per tp rank, dp 0 writing it), a whole one once
    stored = collections.Counter(row["name"] for row in sharded.pieces(str(tmp_path)))
    assert stored["attention.q.weight"] == 2 and stored["attention.out.weight"] == 2
    assert stored["norm1.weight"] == 1 and stored["attention.out.bias"] == 1
