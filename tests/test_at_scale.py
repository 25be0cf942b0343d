"""Lesson 13 (work in progress): a step on fake ranks is accounted for exactly as on real ones,
and what PyTorch's tools report equals its formula."""

import pytest

from helpers.at_scale.accounting import fsdp_accounting_worker
from helpers.launcher import run
from helpers.llama import Llama, Shape

SHAPE = Shape(layers=2, dim=256, heads=8, kv_heads=2, ffn=768, vocab=1024)
WORLD, BATCH, SEQ = 4, 2, 128


@pytest.fixture(scope="module")
def real_and_fake():
    real = run(fsdp_accounting_worker, WORLD, args=(SHAPE, BATCH, SEQ), show_output=False,
               timeout=300)
    fake = run(fsdp_accounting_worker, 1, args=(SHAPE, BATCH, SEQ),
               kwargs={"fake_world_size": WORLD}, init_group=False, show_output=False,
               timeout=300)
    return real, fake[0]


def test_fake_ranks_account_for_a_step_as_real_ranks_do(real_and_fake):
    real, fake = real_and_fake
    assert all(real[rank] == real[0] for rank in range(WORLD))  # even shards: every rank alike
    assert fake == real[0]


def test_the_bytes_fsdp_holds_equal_their_formula(real_and_fake):
    _, fake = real_and_fake
    model = Llama(SHAPE, max_seq_len=SEQ)
    total = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.layers[0].parameters())
    root = total - SHAPE.layers * layer  # embeddings, final norm, head: the root unit
    peak = fake["peak"]
    assert peak["Sharded Param"] == 4 * total // WORLD
    # AdamW: two float32 moments per element, and a float32 step count per parameter tensor
    assert peak["OptState"] == 2 * 4 * total // WORLD + 4 * len(list(model.parameters()))
    # at the peak (in backward): the root and one block gathered, the next block prefetched
    assert peak["Unsharded Param"] == 4 * (root + layer)
    assert peak["All Gather"] == 4 * layer


def test_the_collectives_of_a_step_equal_their_count(real_and_fake):
    _, fake = real_and_fake
    layers = SHAPE.layers
    # all-gathers: the root and every block in forward, every block again in backward (each is
    # resharded after its forward, the root is not); one reduce-scatter per unit
    assert fake["collectives"] == {"c10d._allgather_base_": 2 * layers + 1,
                                   "c10d._reduce_scatter_base_": layers + 1}


def test_the_bytes_sent_equal_the_ring_formula(real_and_fake):
    """The course's Observer counts what each call sends on a ring: (N - 1) / N of the array."""
    real, fake = real_and_fake
    assert fake["calls"] == real[0]["calls"] == {"all_gather_single": 2 * SHAPE.layers + 1,
                                                 "reduce_scatter_single": SHAPE.layers + 1}
    model = Llama(SHAPE, max_seq_len=SEQ)
    total = 4 * sum(p.numel() for p in model.parameters())
    layer = 4 * sum(p.numel() for p in model.layers[0].parameters())
    gathered = total + SHAPE.layers * layer  # everything in forward, the blocks again in backward
    assert fake["sent"] == real[0]["sent"] == {
        "all_gather_single": (WORLD - 1) / WORLD * gathered,
        "reduce_scatter_single": (WORLD - 1) / WORLD * total}


def test_data_times_tensor_parallel_on_fake_ranks_as_on_real_ones():
    """dp 2 x tp 2: the peak, PyTorch's count of every collective (FSDP's and the functional
    all-reduces of tensor parallelism) and the bytes sent, on 4 fake ranks as on 4 real ones."""
    from helpers.at_scale.accounting import dp_tp_accounting_worker

    real = run(dp_tp_accounting_worker, WORLD, args=(SHAPE, BATCH, SEQ, 2, 2),
               show_output=False, timeout=300)
    fake = run(dp_tp_accounting_worker, 1, args=(SHAPE, BATCH, SEQ, 2, 2),
               kwargs={"fake": True}, init_group=False, show_output=False, timeout=300)[0]
    assert all(real[rank] == real[0] for rank in range(WORLD))
    assert fake == real[0]
    # per block: forward all-reduces the outputs of wo and w2; backward, the input gradient of
    # each column-wise projection on its own (wq, wk, wv; w1, w3): 7, where Megatron's f sums
    # the three (two) first and all-reduces once
    assert fake["collectives"]["c10d_functional.all_reduce"] == 7 * SHAPE.layers


@pytest.mark.parametrize("options", [{"recompute": "full"}, {"recompute": "op"},
                                     {"recompute": "full", "bf16": True}],
                         ids=["full", "op", "full-bf16"])
def test_recomputation_on_fake_ranks_as_on_real_ones(options):
    real = run(fsdp_accounting_worker, WORLD, args=(SHAPE, BATCH, SEQ), kwargs=options,
               show_output=False, timeout=300)
    fake = run(fsdp_accounting_worker, 1, args=(SHAPE, BATCH, SEQ),
               kwargs={"fake_world_size": WORLD, **options}, init_group=False,
               show_output=False, timeout=300)[0]
    assert fake == real[0]
