"""Hugging Face ``LlamaForCausalLM`` interop: config and name mapping, the rotary layout, safetensors I/O.

Our :class:`~lightning_fedshard.models.Llama` follows Meta's reference layout: :func:`apply_rotary` rotates the
consecutive pairs ``(2i, 2i+1)`` of each head. Hugging Face's Llama rotates ``(i, i + head_dim/2)``
(``rotate_half``), so the rows of ``wq`` and ``wk`` are permuted inside each head on the way out
(:func:`to_hf_rotary`) and back on the way in (:func:`from_hf_rotary`); every other tensor keeps its values.

Reading and writing go tensor by tensor: :class:`HFWeights` opens a (sharded) safetensors directory lazily and
:class:`SafetensorsWriter` holds at most one output shard in memory. Only ``safetensors`` is needed (the ``[hf]``
extra); ``transformers`` never is.

Example::

    write_hf_config(LlamaConfig.from_name("llama3.1-tiny"), "out/")   # config.json in Llama 3.1's fields
    config = read_hf_config("out/")                                   # back to a LlamaConfig
    weights = HFWeights("Llama-3.1-8B/")                              # model.safetensors(.index.json)
    wq = weights.tensor_for("layers.0.attention.wq.weight", config)   # our name and layout
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fedshard._torch_compat import require_extra
from lightning_fedshard.models.config import LlamaConfig, RopeScaling

__all__ = [
    "CHECKPOINT_MODEL_KEY",
    "CONFIG_FILENAME",
    "HFWeights",
    "SafetensorsWriter",
    "expected_shapes",
    "from_hf_name",
    "from_hf_rotary",
    "hf_config_dict",
    "install_hf_init",
    "llama_config_from_hf",
    "parse_size",
    "read_hf_config",
    "reset_from_hf",
    "to_hf_name",
    "to_hf_rotary",
    "to_hf_tensor",
    "write_hf_config",
]

CONFIG_FILENAME = "config.json"
#: The training checkpoint's entry in which LlamaPretraining records the model's whole config and the tokenizer.
CHECKPOINT_MODEL_KEY = "fedshard_model"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Our parameter names (Meta's) and Hugging Face's, per transformer block and outside the blocks.
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_OUTPUT = ("output.weight", "lm_head.weight")
_BLOCK = re.compile(r"layers\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FROM_HF_BLOCK = {hf: ours for ours, hf in _BLOCK_NAMES.items()}
_FROM_HF_TOP = {hf: ours for ours, hf in (*_TOP_NAMES.items(), _OUTPUT)}


def _safetensors() -> ModuleType:
    return require_extra("safetensors.torch", "hf", "Hugging Face export and import (safetensors files)")


# ---- names and the rotary layout ---------------------------------------------------------------------


def to_hf_name(name: str) -> str:
    """Hugging Face's name of our parameter ``name`` (``layers.3.attention.wq.weight`` →
    ``model.layers.3.self_attn.q_proj.weight``)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    if name == _OUTPUT[0]:
        return _OUTPUT[1]
    if (m := _BLOCK.fullmatch(name)) and m[2] in _BLOCK_NAMES:
        return f"model.layers.{m[1]}.{_BLOCK_NAMES[m[2]]}"
    raise KeyError(f"{name!r} is not a parameter of lightning_fedshard's Llama.")


def from_hf_name(name: str) -> str:
    """Our name of Hugging Face's Llama parameter ``name``; the inverse of :func:`to_hf_name`."""
    if name in _FROM_HF_TOP:
        return _FROM_HF_TOP[name]
    if (m := _HF_BLOCK.fullmatch(name)) and m[2] in _FROM_HF_BLOCK:
        return f"layers.{m[1]}.{_FROM_HF_BLOCK[m[2]]}"
    raise KeyError(f"{name!r} is not a parameter of Hugging Face's LlamaForCausalLM.")


def _rotary_heads(name: str, config: LlamaConfig) -> int | None:
    """How many heads' rows ``name`` holds if it is a rotated projection (wq, wk), else None."""
    if name.endswith("attention.wq.weight"):
        return config.n_heads
    if name.endswith("attention.wk.weight"):
        return config.n_kv_heads
    return None


def to_hf_rotary(weight: Tensor, n_heads: int) -> Tensor:
    """Rows of a q/k projection from our interleaved pairs to Hugging Face's halves, head by head: the rows
    ``0, 2, 4, ..`` of a head come first, then ``1, 3, 5, ..``."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def from_hf_rotary(weight: Tensor, n_heads: int) -> Tensor:
    """The inverse of :func:`to_hf_rotary`: each head's two halves interleaved again."""
    rows, cols = weight.shape
    return weight.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf_tensor(name: str, tensor: Tensor, config: LlamaConfig) -> tuple[str, Tensor]:
    """Our parameter ``name`` with value ``tensor`` as Hugging Face stores it: its name and its layout."""
    heads = _rotary_heads(name, config)
    return to_hf_name(name), tensor if heads is None else to_hf_rotary(tensor, heads)


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of our Llama for ``config``, in the model's order, with its shape."""
    dim, kv_dim, ffn = config.dim, config.n_kv_heads * config.head_dim, config.ffn_dim
    block = {
        "attention.wq.weight": (dim, dim),
        "attention.wk.weight": (kv_dim, dim),
        "attention.wv.weight": (kv_dim, dim),
        "attention.wo.weight": (dim, dim),
        "feed_forward.w1.weight": (ffn, dim),
        "feed_forward.w3.weight": (ffn, dim),
        "feed_forward.w2.weight": (dim, ffn),
        "attention_norm.weight": (dim,),
        "ffn_norm.weight": (dim,),
    }
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (config.vocab_size, dim)}
    for i in range(config.n_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in block.items()})
    shapes["norm.weight"] = (dim,)
    shapes["output.weight"] = (config.vocab_size, dim)
    return shapes


# ---- config.json -------------------------------------------------------------------------------------


def hf_config_dict(
    config: LlamaConfig,
    dtype: torch.dtype = torch.float32,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict[str, Any]:
    """``config.json`` of a ``LlamaForCausalLM`` with ``config``'s shapes, in the fields of Llama 3.1 8B's."""
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "hidden_size": config.dim,
        "initializer_range": 0.02,
        "intermediate_size": config.ffn_dim,
        "max_position_embeddings": config.max_seq_len,
        "mlp_bias": False,
        "num_attention_heads": config.n_heads,
        "num_hidden_layers": config.n_layers,
        "num_key_value_heads": config.n_kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": config.norm_eps,
        "rope_scaling": None,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": False,  # our model always has its own output head
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
        "vocab_size": config.vocab_size,
    }
    if (s := config.rope_scaling) is not None:
        out["rope_scaling"] = {
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
            "rope_type": "llama3",
        }
    return out


def write_hf_config(config: LlamaConfig, directory: str | Path, **kwargs: Any) -> None:
    """Writes ``config.json`` (see :func:`hf_config_dict` for ``kwargs``) into ``directory``."""
    (Path(directory) / CONFIG_FILENAME).write_text(json.dumps(hf_config_dict(config, **kwargs), indent=2) + "\n")


def read_hf_config(directory: str | Path) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face Llama directory's ``config.json``; a clear error for a config
    our model cannot reproduce (another architecture, biases, another activation or rotary scaling)."""
    file = Path(directory) / CONFIG_FILENAME
    if not file.is_file():
        raise FileNotFoundError(
            f"{str(directory)!r} is not a Hugging Face model directory: it has no {CONFIG_FILENAME}."
        )
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(file)!r} is not valid JSON: {err}") from err
    return llama_config_from_hf(raw, name=Path(directory).name or "custom", where=str(file))


def llama_config_from_hf(raw: dict[str, Any], name: str = "custom", where: str = "config.json") -> LlamaConfig:
    """:func:`read_hf_config` on an already parsed ``config.json``."""
    if not isinstance(raw, dict) or raw.get("model_type") != "llama":
        found = raw.get("model_type") if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{where}: model_type is {found!r}, not 'llama'; only Llama checkpoints can be imported.")
    architectures = raw.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in architectures:
        raise ValueError(f"{where}: architectures {architectures} do not include LlamaForCausalLM.")
    for field, allowed in (
        ("attention_bias", False),
        ("mlp_bias", False),
        ("hidden_act", "silu"),
        ("pretraining_tp", 1),
    ):
        if raw.get(field, allowed) != allowed:
            raise ValueError(f"{where}: {field}={raw[field]!r}, but lightning_fedshard's Llama has {allowed!r}.")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [f for f in required if f not in raw]
    if missing:
        raise ValueError(f"{where}: missing the field(s) {missing}.")
    # transformers 5 saves `rope_parameters` (rope_theta inside); Llama 3.1's own files `rope_scaling`.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        scaling: RopeScaling | None = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type == "default":
        scaling = None
    else:
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported (only 'llama3' and 'default').")
    heads = raw["num_attention_heads"]
    config = LlamaConfig(
        name=name,
        vocab_size=raw["vocab_size"],
        dim=raw["hidden_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=raw.get("num_key_value_heads") or heads,
        ffn_dim=raw["intermediate_size"],
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_seq_len=raw.get("max_position_embeddings", 2048),
    )
    if raw.get("head_dim") not in (None, config.head_dim):
        raise ValueError(
            f"{where}: head_dim={raw['head_dim']} but hidden_size / num_attention_heads = {config.head_dim};"
            " lightning_fedshard's Llama derives the head size from them."
        )
    return config


# ---- safetensors -------------------------------------------------------------------------------------


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an integer, or a string such as ``"5GB"`` (10^9, as Hugging Face counts) or ``"2GiB"``."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, flags=re.IGNORECASE)
        if m is None:
            raise ValueError(f"Cannot read the size {size!r}; write e.g. 5GB, 500MB, 2GiB or a number of bytes.")
        unit = (m[2] or "B").upper()
        powers = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
        powers.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
        value = int(float(m[1]) * powers[unit])
    if value < 1:
        raise ValueError(f"A shard size must be positive, got {size!r}.")
    return value


class SafetensorsWriter:
    """Writes named tensors, given one at a time in a planned order, into ``model.safetensors`` or, when they
    exceed ``max_shard_size`` bytes, into ``model-0000k-of-0000n.safetensors`` shards plus Hugging Face's
    ``model.safetensors.index.json``. Only the shard being filled is held in memory.

    Example::

        writer = SafetensorsWriter(out, {"a": 400, "b": 400}, max_shard_size=500)  # two shards
        writer.add("a", torch.zeros(100)); writer.add("b", torch.ones(100)); writer.close()
    """

    def __init__(self, directory: str | Path, sizes: dict[str, int], max_shard_size: int | str = "5GB") -> None:
        self.directory = Path(directory)
        limit = parse_size(max_shard_size)
        # Hugging Face's rule: a tensor larger than the limit gets a shard of its own.
        shards: list[list[str]] = [[]]
        filled = 0
        for name, size in sizes.items():
            if shards[-1] and filled + size > limit:
                shards.append([])
                filled = 0
            shards[-1].append(name)
            filled += size
        count = len(shards)
        files = (
            [SINGLE_FILE] if count == 1 else [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
        )
        self._file_of = {name: file for file, names in zip(files, shards, strict=True) for name in names}
        self._remaining = {file: len(names) for file, names in zip(files, shards, strict=True)}
        self._total = sum(sizes.values())
        self._pending: dict[str, Tensor] = {}
        self._safetensors = _safetensors()

    def add(self, name: str, tensor: Tensor) -> None:
        """Adds a tensor; its shard is written as soon as its last tensor arrives."""
        file = self._file_of[name]
        self._pending[name] = tensor.detach().cpu().contiguous()
        self._remaining[file] -= 1
        if self._remaining[file] == 0:
            self._safetensors.save_file(self._pending, str(self.directory / file), metadata={"format": "pt"})
            self._pending = {}

    def close(self) -> None:
        """Checks that every planned tensor was written, and writes the index if there are several shards."""
        missing = sorted(name for name, file in self._file_of.items() if self._remaining[file] > 0)
        if missing:
            raise RuntimeError(f"SafetensorsWriter closed before these tensors were added: {missing[:5]}")
        if len(self._remaining) > 1:
            index = {"metadata": {"total_size": self._total}, "weight_map": self._file_of}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


class HFWeights:
    """The tensors of a Hugging Face Llama directory (``model.safetensors`` or shards with their index), read one at
    a time in our names and rotary layout (:meth:`tensor_for`), never all at once.

    Example::

        weights = HFWeights("Llama-3.1-8B/")
        config = read_hf_config("Llama-3.1-8B/")
        embedding = weights.tensor_for("tok_embeddings.weight", config)
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._safetensors = _safetensors()
        index, single = self.directory / INDEX_FILE, self.directory / SINGLE_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{str(index)!r} has no weight_map.")
            self.file_of: dict[str, str] = weight_map
        elif single.is_file():
            with self._safetensors.safe_open(str(single), framework="pt") as f:
                self.file_of = dict.fromkeys(f.keys(), SINGLE_FILE)
        else:
            raise FileNotFoundError(
                f"{str(self.directory)!r} holds no {SINGLE_FILE} nor {INDEX_FILE}: not a safetensors Llama directory."
            )
        for file in set(self.file_of.values()):
            if not (self.directory / file).is_file():
                raise FileNotFoundError(f"{str(self.directory / file)!r}, named in {INDEX_FILE}, is missing.")

    def hf_tensor(self, hf_name: str) -> Tensor:
        """One tensor, by its Hugging Face name, as stored."""
        with self._safetensors.safe_open(str(self.directory / self.file_of[hf_name]), framework="pt") as f:
            return f.get_tensor(hf_name)

    @property
    def tied(self) -> bool:
        """Whether the directory has no ``lm_head.weight`` (a tied head: the embedding is the output matrix)."""
        return _OUTPUT[1] not in self.file_of

    def check(self, config: LlamaConfig) -> None:
        """Raises unless the directory holds exactly the tensors of ``config``'s model, at their shapes (without
        ``lm_head.weight`` for a tied head)."""
        expected = {to_hf_name(name): shape for name, shape in expected_shapes(config).items()}
        if self.tied:
            expected.pop(_OUTPUT[1])
        # Older conversions saved the rotary table; it is derived from the config, so it is not read.
        found = {name for name in self.file_of if not name.endswith("rotary_emb.inv_freq")}
        missing, unexpected = sorted(expected.keys() - found), sorted(found - expected.keys())
        if missing or unexpected:
            raise ValueError(
                f"{str(self.directory)!r} does not hold a Llama of its config.json: missing {missing[:6]}"
                f"{' ...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}."
            )
        for name in sorted(set(self.file_of.values())):
            with self._safetensors.safe_open(str(self.directory / name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    if key in expected and tuple(f.get_slice(key).get_shape()) != expected[key]:
                        raise ValueError(
                            f"{str(self.directory / name)!r}: {key} has shape {tuple(f.get_slice(key).get_shape())},"
                            f" but config.json implies {expected[key]}."
                        )

    def tensor_for(self, name: str, config: LlamaConfig) -> Tensor:
        """Our parameter ``name`` (``layers.0.attention.wq.weight``), in our rotary layout."""
        hf_name = to_hf_name(name)
        if hf_name == _OUTPUT[1] and self.tied:
            hf_name = _TOP_NAMES["tok_embeddings.weight"]
        tensor = self.hf_tensor(hf_name)
        heads = _rotary_heads(name, config)
        return tensor if heads is None else from_hf_rotary(tensor, heads)


# ---- initialising our model from a Hugging Face directory ---------------------------------------------


def install_hf_init(model: nn.Module, directory: str | Path, config: LlamaConfig) -> None:
    """Makes every parameter-holding module of ``model`` (our Llama) initialise from ``directory`` instead of at
    random: its ``reset_parameters()`` copies its tensors from the safetensors files.

    The sharding strategies build the model on the meta device and materialise it module by module through
    ``reset_parameters()`` (:func:`lightning_fedshard.strategies.apply.materialize`), each on whole tensors of
    which every rank keeps its shard: so the weights load before the outer optimizer copies them, one module
    at a time, on every layout. On a model already on a real device, call :func:`reset_from_hf` after this.
    """
    weights = HFWeights(directory)
    weights.check(config)
    for prefix, module in model.named_modules():
        names = [name for name, _ in module.named_parameters(recurse=False)]
        if names:
            module.reset_parameters = _loader(module, prefix, names, weights, config)  # type: ignore[method-assign]


def _loader(
    module: nn.Module, prefix: str, names: list[str], weights: HFWeights, config: LlamaConfig
) -> Callable[[], None]:
    @torch.no_grad()
    def reset_parameters() -> None:
        for name in names:
            param = module.get_parameter(name)
            param.copy_(weights.tensor_for(f"{prefix}.{name}" if prefix else name, config))

    return reset_parameters


def reset_from_hf(model: nn.Module) -> None:
    """Runs the loaders :func:`install_hf_init` installed, on a model that is already materialised."""
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.reset_parameters()
