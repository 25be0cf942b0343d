"""helpers.reference: the models, data and single-process training every parallel lesson is checked
against, each compared with a computation written out here."""

import math

import pytest
import torch
import torch.nn.functional as F
from compare import labelled

from helpers import reference

# Results that are numbers: `make test` runs these again on other CPU kernels (Makefile).
pytestmark = pytest.mark.numerical


def test_seeded_randn_depends_on_the_seed_only():
    torch.manual_seed(1)
    first = reference.seeded_randn(7, 3, 4)
    torch.manual_seed(2)
    torch.randn(10)
    torch.testing.assert_close(reference.seeded_randn(7, 3, 4), first, rtol=0, atol=0)
    assert first.shape == (3, 4)
    assert not torch.equal(reference.seeded_randn(8, 3, 4), first)


def test_models_are_seeded_and_their_layers_differ():
    model, again = reference.make_mlp(16, 4, seed=3), reference.make_mlp(16, 4, seed=3)
    for (name, param), (_, param_again) in zip(model.named_parameters(), again.named_parameters()):
        torch.testing.assert_close(param, param_again, rtol=0, atol=0, msg=labelled(name))
    weights = [layer.weight for layer in model.layers]
    assert all(not torch.equal(weights[0], other) for other in weights[1:])
    state = torch.random.get_rng_state()
    reference.make_lm(seed=5)
    torch.testing.assert_close(torch.random.get_rng_state(), state)  # the caller's RNG is untouched


def test_mlp_is_the_lectures_stack_of_matmul_and_gelu():
    model = reference.make_mlp(8, 3, seed=0)
    x = reference.seeded_randn(1, 5, 8)
    expected = x
    for layer in model.layers:
        expected = F.gelu(expected @ layer.weight.T)
    torch.testing.assert_close(model(x), expected)


def attention_by_hand(attention, x):
    """Causal multi-head attention written out: scores, mask, softmax, weighted sum, projection."""
    batch, seq, dim = x.shape
    heads = dim // attention.head_dim

    def heads_of(t):
        return t.reshape(batch, seq, heads, attention.head_dim).permute(0, 2, 1, 3)

    q, k, v = heads_of(attention.q(x)), heads_of(attention.k(x)), heads_of(attention.v(x))
    scores = q @ k.transpose(-1, -2) / math.sqrt(attention.head_dim)
    scores = scores.masked_fill(torch.ones(seq, seq).triu(1).bool(), float("-inf"))
    mixed = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(batch, seq, dim)
    return attention.out(mixed)


def test_attention_equals_causal_attention_written_out():
    model = reference.make_lm(vocab=32, dim=16, heads=4, layers=1, max_seq_len=6, seed=1)
    attention = model.blocks[0].attention
    x = reference.seeded_randn(2, 3, 6, 16)
    torch.testing.assert_close(attention(x), attention_by_hand(attention, x))


def test_lm_data_counts_up_and_targets_are_the_next_tokens():
    (batch,) = reference.lm_data(seed=4, batch_size=6, seq_len=10, vocab=64)
    assert batch.inputs.shape == batch.targets.shape == (6, 10)
    torch.testing.assert_close(batch.targets[:, :-1], batch.inputs[:, 1:])
    strides = (batch.inputs[:, 1] - batch.inputs[:, 0]) % 64
    assert set(strides.tolist()) <= {1, 2, 3}
    torch.testing.assert_close((batch.inputs[:, 1:] - batch.inputs[:, :-1]) % 64,
                               strides[:, None].expand(6, 9))


def test_shards_of_a_batch_put_back_together_are_the_batch():
    (batch,) = reference.mlp_data(seed=0, batch_size=12, dim=4)
    shards = [batch.shard(rank, 4) for rank in range(4)]
    torch.testing.assert_close(torch.cat([s.inputs for s in shards]), batch.inputs)
    torch.testing.assert_close(torch.cat([s.targets for s in shards]), batch.targets)
    with pytest.raises(ValueError, match="a batch of 12 does not split evenly over 5 ranks"):
        batch.shard(0, 5)


def test_one_sgd_step_moves_every_parameter_by_minus_lr_times_its_gradient():
    model = reference.make_mlp(8, 2, seed=2)
    batches = reference.mlp_data(seed=1, batch_size=4, dim=8)
    gradients = reference.gradients(model, batches[0], reference.mse_loss)
    trained = reference.train(model, batches, reference.mse_loss, optimizer="sgd", lr=0.5)
    for name, param in model.named_parameters():  # momentum's first step is the gradient itself
        torch.testing.assert_close(trained.parameters[name], param - 0.5 * gradients[name])


def test_gradients_equal_autograd_on_the_loss_written_out():
    model = reference.make_lm(vocab=16, dim=8, heads=2, layers=1, max_seq_len=5, seed=0)
    (batch,) = reference.lm_data(seed=2, batch_size=3, seq_len=5, vocab=16)
    logits = model(batch.inputs)
    log_probs = logits.log_softmax(-1).gather(-1, batch.targets[..., None])
    loss = -log_probs.mean()
    expected = torch.autograd.grad(loss, list(model.parameters()))
    got = reference.gradients(model, batch, reference.lm_loss)
    for (name, _), want in zip(model.named_parameters(), expected):
        torch.testing.assert_close(got[name], want, msg=labelled(name))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_training_lowers_the_loss_and_leaves_the_model_alone(optimizer):
    model = reference.make_lm(seed=0)
    before = reference.parameters(model)
    run = reference.train(model, reference.lm_data(seed=0, steps=15), reference.lm_loss,
                          optimizer=optimizer, lr=1e-2 if optimizer == "adamw" else 0.3)
    assert len(run.losses) == 15
    assert run.losses[-1] < 0.8 * run.losses[0]
    for name, param in reference.parameters(model).items():
        torch.testing.assert_close(param, before[name], rtol=0, atol=0)


def test_tied_weights_are_one_parameter():
    model = reference.make_lm(seed=0, tie_weights=True)
    assert model.head.weight is model.token_embedding.weight
    names = list(reference.parameters(model))
    assert "token_embedding.weight" in names and "head.weight" not in names


def test_unknown_optimizer_names_the_known_ones():
    with pytest.raises(ValueError, match=r"choose one of \['adamw', 'sgd'\]"):
        reference.make_optimizer("adam", [], 0.1)


def test_training_slices_in_float32_is_training_the_whole_batch():
    model, batches = reference.make_lm(seed=0), reference.lm_data(seed=1, batch_size=8, steps=3)
    whole = reference.train(model, batches, reference.lm_loss)
    slices = reference.train(model, batches, reference.lm_loss, slices=4)
    torch.testing.assert_close(slices.losses, whole.losses)
    for name, param in whole.parameters.items():
        torch.testing.assert_close(slices.parameters[name], param)


def test_a_model_with_a_compute_dtype_keeps_float32_parameters_and_its_ties():
    model = reference.make_lm(seed=0, tie_weights=True)
    cast = reference.with_compute_dtype(model, torch.bfloat16)
    assert cast.head.weight is cast.token_embedding.weight
    assert all(param.dtype == torch.float32 for param in cast.parameters())
    tokens = reference.lm_data(seed=1, batch_size=2)[0].inputs
    x = torch.randn(3, 32)
    linear = cast.blocks[0].attention.q
    out = linear(x)
    assert torch.equal(out, out.bfloat16().float())  # computed in bfloat16
    exact = x.double() @ linear.weight.double().T + linear.bias.double()
    torch.testing.assert_close(out.double(), exact, atol=0.02, rtol=0.02)  # to bfloat16's precision
    logits = cast(tokens)
    assert logits.dtype == torch.float32
    assert not torch.equal(logits, model(tokens))  # rounded through bfloat16 on the way
