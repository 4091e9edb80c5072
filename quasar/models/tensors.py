"""Read a model's weights one tensor at a time, in their stored dtype.

What scales with model size must stream: the sequential quantizer asks for one decoder
layer's tensors when its turn comes, so nothing here holds more than the tensor asked for.
A `TensorSource` is either a Hugging Face directory on disk (single or sharded
safetensors, memory-mapped) or a model already in memory (its state dict, for tests and
small models).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from quasar.errors import QuasarError
from quasar.models.hf_files import check_manifest, weight_files
from quasar.models.safetensors_mmap import mmap_safetensors, tensor_entries


class TensorSource:
    """Tensors by Hugging Face name: `get(name)` returns a tensor the caller may modify."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())


class SafetensorsSource(TensorSource):
    """The safetensors files of a model directory, read tensor by tensor.

    ``get`` returns a view of a private (copy-on-write) map of the tensor's file: writing to
    it never changes the file, only the pages touched are read, and the map goes away with
    the last tensor that views it.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._file_of: dict[str, Path] = {}
        check_manifest(self.model_dir, weights=False)  # the index as written, before it is read
        for f in weight_files(self.model_dir):
            for name in tensor_entries(f)[0]:  # checks the header against the file's size
                self._file_of[name] = f
        check_manifest(self.model_dir)  # what is built from damaged weights would be cached as good

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        f = self._file_of.get(name)
        if f is None:
            raise QuasarError(f"{self.model_dir}: the weights have no tensor {name!r}")
        return mmap_safetensors(f)[name]


class StateDictSource(TensorSource):
    """A model in memory; `get` returns a copy, so the model itself is never modified."""

    def __init__(self, model: nn.Module):
        self._state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):
            self._state.pop("lm_head.weight", None)  # read the embeddings, as for a tied checkpoint

    def names(self) -> list[str]:
        return list(self._state)

    def __contains__(self, name: str) -> bool:
        return name in self._state

    def get(self, name: str) -> torch.Tensor:
        if name not in self._state:
            raise QuasarError(f"the model has no tensor {name!r}")
        return self._state[name].detach().clone()
