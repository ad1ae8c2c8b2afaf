"""Streamed export: a checkpoint larger than memory goes through the exporter one layer at a time.

The exportable graph is built and traced on the meta device (shapes only); each weight the target
writes is then computed on demand by StreamedWeights: layer i is rebuilt from its own tensors,
read from the safetensors shards (memory-mapped), folded exactly as an in-memory export folds it
(OscarCausalLM.decoder_layer), and dropped when the writer moves on to layer i + 1. Peak memory is
one layer in fp32 plus the largest single tensor (the embedding table), whatever the depth.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable

import torch

from ..config import OscarInputError

INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"


class Shards:
    """The tensors of a safetensors checkpoint (one file or an index of shards), read one at a time."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise OscarInputError(f"{index}: not a safetensors index ({err}): expected JSON with a "
                                      "'weight_map' of tensor name to shard file") from None
            self.files = {name: self.directory / shard for name, shard in weight_map.items()}
        elif (self.directory / SINGLE_FILE).is_file():
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(self.directory / SINGLE_FILE, framework="pt") as f:
                    self.files = {name: self.directory / SINGLE_FILE for name in f.keys()}
            except (OSError, SafetensorError) as err:
                raise OscarInputError(f"model {str(directory)!r}: {SINGLE_FILE} is not a safetensors file ({err}): "
                                      "expected the checkpoint's own weights") from None
        else:
            raise OscarInputError(f"model {str(directory)!r}: neither {INDEX_FILE} nor {SINGLE_FILE}: expected a "
                                  "safetensors checkpoint for a streamed export")
        missing = sorted({str(p.name) for p in self.files.values() if not p.is_file()})
        if missing:
            raise OscarInputError(f"model {str(directory)!r}: shard files {missing} listed but absent: expected a "
                                  "complete checkpoint directory")

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor in fp32."""
        from safetensors import safe_open

        if name not in self.files:
            raise OscarInputError(f"model {str(self.directory)!r}: tensor {name!r} is in no shard: expected a "
                                  "checkpoint with every weight its config.json implies")
        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name).float()


def is_streamable(name_or_path: str) -> bool:
    """A local safetensors checkpoint directory (the bundled model's too, once resolved by models.model_dir)."""
    path = Path(name_or_path).expanduser()
    return path.is_dir() and ((path / INDEX_FILE).is_file() or (path / SINGLE_FILE).is_file())


def meta_model(directory):
    """(model, tokenizer): the checkpoint's Hugging Face model on the meta device, no weight read, except
    the rotary embedding, which is made on the CPU (its frequencies are computed, not stored)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from ..models import check_vocabulary, load_tokenizer

    directory = Path(directory).expanduser()
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    text = model.get_decoder()
    text.rotary_emb = type(text.rotary_emb)(config=text.config)
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    tokenizer = load_tokenizer(directory, f"model {str(directory)!r}")
    check_vocabulary(str(directory), tokenizer, config.get_text_config().vocab_size)
    return model.eval(), tokenizer


class StreamedWeights:
    """name -> fp32 tensor for every meta parameter of `module` (an OscarCausalLM built from meta_model(...)),
    computed from the checkpoint. Keeps the last layer built, so the writer should ask layer by layer."""

    def __init__(self, module, model, directory):
        self.module, self.model, self.shards = module, model, Shards(directory)
        missing = [name for name, _ in model.named_parameters() if name not in self.shards]
        if missing:  # before any work: the writer would meet it layers later
            raise OscarInputError(f"model {str(directory)!r}: tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}"
                                  " are in no shard: expected a checkpoint with every weight its config.json implies")
        self.blocks = model.get_decoder().layers
        modules = {id(m): n for n, m in model.named_modules()}
        self.block_prefix = [modules[id(block)] + "." for block in self.blocks]
        # Parameters the graph shares with the Hugging Face model (all but the folded v_proj and o_proj), by every
        # name the model calls them: a tied lm_head is stored under the embedding's name only.
        hf_names: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            hf_names.setdefault(id(param), []).append(name)
        self.shared = {name: hf_names[id(param)] for name, param in module.named_parameters(remove_duplicate=False)
                       if id(param) in hf_names}
        self.graph_params = {id(p) for p in module.parameters()}
        # Buffers the graph computed itself (rotations, levels, RoPE frequencies) are real already; kept here so
        # the module can move to the meta device whole for tracing.
        self.buffers = {n: b for n, b in module.named_buffers() if b.device.type != "meta"}
        self.built: tuple[int, dict] | None = None

    def __call__(self, name: str) -> torch.Tensor:
        if name in self.buffers:
            return self.buffers[name]
        if name in self.shared:  # a tied lm_head: whichever of its names the checkpoint stores
            names = self.shared[name]
            return self.shards.tensor(next((n for n in names if n in self.shards), names[0]))
        if not name.startswith("layers."):
            raise OscarInputError(f"streamed export: {name!r} is neither a checkpoint tensor nor a layer's")
        index, rest = name[len("layers."):].split(".", 1)
        return self._layer(int(index))[rest]

    def materialize(self, prepare_rest: Callable, prepare_layer: Callable) -> None:
        """Give the module real weights in place, part by part: first its tensors outside the layers (embedding
        tables, final norm, lm_head; the largest, read while nothing else is held), then each decoder layer.
        prepare_rest(module) and prepare_layer(layer) run as soon as a part holds its weights, so a target that
        quantizes there holds one part in fp32 at a time. Each part is a copy, made on the meta device, of what
        the graph shared with the Hugging Face skeleton: no weight stays reachable from the skeleton."""
        for name, child in list(self.module.named_children()):
            if name != "layers" and _meta_names(child):
                setattr(self.module, name, copy.deepcopy(child))
        _assign(self.module, {n: self(n) for n in _meta_names(self.module) if not n.startswith("layers.")})
        prepare_rest(self.module)
        for i in range(len(self.module.layers)):
            layer = self.module.layers[i] = copy.deepcopy(self.module.layers[i])
            _assign(layer, {n: self(f"layers.{i}.{n}") for n in _meta_names(layer)})
            prepare_layer(layer)
        self.built = None

    def _layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's folded tensors (v_proj, o_proj): its block is rebuilt with only those read, the rest meta."""
        if self.built is None or self.built[0] != i:
            self.built = None  # drop the previous layer before reading the next
            meta, prefix = self.blocks[i], self.block_prefix[i]
            folded = [n for n, p in meta.named_parameters() if id(p) not in self.graph_params]
            state = {n: self.shards.tensor(prefix + n) for n in folded}
            with torch.device("meta"):
                block = type(meta)(self.model.config.get_text_config(), layer_idx=i)
            block.load_state_dict(state, assign=True, strict=False)
            with torch.no_grad():
                layer = self.module.decoder_layer(block, i)
            self.built = (i, {n: t.detach() for n, t in layer.state_dict().items() if t.device.type != "meta"})
        return self.built[1]


def _meta_names(module) -> list[str]:
    """Names of the module's parameters still on the meta device (a tied one under each of its names)."""
    return [n for n, p in module.named_parameters(remove_duplicate=False) if p.device.type == "meta"]


def _assign(module, tensors: dict[str, torch.Tensor]) -> None:
    module.load_state_dict(tensors, assign=True, strict=False)
