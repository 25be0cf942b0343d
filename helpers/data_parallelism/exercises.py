"""Lesson 06's exercises, checked by `helpers.exercises.check(name, your_function)`."""

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch.utils.data import DistributedSampler

from helpers import reference
from helpers import rules as rules_module
from helpers.data_parallelism.ddp import bucket_indices
from helpers.exercises import Exercise
from helpers.rules import CallRecorder, CallSizes, Only, Rule

_MODEL = reference.make_mlp(dim=8, num_layers=3, seed=4, bias=True)


def _bucket_numels(bucket_bytes):
    """The elements of each bucket the task's rule makes from SHAPES, in the order reduced."""
    numels = [torch.Size(shape).numel() for shape in reversed(SHAPES)]
    return [sum(numels[i] for i in bucket)
            for bucket in bucket_indices([numel * 4 for numel in numels], bucket_bytes)]


def _micro_batches(batch, m):
    return list(zip(batch.inputs.chunk(m), batch.targets.chunk(m)))


def _gradients_of_rank(rank, world_size, seed, shapes):
    generator = torch.Generator().manual_seed(seed + 100 * rank)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _sampler_indices(dataset_size, world_size, rank, epoch, drop_last):
    sampler = DistributedSampler(range(dataset_size), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=0, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


SHAPES = [(3, 4), (7,), (5, 5), (2,), (16,)]

EXERCISES = {
    "accumulated_gradients": Exercise(
        "you get `model` (the same replica on every rank) and `micro_batches`, your slice of the "
        "batch cut into m (inputs, targets) pairs; accumulate the gradient of the mean squared "
        "error over your whole slice (each micro-batch's loss divided by m), then average every "
        "gradient across the ranks with one all_reduce per parameter, in the order of "
        "model.parameters(), once (not once per micro-batch); return {name: gradient}",
        # the first case has m != n: a missing 1/m and a SUM for AVG then differ by other factors
        [(2, (12, 3)), (4, (8, 1)), (2, (16, 4))],
        lambda rank, n, batch_size, m: reference.gradients(
            _MODEL, reference.mlp_data(seed=5, batch_size=batch_size, dim=8)[0],
            reference.mse_loss),
        inputs=lambda rank, n, batch_size, m: (
            copy.deepcopy(_MODEL),
            _micro_batches(reference.mlp_data(seed=5, batch_size=batch_size, dim=8)[0]
                           .shard(rank, n), m)),
        rules=(Only("all_reduce", text="use only all_reduce"),
               CallSizes("all_reduce", lambda n, batch_size, m: [
                   param.numel() for param in _MODEL.parameters()],
                   text="one all_reduce per parameter, after the last micro-batch"))),
    "sampler_indices": Exercise(
        "given the dataset's size, the world size, your rank, the epoch and drop_last, return, as "
        "a list of Python ints, the indices DistributedSampler(shuffle=True, seed=0) gives your "
        "rank in that epoch: shuffle with torch.randperm and a generator seeded with seed + "
        "epoch; without drop_last, pad to a multiple of the world size by repeating the indices "
        "from the first one on, as many times over as needed; with drop_last, cut the tail to a "
        "multiple instead; then take every world_size-th index from your rank on",
        [(10, 4, 1, 0, False), (10, 4, 3, 2, False), (10, 4, 0, 1, True), (10, 4, 1, 0, True),
         (7, 3, 0, 5, False), (5, 8, 6, 0, False), (3, 8, 6, 0, False), (2, 8, 7, 1, False),
         (3, 8, 2, 0, True), (12, 4, 0, 3, True)],
        _sampler_indices,
        distributed=False),
    "bucketed_average": Exercise(
        "you get `grads`, a list of tensors of different shapes, and `bucket_bytes`; average them "
        "across the ranks with one all_reduce per bucket: walk the list from the last tensor, "
        "packing tensors into a flat buffer until it holds at least bucket_bytes (a tensor's bytes "
        "are numel() * element_size(), 4 for float32; the last bucket may hold less); return the "
        "averaged tensors in the original order and shapes",
        [(2, (0, 64)), (3, (1, 100)), (4, (2, 4 * 35)), (2, (3, 10_000)), (3, (4, 0))],
        lambda rank, n, seed, bucket_bytes: [
            sum(_gradients_of_rank(r, n, seed, SHAPES)[i] for r in range(n)) / n
            for i in range(len(SHAPES))],
        inputs=lambda rank, n, seed, bucket_bytes: (
            _gradients_of_rank(rank, n, seed, SHAPES), bucket_bytes),
        rules=(Only("all_reduce", text="use only all_reduce"),
               CallSizes("all_reduce", lambda n, seed, bucket_bytes: _bucket_numels(bucket_bytes),
                         text="one all_reduce per bucket, packed from the last tensor")), points=2),
}


BACKWARD, LAST = "backward", "backward, after the last gradient"


@dataclass
class BackwardExercise(Exercise):
    """The learner's function prepares a model; the checker runs the backward itself, calls what
    the function returned, and returns the model's gradients. Calls are logged with the span
    they start in: BACKWARD, or LAST once autograd has produced every gradient."""

    def worker(self, function, log_dir: str):
        task_rules, inputs = self.rules, self.inputs

        def call_then_backward(rank, world_size, *args):
            model, batch = inputs(rank, world_size, *args)
            with CallRecorder(task_rules, rules_module.log_path(log_dir, rank),
                              function) as recorder, contextlib.ExitStack() as last:
                params = [param for param in model.parameters() if param.requires_grad]
                ready = []

                def count(param):  # registered first, so it runs before the learner's hooks
                    ready.append(param)
                    if len(ready) == len(params):
                        last.enter_context(recorder.span(LAST))

                for param in params:
                    param.register_post_accumulate_grad_hook(count)
                finish = function(rank, world_size, model)
                with recorder.span(BACKWARD):
                    reference.mse_loss(model(batch.inputs), batch.targets).backward()
                    last.close()
                finish()
            return {name: param.grad for name, param in model.named_parameters()}

        return call_then_backward


class Overlapped(Rule):
    """Every all_reduce starts during backward, and some before its last gradient is ready."""

    def broken_by(self, logs, world_size, args=(), finished=True):
        for rank, calls in sorted(logs.items()):
            spans = [call.span for call in calls if call.name == "all_reduce"]
            late = [span for span in spans if span not in (BACKWARD, LAST)]
            if late:
                return (f"{self.text}: rank {rank} started {len(late)} of its all_reduce calls "
                        "after backward had returned.")
            if finished and spans and BACKWARD not in spans:
                return (f"{self.text}: rank {rank} started every all_reduce once every gradient "
                        "was ready, so none ran while backward was still computing.")
        return None


def _overlap_inputs(rank, world_size, seed):
    """The same replica on every rank, and this rank's slice of a batch of 12."""
    batch = reference.mlp_data(seed=seed, batch_size=12, dim=8)[0]
    return copy.deepcopy(_MODEL), batch.shard(rank, world_size)


def _overlap_expected(rank, world_size, seed):
    return reference.gradients(_MODEL, reference.mlp_data(seed=seed, batch_size=12, dim=8)[0],
                               reference.mse_loss)


EXERCISES["overlapped_average"] = BackwardExercise(
    "data parallelism's averaging, overlapped with backward: write `attach(rank, world_size, "
    "model)`, which prepares `model` (the same replica on every rank) and returns a function "
    "`finish()`. The checker then runs forward and backward on your rank's slice of the batch, "
    "calls finish(), and reads every parameter's .grad. What must hold: the gradients are the "
    "whole batch's (the mean loss over every rank's samples), and every all_reduce starts "
    "while backward runs, as soon as the gradient it carries is ready",
    [(2, (1,)), (3, (2,)), (4, (3,))],
    _overlap_expected,
    inputs=_overlap_inputs,
    rules=(Only("all_reduce", text="communicate with all_reduce only"),
           Overlapped(text="every all_reduce starts while backward runs, as soon as the "
                           "gradient it carries is ready")), points=3)

