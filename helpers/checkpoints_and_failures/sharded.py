"""Saving distributed state, and loading it into another layout (lesson 12,
notebooks/12_checkpoints_and_failures.ipynb).

Two ways to save a sharded model and its optimizer:

    full state dict   every piece gathered to rank 0 (get_model_state_dict and
                      get_optimizer_state_dict with full_state_dict=True, cpu_offload=True), which
                      writes one file with torch.save, as lesson 06 saved DDP's model. Rank 0
                      needs the whole state in its memory, and writes every byte alone; loading,
                      it reads every byte alone and broadcasts each whole tensor, of which every
                      rank keeps its shard (broadcast_from_rank0=True).
    torch.distributed.checkpoint (DCP)
                      every rank writes its own pieces (its shards of each DTensor) to its own
                      file, __<rank>_0.distcp, in parallel; rank 0 also writes .metadata, the map
                      of where every piece of every tensor lives (file, offset, length). Loading,
                      each rank asks the map for the pieces that overlap its own shards, in
                      whatever layout it has now, and reads only those.

get_state_dict / set_state_dict give the model's and the optimizer's state in one form for every
layout: keys are the model's parameter names (the optimizer's state too, not parameter numbers)
and values are DTensors, so a checkpoint saved by FSDP on 4 ranks loads into FSDP on 2, into DP x
TP on a 2 x 2 mesh (helpers.layouts.lay_out), or into one process.

    LAYOUTS                          "fully_shard", "dp_tp", "one_process" (helpers.strategies)
    train(model, optimizer, batches, mesh)
    save_worker / load_worker        one save or load, its seconds and the bytes each rank wrote
                                     or read
    hand_built_worker                lesson 07's ZeRO saved on some ranks, loaded on others
    tensor_parallel_state(block, mesh)
                                     lesson 08's hand-built tensor-parallel block, each piece a
                                     DTensor: what DCP needs to reshard it
    tensor_parallel_save_worker      that block on a ("dp", "tp") mesh, saved with DCP
    ReadRecorder                     a FileSystemReader that notes every piece it reads
    pieces(directory)                the metadata's map, one row per stored piece
    full_state(model, optimizer)     the whole state, gathered to every rank, keyed by name
"""

from __future__ import annotations

import copy
import os
from typing import NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from helpers import reference, strategies
from helpers.launcher.result import get_device
from helpers.timing import slowest_rank_seconds

LAYOUTS = ("fully_shard", "dp_tp", "one_process")  # strategies the lesson loads into
FULL_FILE = "full.pt"  # the full state dict's one file
METADATA_FILE = ".metadata"  # DCP's map


def train(model, optimizer, batches, mesh=None) -> list:
    """A step per batch on this rank's slice of it (its slice along the mesh's "dp" dimension,
    strategies.batch_shard); the losses of this rank."""
    dp_rank, dp_size = strategies.batch_shard(mesh)
    losses = []
    for batch in batches:
        local = batch.shard(dp_rank, dp_size).to(get_device())
        optimizer.zero_grad()
        loss = reference.lm_loss(model(local.inputs), local.targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def full_state(model, optimizer) -> dict:
    """{"model": {name: tensor}, "optimizer": {name: {"step", "exp_avg", "exp_avg_sq"}}}: the
    whole state on every rank, every tensor whole (gathered) and on the CPU, keyed by parameter
    name in any layout. Every rank must call it."""
    options = StateDictOptions(full_state_dict=True)
    return {"model": {name: value.clone().cpu() for name, value in
                      get_model_state_dict(model, options=options).items()},
            "optimizer": {name: {key: value.clone().cpu() for key, value in state.items()} for
                          name, state in get_optimizer_state_dict(
                              model, optimizer, options=options)["state"].items()}}


# --- saving and loading -------------------------------------------------------------------------

def save_worker(rank, world_size, model, batches, directory, how):
    """Train `model` under FSDP (fully_shard on `world_size` ranks) for a step per batch, then
    save its model and optimizer state to `directory`, `how` = "full" or "dcp". Returns the
    seconds the save took (the slowest rank's, from a barrier), the bytes this rank wrote, and
    the whole state before saving (on rank 0), to compare loads with."""
    model, optimizer = strategies.build("fully_shard", copy.deepcopy(model))
    train(model, optimizer, batches)
    before = full_state(model, optimizer)

    def save():
        if how == "full":
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = {"model": get_model_state_dict(model, options=options),
                     "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
            if rank == 0:  # cpu_offload=True leaves the gathered state on rank 0 only
                torch.save(state, os.path.join(directory, FULL_FILE))
        elif how == "dcp":
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state},
                     checkpoint_id=directory)
        else:
            raise ValueError(f"how must be 'full' or 'dcp', not {how!r}")

    seconds = slowest_rank_seconds(save)
    written = {"full": [FULL_FILE] if rank == 0 else [],
               "dcp": [f"__{rank}_0.distcp"] + ([METADATA_FILE] if rank == 0 else [])}[how]
    return {"seconds": seconds,
            "written": {name: os.path.getsize(os.path.join(directory, name)) for name in written},
            "state": before if rank == 0 else None}


def load_worker(rank, world_size, model, directory, how, layout="fully_shard"):
    """Load `directory` (saved by save_worker) into a fresh copy of `model` laid out as `layout`
    on `world_size` ranks. Returns the seconds the load took (slowest rank), the bytes this rank
    read, the pieces it read (DCP: rows of `pieces`), and the whole state after loading."""
    model, optimizer = strategies.build(layout, copy.deepcopy(model))
    read = []

    def load():
        if how == "full":
            state = None
            if rank == 0:
                state = torch.load(os.path.join(directory, FULL_FILE), weights_only=True)
                read.append(Piece(FULL_FILE, "everything", 0,
                                  os.path.getsize(os.path.join(directory, FULL_FILE)), None, None))
            # each whole tensor broadcast from rank 0 to every rank, which keeps its shard
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(model, state["model"] if rank == 0 else {}, options=options)
            set_optimizer_state_dict(model, optimizer, state["optimizer"] if rank == 0 else {},
                                     options=options)
        elif how == "dcp":
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            reader = ReadRecorder(directory)
            dcp.load(state, storage_reader=reader)  # fills `state`'s tensors in place
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
            read.extend(reader.read)
        else:
            raise ValueError(f"how must be 'full' or 'dcp', not {how!r}")

    seconds = slowest_rank_seconds(load)
    # FileSystemReader reads a stored piece's bytes for every request that needs part of it
    return {"seconds": seconds, "read": read, "bytes read": sum(piece.length for piece in read),
            "state": full_state(model, optimizer)}


# --- the course's own strategies ----------------------------------------------------------------

def hand_built_worker(rank, world_size, strategy, model, batches, directory, save, **options):
    """A hand-built strategy (helpers.strategies: "ddp", "zero_1", "zero_2", "zero_3", with
    `options`) on a copy of `model`. save=True: train a step per batch, then write its state to
    `directory` with DCP. save=False: load that state, into any number of ranks, then train a
    step per batch. Returns the whole parameters after the load (or before the save) and at the
    end."""
    model, optimizer = strategies.build(strategy, copy.deepcopy(model), **options)
    if save:
        train(model, optimizer, batches)
        dcp.save(strategies.state_dict(model, optimizer), checkpoint_id=directory)
        return {"start": None, "end": strategies.full_parameters(model)}
    strategies.load(model, optimizer, directory)  # DCP reads this rank's overlap, in place
    start = strategies.full_parameters(model)
    train(model, optimizer, batches)
    return {"start": start, "end": strategies.full_parameters(model)}


def tensor_parallel_state(block, mesh) -> dict:
    """The parameters of lesson 08's hand-built tensor-parallel Block (parallelize_block over
    mesh["tp"]) for DCP, by the whole Block's names: a column-parallel layer's rows and bias
    (q, k, v, up) become DTensors Shard(0) over "tp", a row-parallel layer's columns (out, down)
    Shard(1), each replicated over "dp"; what every rank holds whole stays a plain tensor. Each
    DTensor's local tensor is the rank's own piece (from_local: no copy)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from helpers.tensor_parallelism.megatron import plan_style

    state = {}
    for name, param in block.named_parameters():
        layer, _, kind = name.rpartition(".")
        style = plan_style(layer)
        dim = {"column": 0, "row": 1 if kind == "weight" else None}.get(style)
        if dim is None:  # not cut: the norms, and a row-parallel layer's bias (added whole)
            state[name] = param.detach()
            continue
        state[name] = DTensor.from_local(param.detach(), mesh, [Replicate(), Shard(dim)],
                                         run_check=False)
    return state


def tensor_parallel_save_worker(rank, world_size, block, directory, tp):
    """A copy of `block` cut by lesson 08's parallelize_block over the "tp" dimension of a
    ("dp", "tp") mesh, its parameters saved with DCP (tensor_parallel_state) to `directory`."""
    from helpers.layouts import Plan, make_mesh
    from helpers.tensor_parallelism.megatron import parallelize_block

    mesh = make_mesh(Plan(dp=world_size // tp, tp=tp))  # ("dp", "tp")
    cut = parallelize_block(block, mesh.get_group("tp"))
    dcp.save(tensor_parallel_state(cut, mesh), checkpoint_id=directory)


# --- what DCP wrote, and what each rank read ----------------------------------------------------

class Piece(NamedTuple):
    """One stored piece of a checkpoint, as a rank read it."""

    file: str
    name: str  # the state's key: "model.head.weight", "optimizer.state.head.weight.exp_avg"
    offset: int  # where its bytes start in the file
    length: int  # how many bytes
    start: tuple | None  # where the part this rank took from it starts in the whole tensor
    sizes: tuple | None  # that part's shape (None: a non-tensor value, read whole)


class ReadRecorder(dcp.FileSystemReader):
    """A FileSystemReader that notes every piece it reads: `.read`, a list of Piece. DCP reads a
    stored piece whole and then narrows it to the part this rank needs."""

    def __init__(self, path):
        super().__init__(path)
        self.read = []

    def read_data(self, plan, planner):
        for item in plan.items:
            stored = self.storage_data[item.storage_index]
            start = sizes = None
            if item.storage_index.offset is not None:  # a tensor: the part taken, globally
                start = tuple(int(a) + int(b) for a, b in zip(item.storage_index.offset,
                                                              item.storage_offsets))
                sizes = tuple(int(length) for length in item.lengths)
            self.read.append(Piece(stored.relative_path, item.storage_index.fqn, stored.offset,
                                   stored.length, start, sizes))
        return super().read_data(plan, planner)


def pieces(directory) -> list:
    """The map in DCP's .metadata: for every stored piece, the tensor it belongs to and its
    shape, where the piece starts in that tensor and its shape, and the file, offset and length
    of its bytes. Non-tensor values (the optimizer's lr, betas ...) are stored as pickled bytes:
    shape and start are None. Read in the kernel, no process group needed."""
    metadata = dcp.FileSystemReader(directory).read_metadata()
    rows = []
    for index, stored in metadata.storage_data.items():
        entry = metadata.state_dict_metadata[index.fqn]
        chunk = next((chunk for chunk in getattr(entry, "chunks", ())
                      if tuple(chunk.offsets) == tuple(index.offset or ())), None)
        rows.append({"name": index.fqn, "file": stored.relative_path, "offset": stored.offset,
                     "length": stored.length,
                     "shape": tuple(entry.size) if hasattr(entry, "size") else None,
                     "start": tuple(chunk.offsets) if chunk else None,
                     "piece": tuple(chunk.sizes) if chunk else None})
    return sorted(rows, key=lambda row: (row["file"], row["offset"]))


def one_process_state(model, batches) -> dict:
    """The reference (reference.train: `model` trained in this process, a step per whole batch,
    with the same AdamW); its state in full_state's form."""
    alone = reference.train(model, batches, reference.lm_loss)
    return {"model": alone.parameters, "optimizer": alone.optimizer}
