"""Read a model's weights one tensor at a time, in their stored dtype.

What scales with model size must stream: the sequential quantizer asks for one decoder
layer's tensors when its turn comes, so nothing here holds more than the tensor asked for.
A `TensorSource` is either a Hugging Face directory on disk (single or sharded
safetensors; each read copies one tensor out and keeps no file mapped) or a model already
in memory (its state dict, for tests and small models).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from quasar.errors import QuasarError


class TensorSource:
    """Tensors by Hugging Face name: `get(name)` returns a tensor the caller may modify."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())


class SafetensorsSource(TensorSource):
    """The safetensors files of a model directory, read tensor by tensor."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._file_of: dict[str, Path] = {}
        for f in _weight_files(self.model_dir):
            for name in safetensors_names(f):
                self._file_of[name] = f

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        f = self._file_of.get(name)
        if f is None:
            raise QuasarError(f"{self.model_dir}: the weights have no tensor {name!r}")
        try:
            with safe_open(str(f), framework="pt") as st:
                return st.get_tensor(name).clone()  # own memory: the file is unmapped on close
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise QuasarError(f"{f}: corrupt or truncated safetensors file ({e})") from None


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


def _weight_files(model_dir: Path) -> list[Path]:
    from quasar.models.hf import weight_files

    return weight_files(model_dir)


def safetensors_names(f: Path) -> list[str]:
    """Tensor names from a safetensors header (8-byte length, then JSON), after checking that
    the file holds every byte the header promises: reading past the end of a memory-mapped
    file would kill the process with SIGBUS instead of raising."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n <= min(size - 8, 100 * 1024 * 1024):
                raise ValueError(f"header length {n}")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
        if 8 + n + end > size:
            raise ValueError(f"{size} bytes, the header needs {8 + n + end}")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise QuasarError(f"{f}: corrupt or truncated safetensors file ({e})") from None
    return list(tensors)
