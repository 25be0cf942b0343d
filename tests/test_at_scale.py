"""Lesson 13: a step on fake ranks is accounted for as on real ones, what PyTorch's tools report
equals its formula, a meta-built model equals one built normally, torchtitan's Llama layout
computes what one process does, and the committed sweep is what a fake run gives."""

import dataclasses

import pytest
import torch
from checker import expect_rejection

from helpers.at_scale import fits
from helpers.at_scale.accounting import Plan, account_worker
from helpers.at_scale.meta_init import init_weights, reset_parameters_worker
from helpers.at_scale.solutions import meta_built
from helpers.launcher import run
from helpers.llama import Llama, Shape

SHAPE = Shape(layers=2, dim=256, heads=8, kv_heads=2, ffn=768, vocab=1024)
WORLD = 4
SMALL = {"micro_batch": 2, "seq_len": 128}


def real_and_fake(plan):
    real = run(account_worker, plan.gpus, args=(SHAPE, plan), show_output=False, timeout=300)
    fake = run(account_worker, 1, args=(SHAPE, plan), kwargs={"fake": True}, init_group=False,
               show_output=False, timeout=300)[0]
    return real, fake


def parameters(shape=SHAPE):
    model = Llama(shape)
    total = sum(p.numel() for p in model.parameters())
    layer = sum(p.numel() for p in model.layers[0].parameters())
    return model, total, layer


# The notebook's trust cell holds these equalities in make test (nbval); the soak tier and other-cpu
# run them here again, every rank compared.
@pytest.mark.numerical  # bytes, not rounding; but the ranks' kernels change with the CPU's
@pytest.mark.soak
@pytest.mark.parametrize("plan", [Plan(dp=4, **SMALL), Plan(dp=4, recompute="full", **SMALL),
                                  Plan(dp=4, recompute="op", **SMALL),
                                  Plan(dp=2, replicate=2, **SMALL)], ids=str)
def test_fake_ranks_account_for_a_float32_step_exactly_as_real_ranks(plan):
    real, fake = real_and_fake(plan)
    assert all(rank == real[0] for rank in real)  # even shards: every rank alike
    assert fake == real[0]


@pytest.mark.numerical
@pytest.mark.soak  # 15 s; make test runs the same step at 2 blocks
def test_a_deep_model_clipped_by_its_norm_is_accounted_for_as_on_real_ranks():
    """32 blocks: where PyTorch's foreach norm, under FakeTensorMode, would hold a fake copy of
    every gradient (train_step's clip_to_norm computes it one tensor at a time)."""
    plan = Plan(dp=4, recompute="full", **SMALL)
    real = run(account_worker, 4, args=(dataclasses.replace(SHAPE, layers=32), plan),
               kwargs={"measure": ("memory",)}, show_output=False, timeout=300)
    fake = run(account_worker, 1, args=(dataclasses.replace(SHAPE, layers=32), plan),
               kwargs={"fake": True, "measure": ("memory",)}, init_group=False,
               show_output=False, timeout=300)[0]
    assert fake == real[0]


def test_the_bytes_fsdp_holds_and_sends_equal_their_formula():
    plan = Plan(dp=WORLD, **SMALL)
    fake = run(account_worker, 1, args=(SHAPE, plan), kwargs={"fake": True}, init_group=False,
               show_output=False, timeout=300)[0]
    model, total, layer = parameters()
    root = total - SHAPE.layers * layer  # embeddings, final norm, head: the root unit
    peak = fake["peak"]
    assert peak["Sharded Param"] == 4 * total // WORLD
    # AdamW: two float32 moments per element, and a float32 step count per parameter tensor
    assert peak["OptState"] == 2 * 4 * total // WORLD + 4 * len(list(model.parameters()))
    # at the peak (in backward): the root and one block gathered, the next block prefetched
    assert peak["Unsharded Param"] == 4 * (root + layer)
    assert peak["All Gather"] == 4 * layer
    # one all-gather per block in forward and again in backward, one for the root; one
    # reduce-scatter per block and one for the root; one all-reduce, of the gradients' norm
    assert fake["collectives"] == {"c10d._allgather_base_": 2 * SHAPE.layers + 1,
                                   "c10d._reduce_scatter_base_": SHAPE.layers + 1,
                                   "c10d_functional.all_reduce": 1}
    # a ring sends (N - 1)/N of each gathered or reduced float32 array (the norm's all-reduce,
    # one number, reaches neither the Observer nor the dispatcher: CommDebugMode alone sees it)
    gathered = 4 * (2 * SHAPE.layers * layer + root)
    assert fake["sent"] == {"all_gather_single": (WORLD - 1) / WORLD * gathered,
                            "reduce_scatter_single": (WORLD - 1) / WORLD * 4 * total}


@pytest.mark.soak  # as the notebook's trust cell, every rank
def test_in_bfloat16_a_real_rank_holds_at_most_one_blocks_float32_gradients_more():
    """FSDP2 reduce-scatters a float32 copy of each block's gradients; a real rank may still
    hold it while the next block's backward runs, the fake group frees it at once."""
    plan = Plan(dp=WORLD, bf16=True, **SMALL)
    real, fake = real_and_fake(plan)
    _, _, layer = parameters()
    for rank in real:
        assert rank["calls"] == fake["calls"] and rank["sent"] == fake["sent"]
        assert 0 <= rank["peak"]["Total"] - fake["peak"]["Total"] <= 4 * layer


@pytest.mark.numerical
@pytest.mark.soak  # as the notebook's trust cell, every rank
def test_with_tensor_parallelism_fake_ranks_account_for_a_step_exactly_as_real_ranks():
    """After one untracked step: DTensor's first in a process holds more under FakeTensorMode."""
    for plan in (Plan(dp=2, tp=2, **SMALL), Plan(dp=2, tp=2, recompute="op", **SMALL)):
        real, fake = real_and_fake(plan)
        assert all(rank == real[0] for rank in real)
        assert fake == real[0]


def llama_loss_worker(rank, world_size, shape, tokens, tp):
    """One float64 forward and backward of the Llama under Plan(dp, tp)'s layout: the loss and
    every parameter's gradient, gathered whole."""
    from torch.distributed.tensor import DTensor

    from helpers.at_scale.accounting import lay_out, make_mesh, train_step

    plan = Plan(dp=world_size // tp, tp=tp, seq_len=tokens.shape[1] - 1, micro_batch=1)
    torch.manual_seed(0)
    model = init_weights(Llama(shape)).double()
    lay_out(model, make_mesh(plan), plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the step leaves the weights
    dp_rank = rank // tp
    gradients = {}

    def keep(_):
        for name, p in model.named_parameters():
            g = p.grad
            gradients[name] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()

    optimizer.step = lambda: keep(None)
    train_step(model, optimizer, tokens[dp_rank:dp_rank + 1], plan)
    return gradients


@pytest.mark.numerical
def test_torchtitans_llama_layout_computes_the_gradient_of_one_process():
    shape = Shape(layers=2, dim=64, heads=4, kv_heads=2, ffn=192, vocab=256)
    tokens = torch.randint(0, shape.vocab, (2, 17), generator=torch.Generator().manual_seed(1))
    got = run(llama_loss_worker, 4, args=(shape, tokens, 2), show_output=False, timeout=120)[0]
    model = init_weights(Llama(shape)).double()
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(),
                                             tokens[:, 1:].flatten())  # as train_step does
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)  # as train_step does
    # Everything is float64 but the loss (torchtitan's float32 logits, here as in one process):
    # loss_parallel sums each token's softmax over two halves of the vocabulary, another order
    # of 256 float32 terms, each within 2**-24 relative: at most 256 x 6e-8 = 1.5e-5.
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1.5e-5, atol=1e-9)


def meta_built_weights(rank, world_size, shape):
    model = meta_built(rank, world_size, shape)
    assert model.output.weight.to_local().shape[0] == shape.vocab // world_size
    return {name: p.full_tensor().detach() for name, p in model.named_parameters()}


def test_a_meta_built_model_equals_one_built_normally():
    got = run(meta_built_weights, 4, args=(SHAPE,), show_output=False)
    normal = init_weights(Llama(SHAPE))
    for weights in got:
        torch.testing.assert_close(weights, dict(normal.named_parameters()), rtol=0, atol=0)


def test_reset_parameters_on_fsdps_pieces_gives_every_rank_the_same_piece():
    pieces = run(reset_parameters_worker, WORLD, args=(SHAPE,), show_output=False)
    assert all(torch.equal(piece, pieces[0][0]) for piece, _ in pieces)
    assert torch.equal(pieces[0][1], pieces[0][0].repeat(WORLD, 1))


def test_a_plan_the_model_cannot_hold_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="tp 3 does not divide the 8 heads"):
        fits.fits(SHAPE, Plan(dp=1, tp=3), memory=2**30)
    with pytest.raises(ValueError, match="recompute is one of"):
        fits.fits(SHAPE, Plan(dp=2, recompute="selective"), memory=2**30)


def test_the_sweep_is_every_candidate_of_the_question():
    assert [plan for plan, _, _ in fits.load_sweep()] == fits.candidates()


# Two layouts, full recomputation, with tensor parallelism of 2 and of 8 (make test's notebook runs
# tp 1's again): a fake step is the same bytes on any machine, so a sample stands for the file;
# `python -m helpers.at_scale.fits` writes it whole.
@pytest.mark.soak
@pytest.mark.parametrize("index", [5, 11])
def test_the_committed_sweep_is_what_a_fake_run_gives(index):
    from helpers.composing.strategy import MODELS

    plan, peak, sent = fits.load_sweep()[index]
    verdict = fits.fits(MODELS[fits.QUESTION["model"]], plan, memory=1)
    assert (verdict.peak, verdict.sent) == (peak, sent)



# --- the checkers -------------------------------------------------------------------------------

def built_whole_then_sharded(rank, world_size, shape):
    from torch.distributed.device_mesh import init_device_mesh

    from helpers import layouts

    model = init_weights(Llama(shape))  # every rank holds the whole model first
    return layouts.apply_fsdp(model, init_device_mesh("cpu", (world_size,)))  # CPU on purpose


def reset_on_pieces(rank, world_size, shape):
    from torch.distributed.device_mesh import init_device_mesh

    from helpers import layouts

    with torch.device("meta"):
        model = Llama(shape)
    layouts.apply_fsdp(model, init_device_mesh("cpu", (world_size,)))  # CPU on purpose
    model.to_empty(device="cpu")  # CPU on purpose
    torch.manual_seed(0)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model


def test_the_meta_checker_rejects_pieces_drawn_alike():
    expect_rejection("meta_built", reset_on_pieces,
                     "every rank's piece of output.weight is the same")


@pytest.mark.soak  # make test rejects pieces drawn alike
def test_the_meta_checker_rejects_a_model_built_whole():
    expect_rejection("meta_built", built_whole_then_sharded,
                     "where Llama(...) was made: expected 'the meta device', got 'cpu'")


def no_recomputation(shape, gpus, memory, sequences, seq_len):
    return Plan(dp=gpus, micro_batch=sequences // gpus, seq_len=seq_len, bf16=True)


def another_question(shape, gpus, memory, sequences, seq_len):
    return Plan(dp=gpus, seq_len=seq_len)  # float32, one sequence per rank


def fewest_gpus_per_model(shape, gpus, memory, sequences, seq_len):
    """Data parallelism alone, recomputing all it must: it fits, but tensor parallelism over 2
    sends less (the sweep: FSDP's gathers shrink with the model's half)."""
    return Plan(dp=gpus, recompute="full", micro_batch=sequences // gpus, seq_len=seq_len,
                bf16=True)


def test_the_layout_checker_rejects_a_plan_without_room_and_another_question():
    expect_rejection("choose_plan", no_recomputation,
                     "fits with 10% to spare: expected 'yes', got 'no: ")
    expect_rejection("choose_plan", another_question, "is not a layout of the question")


@pytest.mark.soak  # a fake step of Llama 3 8B; make test rejects the plan without room
def test_the_layout_checker_rejects_a_plan_that_sends_more_than_the_best():
    expect_rejection("choose_plan", fewest_gpus_per_model,
                     "sends no more than the best: expected 'yes', got 'no: it sends")


@pytest.mark.soak  # make test's fake = real comparisons (the notebook's) run the fast ones
@pytest.mark.parametrize("plan", [Plan(dp=4, **SMALL), Plan(dp=2, tp=2, recompute="op", **SMALL)],
                         ids=str)
def test_the_fast_trackers_find_the_peak_pytorchs_find(plan):
    fast, stock = (run(account_worker, 1, args=(SHAPE, plan), init_group=False,
                       kwargs={"fake": True, "measure": ("memory",), "fast": fast},
                       show_output=False, timeout=300)[0] for fast in (True, False))
    assert fast == stock


@pytest.mark.soak  # the FSDP ones; the tensor-parallel ones take minutes each (the script's)
@pytest.mark.parametrize("index", [1, 3])
def test_the_committed_runs_at_size_are_what_a_fake_run_gives(index):
    model, plan, found = fits.load_at_size()[index]
    assert (model, plan) == fits.AT_SIZE[index]
    assert fits.at_size(model, plan) == found


def init_then_shard(rank, world_size, shape):
    from torch.distributed.device_mesh import init_device_mesh

    from helpers import layouts

    with torch.device("meta"):
        model = Llama(shape)
    model.to_empty(device="cpu")  # CPU on purpose: the whole model, on every rank
    init_weights(model)
    return layouts.apply_fsdp(model, init_device_mesh("cpu", (world_size,)))  # CPU on purpose


@pytest.mark.soak  # make test rejects pieces drawn alike
def test_the_meta_checker_rejects_memory_for_the_whole_model():
    expect_rejection("meta_built", init_then_shard,
                     "what to_empty allocated: expected \"this rank's pieces\", got 'the whole "
                     "model'")
