"""Read a Megatron ``torch_dist`` checkpoint offline, one tensor region at a time.

A ``torch_dist`` checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory: every tensor is
stored under its global shape as the chunks the ranks wrote (one per TP/EP shard, and per layer
when layers are stacked), whatever the training layout. Reading a region (one layer of a stacked
tensor, say) asks DCP for the overlaps of that region with the saved chunks, so peak memory is one
saved chunk plus the region, not the model. No process group is needed.

Extends ``torch.distributed.checkpoint.FileSystemReader`` with a small ``LoadPlanner`` that reads
regions into caller-owned tensors (DCP's own planners read whole state-dict entries).

A base module (beside ``checkpoint_manifest.py``): the converter (``convert/to_hf.py``,
``convert/megatron_logits.py``) reads weights with it, the trainer's resume check the saved args
(``models/saved_settings.py``) and STEM's checkpoint its saved tables (``stem/runtime/checkpoint.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_ext.checkpoint_manifest import CheckpointError, resolve_checkpoint_dir


class _RegionPlanner(LoadPlanner):
    """Reads the requested regions of saved tensors into given tensors, and byte entries."""

    def __init__(self, regions: Sequence[Tuple[str, Sequence[int], torch.Tensor]],
                 byte_keys: Sequence[str] = ()):
        self.regions = list(regions)
        self.byte_keys = list(byte_keys)
        self.dest: Dict[str, Tuple[torch.Tensor, Tuple[int, ...]]] = {}
        self.loaded_bytes: Dict[str, object] = {}

    def set_up_planner(self, state_dict=None, metadata=None, is_coordinator=False):
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: List[ReadItem] = []
        for i, (key, offsets, tensor) in enumerate(self.regions):
            md = self.metadata.state_dict_metadata[key]
            self.dest[(key, i)] = tensor
            # One destination per request: DCP keys read items by fqn, so alias each region.
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape)
            for item in create_read_items_for_chunk_list(key, md, [chunk]):
                items.append(dataclasses.replace(item, dest_index=MetadataIndex(
                    fqn=f"{key}\x00{i}", offset=item.dest_index.offset,
                    index=item.dest_index.index)))
        for key in self.byte_keys:
            index = MetadataIndex(key)
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=
                                  torch.Size((0,)), storage_index=index,
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value):
        value.seek(0)
        self.loaded_bytes[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def resolve_tensor(self, read_item):
        key, i = read_item.dest_index.fqn.split("\x00")
        tensor = self.dest[(key, int(i))]
        view = tensor
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item, tensor):
        pass


class MegatronCheckpoint:
    """One iteration of a ``torch_dist`` checkpoint: its tensors, args and iteration."""

    # Entries that are training state, not model weights (never exported, never "extra").
    NON_MODEL = re.compile(
        r"^(optimizer\.|rng_state|rerun_state_machine_state|common_state)|_extra_state(/|$)")

    def __init__(self, path: str, step: Optional[int] = None):
        self.dir, self.iteration = resolve_checkpoint_dir(path, step)
        meta_json = os.path.join(self.dir, "metadata.json")
        if os.path.exists(meta_json):
            with open(meta_json) as f:
                backend = json.load(f).get("sharded_backend")
            if backend != "torch_dist":
                raise CheckpointError(
                    f"{self.dir}: sharded backend {backend!r}; conversion reads torch_dist "
                    "checkpoints (train with --ckpt-format torch_dist, or re-save with it)")
        self.reader = FileSystemReader(self.dir)
        try:
            self.metadata = self.reader.read_metadata()
        except Exception as e:  # a legacy (torch) checkpoint has no DCP metadata
            raise CheckpointError(f"{self.dir}: not a torch_dist checkpoint ({e})") from e
        common_keys = [k for k in self.metadata.state_dict_metadata
                       if k.startswith("common_state")]
        if not common_keys:
            raise CheckpointError(f"{self.dir}: no common_state (args) in the checkpoint")
        common = self._read_bytes(common_keys[:1])[common_keys[0]]
        self.common = common[0] if isinstance(common, list) else common
        self.args = self.common.get("args")
        if self.args is None:
            raise CheckpointError(f"{self.dir}: the checkpoint holds no training args")
        if self.iteration is None:
            self.iteration = self.common.get("iteration")

    # -- contents --------------------------------------------------------------------------

    def tensor_keys(self) -> List[str]:
        """Model tensors (no optimizer state, RNG or extra state)."""
        return [k for k, v in self.metadata.state_dict_metadata.items()
                if isinstance(v, TensorStorageMetadata) and not self.NON_MODEL.search(k)]

    def has(self, key: str) -> bool:
        return isinstance(self.metadata.state_dict_metadata.get(key), TensorStorageMetadata)

    def shape(self, key: str) -> Tuple[int, ...]:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(key)
        return tuple(md.size)

    def dtype(self, key: str) -> torch.dtype:
        return self.metadata.state_dict_metadata[key].properties.dtype

    # -- reading ---------------------------------------------------------------------------

    def _run(self, planner: _RegionPlanner) -> None:
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        planner.set_up_planner(None, self.metadata, True)
        plan = self.reader.prepare_local_plan(planner.create_local_plan())
        plan = self.reader.prepare_global_plan([plan])[0]
        self.reader.read_data(plan, planner).wait()

    def _read_bytes(self, keys: Iterable[str]) -> Dict[str, object]:
        planner = _RegionPlanner([], list(keys))
        self._run(planner)
        return planner.loaded_bytes

    def read(self, key: str, index: Optional[int] = None) -> torch.Tensor:
        """The whole tensor ``key``, or its ``index``-th slice along the first axis (one layer of
        a stacked tensor) without reading the rest."""
        shape = self.shape(key)
        if index is None:
            offsets, sizes = (0,) * len(shape), shape
        else:
            if not 0 <= index < shape[0]:
                raise IndexError(f"{key}: index {index} outside its first axis of {shape[0]}")
            offsets, sizes = (index,) + (0,) * (len(shape) - 1), (1,) + shape[1:]
        out = torch.empty(sizes, dtype=self.dtype(key))
        self._run(_RegionPlanner([(key, offsets, out)]))
        return out[0] if index is not None else out

    def layer_key(self, layer: int, name: str) -> Tuple[str, Optional[int]]:
        """Where layer ``layer``'s tensor ``name`` lives: per layer (``decoder.layers.<i>.<name>``,
        models whose layers differ) or stacked (``decoder.layers.<name>``, first axis = layer)."""
        own = f"decoder.layers.{layer}.{name}"
        if self.has(own):
            return own, None
        stacked = f"decoder.layers.{name}"
        if self.has(stacked):
            return stacked, layer
        raise KeyError(own)

    def read_layer(self, layer: int, name: str) -> torch.Tensor:
        key, index = self.layer_key(layer, name)
        return self.read(key, index)

