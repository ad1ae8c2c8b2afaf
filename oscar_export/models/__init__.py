"""Models: the bundled one, local Hugging Face checkpoints, GGUF files and built-in presets (shapes only).

A GGUF file's shape is read from its metadata without loading its tensors; loading it goes through
transformers' own GGUF support, which dequantizes the weights to float.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import OscarInputError

BUNDLED_MODEL_DIR = Path(__file__).parent.parent / "assets" / "bundled_model"
# The text the bundled model was not trained on: what report, eval and calibration read when given none.
BUNDLED_TEXT = BUNDLED_MODEL_DIR / "heldout.txt"

# Architecture fields of public checkpoints (from their published config.json files).
PRESETS: dict[str, dict] = {
    "llama-2-7b": dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
        max_position_embeddings=4096, tie_word_embeddings=False,
    ),
    "llama-3-8b": dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
        max_position_embeddings=8192, tie_word_embeddings=False,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
        max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=True,
    ),
    "mistral-7b": dict(
        model_type="mistral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, vocab_size=32000,
        max_position_embeddings=32768, tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class Family:
    """A decoder family the exportable graph covers (export/graph.py's decoder layer does what differs)."""

    architecture: str  # the transformers class of its checkpoints (random_checkpoint writes it)
    qkv_bias: bool = False  # q/k/v projections carry biases where the config does not say
    gguf: bool = False  # its GGUF files load: general.architecture names the family (Mistral's say llama)


# The one table of model families: the graph, the GGUF reader, the planner and the random checkpoints read it.
# Adding a family is a row here and, where its layers differ, their code in export/graph.py.
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", gguf=True),
    "qwen2": Family("Qwen2ForCausalLM", qkv_bias=True, gguf=True),
    "qwen3": Family("Qwen3ForCausalLM", gguf=True),
    "mistral": Family("MistralForCausalLM"),
}
GGUF_ARCHITECTURES = tuple(name for name, family in FAMILIES.items() if family.gguf)
WEIGHT_SUFFIXES = (".safetensors", ".bin")


@dataclass(frozen=True)
class ModelShape:
    """What the planner and the cache need to know about a decoder-only transformer."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int | None

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's linear maps: q, k, v, o and the three MLP matrices."""
        return self.hidden * self.head_dim * 2 * (self.q_heads + self.kv_heads) + 3 * self.hidden * self.intermediate

    @classmethod
    def from_hf_config(cls, name: str, cfg: dict) -> "ModelShape":
        cfg = cfg.get("text_config", cfg)  # multimodal wrappers nest the language model
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [key for key in required if not isinstance(cfg.get(key), int)]
        if missing:
            raise OscarInputError(
                f"model config of {name!r} lacks attention/shape fields {missing}: "
                "expected a decoder-only Hugging Face config.json (llama, qwen2, qwen3, mistral)"
            )
        counts = {key: cfg[key] for key in (*required, "num_key_value_heads", "head_dim") if cfg.get(key) is not None}
        bad = {key: value for key, value in counts.items() if type(value) is not int or value < 1}
        if bad:
            raise OscarInputError(f"model config of {name!r}: {bad}: expected positive whole numbers")
        q_heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or q_heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // q_heads
        if q_heads % kv_heads:
            raise OscarInputError(
                f"model config of {name!r}: num_attention_heads={q_heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}"
            )
        return cls(
            name=name,
            layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            q_heads=q_heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") in FAMILIES
                                  and FAMILIES[cfg["model_type"]].qkv_bias)),
            max_position_embeddings=cfg.get("max_position_embeddings"),
        )


def is_gguf(name_or_path: str) -> bool:
    return str(name_or_path).lower().endswith(".gguf")


def _gguf_reader(name_or_path: str):
    from gguf import GGUFReader

    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise OscarInputError(f"model {name_or_path!r}: no such GGUF file: expected a local .gguf file")
    try:
        return GGUFReader(path, "r")
    except Exception as err:  # noqa: BLE001 - a damaged file fails in many ways inside the reader
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise OscarInputError(f"model {name_or_path!r}: not a readable GGUF file ({reason}): expected a complete "
                              ".gguf file (truncated download?)") from None


def gguf_config(name_or_path: str) -> dict:
    """The Hugging Face config fields of a GGUF file, from its metadata (no tensor is read)."""
    reader = _gguf_reader(name_or_path)

    def value(key, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = value("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise OscarInputError(f"model {name_or_path!r}: GGUF architecture {arch!r} is not supported: expected one "
                              f"of {', '.join(GGUF_ARCHITECTURES)}")
    tensors = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    heads = value(f"{arch}.attention.head_count")
    cfg = {"model_type": arch, "hidden_size": value(f"{arch}.embedding_length"),
           "num_hidden_layers": value(f"{arch}.block_count"), "num_attention_heads": heads,
           "num_key_value_heads": value(f"{arch}.attention.head_count_kv", heads),
           "intermediate_size": value(f"{arch}.feed_forward_length"),
           "vocab_size": value(f"{arch}.vocab_size", None if tokens is None else len(tokens.data)),
           "max_position_embeddings": value(f"{arch}.context_length"),
           "tie_word_embeddings": "output.weight" not in tensors,
           "attention_bias": "blk.0.attn_q.bias" in tensors}
    if value(f"{arch}.attention.key_length") is not None:
        cfg["head_dim"] = value(f"{arch}.attention.key_length")
    return cfg


def model_dir(name_or_path: str) -> Path:
    """'bundled' or a local checkpoint directory holding config.json."""
    if name_or_path == "bundled":
        path = BUNDLED_MODEL_DIR
    else:
        path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        presets = ", ".join(PRESETS)
        hint = f" ({name_or_path!r} is a preset without weights)" if name_or_path in PRESETS else ""
        raise OscarInputError(
            f"model {name_or_path!r}: no config.json there{hint}; expected 'bundled', a local "
            f"Hugging Face checkpoint directory or a .gguf file (planner presets: {presets})"
        )
    return path


def model_shape(name_or_path: str) -> ModelShape:
    """Shape from a preset name, 'bundled', a local checkpoint directory or a GGUF file."""
    if name_or_path in PRESETS:
        return ModelShape.from_hf_config(name_or_path, PRESETS[name_or_path])
    if is_gguf(name_or_path):
        return ModelShape.from_hf_config(name_or_path, gguf_config(name_or_path))
    path = model_dir(name_or_path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise OscarInputError(f"model {name_or_path!r}: config.json is not readable JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise OscarInputError(f"model {name_or_path!r}: config.json is not a JSON object")
    return ModelShape.from_hf_config(name_or_path, cfg)


def load_model(name_or_path: str = "bundled", offload_folder=None, max_memory: str | None = None):
    """(model, tokenizer) from 'bundled', a local checkpoint or a GGUF file, offline, fp32, eval mode.

    With offload_folder (and optionally max_memory, e.g. "4GB"), weights that do not fit stay on
    disk and are streamed in by accelerate layer by layer, so models larger than memory still run.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if is_gguf(name_or_path):
        gguf_config(name_or_path)  # an unsupported or damaged file is one line, before transformers reads it
        path = Path(name_or_path).expanduser().resolve()
        path, kwargs = path.parent, {"gguf_file": path.name}
    else:
        path = model_dir(name_or_path)
        if not any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir()):
            raise OscarInputError(f"model {name_or_path!r}: config.json but no weights (*.safetensors, *.bin) "
                                  "there: expected a complete checkpoint directory")
    shape = model_shape(name_or_path)
    if offload_folder is None:
        _check_fits_in_memory(name_or_path, shape)
    tokenizer = load_tokenizer(path, f"model {name_or_path!r}", **kwargs)
    check_vocabulary(name_or_path, tokenizer, shape.vocab)
    if offload_folder is not None:
        kwargs.update(device_map="auto", offload_folder=str(offload_folder))
        if max_memory:
            kwargs["max_memory"] = {"cpu": max_memory}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype="float32", **kwargs)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:  # a damaged or mismatched weight file
        raise OscarInputError(f"model {name_or_path!r}: its weights cannot be loaded ({_first_line(err)}): expected "
                              "the checkpoint's own weight files, matching its config.json") from None
    return model.eval(), tokenizer


def _first_line(err: Exception) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:300]


def load_tokenizer(path, what: str, **kwargs):
    """The tokenizer in `path` (a checkpoint's or an artifact's), offline; a missing or damaged one is an error
    naming `what` ("model 'X'", "--artifact 'Y'")."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
    except (OSError, ValueError, TypeError, KeyError) as err:  # ValueError includes a UnicodeDecodeError
        raise OscarInputError(f"{what}: no usable tokenizer ({_first_line(err)}): expected the tokenizer.json and "
                              "tokenizer_config.json of the model (or a GGUF's vocabulary)") from None


def check_vocabulary(name_or_path: str, tokenizer, vocab: int) -> None:
    """The tokenizer's own vocabulary has rows in the model's embedding. Tokens added on top of it may lie past
    the embedding (a GGUF's converted tokenizer adds a pad token): a prompt is checked for them when it runs."""
    if tokenizer.vocab_size > vocab:
        raise OscarInputError(f"model {name_or_path!r}: its tokenizer has {tokenizer.vocab_size} tokens and its "
                              f"config's vocab_size is {vocab}: expected the tokenizer that belongs to the weights")


def fp32_bytes(shape: ModelShape) -> int:
    """Bytes of the model's weights in fp32, as load_model holds them."""
    tables = shape.vocab * shape.hidden * (1 if shape.tied_embeddings else 2)
    return 4 * (shape.layers * shape.layer_params + tables)


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where there is none (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_fits_in_memory(name_or_path: str, shape: ModelShape) -> None:
    """A model whose fp32 weights exceed the memory available fails here with what to do, not in the kernel's
    out-of-memory killer minutes later."""
    need, have = fp32_bytes(shape), available_memory()
    if have is not None and need > have:
        raise OscarInputError(
            f"model {name_or_path!r}: its weights take {need / 2**30:.1f} GiB in fp32 and {have / 2**30:.1f} GiB "
            "are available: expected a model that fits. --target laptop (and android) streams a safetensors "
            "checkpoint layer by layer when the export calibrates nothing: --rotations hadamard, or a rotation file "
            "calibrated on a larger machine")
