"""The course's Llama (helpers.llama) against the projection's accounting (lessons 10-11):
its parameter counts, and the bytes one block keeps for backward, measured."""

import functools

import torch

from helpers import llama
from helpers.composing import strategy


def test_parameters_equal_the_projections_count_at_the_published_shapes():
    for model in strategy.MODELS.values():
        with torch.device("meta"):  # shapes only: no memory
            built = llama.Llama(model)
        assert sum(param.numel() for param in built.parameters()) == model.parameters()


def test_a_bfloat16_block_keeps_what_the_projection_counts():
    """A small block in bfloat16 (as FSDP2's param_dtype runs it), the CPU's flash kernel. Every
    tensor it keeps is the projection's, except the norms: torch's RMSNorm on the CPU computes in
    float32 and keeps two float32 tensors of the input's size where the count has the 16-bit
    input, the least its backward needs."""
    model = strategy.Model(layers=1, dim=256, heads=8, kv_heads=2, ffn=896, vocab=64)
    batch, seq_len = 2, 128
    tokens = batch * seq_len
    measured = llama.kept_by_block(model, batch, seq_len)
    norm_inputs = 2 * tokens * model.dim * 2  # two norms, their 16-bit inputs
    assert measured["float32 copies"] == 2 * 2 * tokens * model.dim * 4
    assert measured["per token"] + norm_inputs == model.kept_per_token(element=2) * tokens


def test_apply_ac_checkpoints_each_layer_of_a_llama_not_the_whole_model():
    """layouts.apply_ac finds a Llama's blocks in `layers` (a TinyLM's are `blocks`): each is
    recomputed on its own in backward, as torchtitan checkpoints each transformer block. (Taken
    for one block, the whole model would be recomputed at once, every layer gathered by FSDP.)"""
    from torch.utils.checkpoint import checkpoint

    from helpers import layouts

    model = layouts.apply_ac(llama.Llama(llama.Shape(layers=2, dim=64, heads=4, kv_heads=2,
                                                     ffn=128, vocab=32)), "full")
    assert "forward" not in vars(model)  # the model's own forward is untouched
    for layer in model.layers:
        patched = vars(layer)["forward"]
        assert isinstance(patched, functools.partial) and patched.func is checkpoint
