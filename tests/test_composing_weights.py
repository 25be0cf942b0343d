"""Lesson 10, weights from trainer to inference ranks (helpers.composing.weights): every variant
delivers the trainers' weights exactly, inference equals one process after every step, the bytes
of each call against the formula, the timing sweep."""

import matplotlib

matplotlib.use("Agg")

import copy
import functools
import math

import pytest
import torch
import torch.distributed as dist
from compare import labelled

from helpers import reference, run
from helpers.composing import plots, weights

# Results that are numbers: `make test` runs these again on other CPU kernels (Makefile).
pytestmark = pytest.mark.numerical

WEIGHTS_STEPS, NEW_TOKENS = 3, 6


def weights_lm_case():
    """In float64, like lm_case: the trainers' weights after AdamW steps equal one process's within
    assert_close's float64 default, and near-tied logits cannot pick other tokens."""
    model, batches = reference.in_float64(
        reference.make_lm(vocab=64, dim=32, heads=4, layers=2, max_seq_len=16),
        reference.lm_data(seed=5, batch_size=8, seq_len=16, vocab=64, steps=WEIGHTS_STEPS))
    return model, batches, batches[0].inputs[:2, :4]  # prompt: 2 sequences of 4 tokens


def one_process_generations(model, batches, prompt):
    """After each step k of single-process training: the greedy tokens and logits."""
    generated = []
    for steps in range(1, len(batches) + 1):
        trained = reference.train(model, batches[:steps], reference.lm_loss, "adamw", 1e-2)
        copy_of_model = copy.deepcopy(model)
        copy_of_model.load_state_dict(trained.parameters)
        generated.append(weights.greedy_generate(copy_of_model, prompt, NEW_TOKENS))
    return generated, trained.parameters


@pytest.mark.once  # float64, or exact: no rounding changes it (Makefile)
@pytest.mark.parametrize("variant", weights.VARIANTS)
def test_weights_inference_ranks_generate_like_one_process_after_every_step(variant):
    model, batches, prompt = weights_lm_case()
    expected, final_parameters = one_process_generations(model, batches, prompt)
    out = run(weights.weight_update_worker, 4, show_output=False, kwargs=dict(
        num_trainers=2, model=model, batches=batches, prompt=prompt,
        new_tokens=NEW_TOKENS, variant=variant, bucket_bytes=2**14))
    assert [result["trainer"] for result in out] == [True, True, False, False]
    for rank in (2, 3):
        for step, (tokens, logits) in enumerate(expected):
            got = out[rank]["steps"][step]
            assert torch.equal(got["tokens"], tokens), (rank, step)
            torch.testing.assert_close(got["logits"], logits,
                                       msg=labelled(f"rank {rank}, step {step}"))
            # the same weights as trainer 0, bit for bit, so the same logits bit for bit
            assert torch.equal(got["logits"], out[0]["steps"][step]["logits"])
        for name, param in final_parameters.items():
            torch.testing.assert_close(out[rank]["parameters"][name], param, msg=labelled(name))


@functools.cache
def delivered(num_trainers, num_inference, bucket_bytes=3000):
    """A model whose 15224 parameters do not divide by 3 (padding when T * I = 3)."""
    model = reference.make_lm(vocab=61, dim=22, heads=2, layers=2)
    out = run(weights.delivered_weights_worker, num_trainers + num_inference,
              args=(num_trainers, model, bucket_bytes), show_output=False)
    return model, out.results


TRAINERS_AND_INFERENCE = [(2, 2), (1, 3), (3, 1)]


@pytest.mark.once  # float64, or exact: no rounding changes it (Makefile)
@pytest.mark.parametrize("num_trainers, num_inference", TRAINERS_AND_INFERENCE)
def test_weights_every_variant_delivers_the_trainers_weights_exactly(num_trainers,
                                                                      num_inference):
    model, results = delivered(num_trainers, num_inference)
    expected = reference.parameters(model)
    for variant in weights.VARIANTS:
        for rank, result in enumerate(results):  # inference ranks start from NaN
            got = result[variant]["parameters"]
            assert set(got) == set(expected)
            for name, param in expected.items():
                assert torch.equal(got[name], param), (variant, rank, name)


@pytest.mark.parametrize("num_trainers, num_inference", TRAINERS_AND_INFERENCE)
def test_weights_bytes_each_call_moves_match_the_formula(num_trainers, num_inference):
    model, results = delivered(num_trainers, num_inference)
    sizes = [param.numel() * 4 for param in model.parameters()]
    total = sum(sizes)  # 4 bytes per float32 parameter
    inference = range(num_trainers, num_trainers + num_inference)
    for rank, result in enumerate(results):
        calls = {variant: result[variant]["calls"] for variant in weights.VARIANTS}
        in_broadcast = rank == 0 or rank in inference
        # per-tensor: one broadcast per parameter, of its bytes (each rank of a broadcast's
        # chain sends and receives the whole tensor)
        assert calls["per_tensor"] == ([("broadcast", size, size) for size in sizes]
                                                 if in_broadcast else [])
        # bucketed: the same bytes in runs of consecutive parameters, each run but the last
        # reaching 3000 bytes, none reaching it before its last parameter
        bucketed = [size for _, size, _ in calls["bucketed"]]
        if in_broadcast:
            assert sum(bucketed) == total and len(bucketed) < len(sizes)
            ends = [sum(bucketed[:index + 1]) for index in range(len(bucketed))]
            boundaries = [sum(sizes[:index + 1]) for index in range(len(sizes))]
            assert set(ends) <= set(boundaries)
            for start, end in zip([0, *ends], ends):
                inside = [b - start for b in boundaries if start < b <= end]
                assert all(held < 3000 for held in inside[:-1])
                assert inside[-1] >= 3000 or end == total
        else:
            assert bucketed == []
        # scatter + all_gather: pieces of ceil(P / (T I)) elements; a trainer sends one to each
        # inference rank, which receives one from each trainer, then all_gathers rows of T
        # pieces (the ring: I - 1 of the I rows out, I - 1 in)
        piece = 4 * math.ceil(total / 4 / (num_trainers * num_inference))
        if rank < num_trainers:
            assert calls["scatter_all_gather"] == [
                ("batch_isend_irecv", piece * num_inference, 0)]
        else:
            row = piece * num_trainers
            assert calls["scatter_all_gather"] == [
                ("batch_isend_irecv", 0, row),
                ("all_gather", (num_inference - 1) * row, (num_inference - 1) * row)]
    sent_by_trainers = sum(sent for result in results[:num_trainers]
                           for _, sent, _ in result["scatter_all_gather"]["calls"])
    assert total <= sent_by_trainers < total + 4 * num_trainers * num_inference


def group_members_worker(rank, world_size, num_trainers):
    groups = weights.make_weight_groups(num_trainers, world_size)
    return {name: (dist.get_process_group_ranks(getattr(groups, name))
                   if rank in members else None)
            for name, members in [("trainers", groups.trainer_ranks),
                                  ("inference", groups.inference_ranks),
                                  ("source_and_inference", [0, *groups.inference_ranks])]}


def test_weights_groups_split_trainers_from_inference_ranks():
    out = run(group_members_worker, 5, args=(2,), show_output=False)
    for rank, groups in enumerate(out):
        assert groups["trainers"] == ([0, 1] if rank < 2 else None)
        assert groups["inference"] == ([2, 3, 4] if rank >= 2 else None)
        assert groups["source_and_inference"] == ([0, 2, 3, 4] if rank != 1 else None)
    for wrong in (0, 5):
        with pytest.raises(ValueError, match="trainers out of 5 ranks"):
            weights.make_weight_groups(wrong, 5)


def test_weights_greedy_generation_is_the_argmax_of_one_forward_of_its_output():
    model, _, prompt = weights_lm_case()
    tokens, logits = weights.greedy_generate(model, prompt, NEW_TOKENS)
    assert tokens.shape == (2, NEW_TOKENS) and logits.shape == (2, NEW_TOKENS, 64)
    with torch.no_grad():  # a causal model: position j's logits see only tokens 0..j
        whole = model(torch.cat([prompt, tokens], dim=1))
    length = prompt.shape[1]
    torch.testing.assert_close(logits, whole[:, length - 1:-1])
    assert torch.equal(tokens, whole[:, length - 1:-1].argmax(dim=-1))


def test_weights_sweep_times_every_variant_and_plots_it():
    out = run(weights.transfer_times_worker, 4, kwargs=dict(
        num_trainers=2, widths=(16, 32), layers=2, bucket_bytes=2**12, repeats=1))
    for width, record in zip((16, 32), out[0]):
        model = reference.make_lm(dim=width, layers=2)
        assert record["width"] == width
        assert record["parameters"] == sum(param.numel() for param in model.parameters())
        assert record["tensors"] == len(list(model.parameters()))
        assert set(record["seconds"]) == set(weights.VARIANTS)
        assert all(seconds > 0 for seconds in record["seconds"].values())
        assert sum(sent for _, sent, _ in record["calls"]["bucketed"]) == \
            4 * record["parameters"]
        assert len(record["calls"]["per_tensor"]) == record["tensors"]
    assert [record["seconds"] for record in out[0]] == [record["seconds"] for record in out[3]]
    fig = plots.plot_transfer_times(out[0])
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == list(weights.VARIANTS.values())
    assert ax.get_xscale() == ax.get_yscale() == "log"
