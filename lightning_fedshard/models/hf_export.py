"""``fedshard export``: a training checkpoint as a Hugging Face ``LlamaForCausalLM`` directory.

Every sharding strategy saves the same layout (:mod:`lightning_fedshard.strategies.group_checkpoint`): one
``torch.distributed.checkpoint`` folder per federation group (``group<k>/``; ``fsdp2`` and ``hsdp`` have one group)
and a ``meta.pt`` manifest. The export reads one whole tensor at a time from the groups' DCP files, without a
process group (DCP reassembles the ranks' shards), writes it in Hugging Face's name and rotary layout, and holds
one output shard plus the tensor being read (its float64 sum when averaging), never the whole model. With several groups it writes their average by default (what FedAvg would adopt
at the next sync; equal to every group's right after a sync), or one group's parameters with ``group=k``.

Example::

    export_hf("runs/ckpt/last.ckpt", "tiny-hf/")          # the groups' average
    export_hf("runs/ckpt/last.ckpt", "g1-hf/", group=1, dtype=torch.bfloat16)
    # transformers.LlamaForCausalLM.from_pretrained("tiny-hf/")
"""

from __future__ import annotations

import argparse
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import tokenizers
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_fedshard.data.tokenizer import ByteTokenizer, JSONTokenizer
from lightning_fedshard.models.config import LlamaConfig, RopeScaling
from lightning_fedshard.models.hf import (
    CHECKPOINT_MODEL_KEY,
    SafetensorsWriter,
    expected_shapes,
    to_hf_name,
    to_hf_tensor,
    write_hf_config,
)
from lightning_fedshard.strategies.group_checkpoint import (
    FEDSHARD_KEY,
    FILES_KEY,
    _GroupReader,
    _WeightsOnlyLoadPlanner,
    load_meta,
    verify_group_files,
)

__all__ = ["export_hf", "main"]

# Where the LightningModule's parameters sit in a group's DCP files: Lightning's "state_dict" entry, and
# LlamaPretraining's `model` attribute.
_PREFIX = "state_dict.model."
# The Llama 3 tokenizer's begin-of-text token: written as bos_token_id when the run's tokenizer.json has it.
_BOS_TOKENS = ("<|begin_of_text|>", "<s>")
_TOKENIZER_SIDECARS = ("tokenizer_config.json", "special_tokens_map.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    group: int | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    tokenizer: str | Path | None = None,
) -> Path:
    """Writes the checkpoint folder ``checkpoint`` (saved by ``fl_fsdp``, ``fl_hsdp``, ``fsdp2`` or ``hsdp``) as a
    Hugging Face ``LlamaForCausalLM`` directory ``out`` and returns its path.

    Arguments:
        group: The federation group whose parameters to write; ``None`` writes the mean of all groups' (computed
            in float64, rounded once to the output dtype).
        dtype: The output dtype; ``None`` keeps each tensor's saved dtype.
        max_shard_size: Bytes (or ``"5GB"``, ``"500MB"``) per ``model-0000k-of-0000n.safetensors`` shard, as Hugging
            Face shards; a model that fits is one ``model.safetensors``.
        tokenizer: A ``tokenizer.json`` to ship with the model; by default the one the run trained with, if it
            used one (the byte tokenizer has no Hugging Face file: then only ``generation_config.json`` names its
            end-of-text id).
    """
    path, out = Path(checkpoint), Path(out)
    meta = load_meta(path)
    saved = meta[FEDSHARD_KEY]
    num_groups = int(saved["num_groups"])
    if group is not None and not 0 <= group < num_groups:
        raise ValueError(f"{str(path)!r} holds federation groups 0..{num_groups - 1}; there is no group {group}.")
    groups = list(range(num_groups)) if group is None else [group]
    config = _model_config(meta, path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"The export folder {str(out)!r} exists and is not empty; choose a new folder.")
    readers = []
    for k in groups:
        if FILES_KEY in saved:
            verify_group_files(path, k, saved[FILES_KEY], 0, 1)
        reader = _GroupReader(path, k)
        reader.check_storage(reader.read_metadata())
        readers.append(reader)
    stored = _stored_tensors(readers[0], config, path)
    out.mkdir(parents=True, exist_ok=True)
    out_dtype = {name: dtype or stored[name].properties.dtype for name in stored}
    sizes = {name: stored[name].size.numel() * torch.empty((), dtype=out_dtype[name]).element_size() for name in stored}
    writer = SafetensorsWriter(out, {to_hf_name(name): size for name, size in sizes.items()}, max_shard_size)
    for name, info in stored.items():
        tensor = _read(readers, name, info).to(out_dtype[name])
        writer.add(*to_hf_tensor(name, tensor, config))
    writer.close()
    _write_side_files(out, config, meta, tokenizer, out_dtype["tok_embeddings.weight"])
    return out


def _model_config(meta: dict[str, Any], path: Path) -> LlamaConfig:
    """The Llama config the run trained: recorded whole by LlamaPretraining, or (older checkpoints) its preset."""
    recorded = meta.get(CHECKPOINT_MODEL_KEY)
    if recorded is not None:
        if recorded.get("architecture") != LlamaConfig.__name__:
            raise ValueError(
                f"{str(path)!r} holds a {recorded.get('architecture')} model; only Llama checkpoints export to"
                " LlamaForCausalLM."
            )
        fields = dict(recorded["config"])
        fields.pop("head_dim")  # derived
        scaling = fields.pop("rope_scaling")
        return LlamaConfig(**fields, rope_scaling=None if scaling is None else RopeScaling(**scaling))
    hparams = meta.get("hyper_parameters") or {}
    if "preset" not in hparams:
        raise ValueError(
            f"{str(path)!r} records no model config (no {CHECKPOINT_MODEL_KEY!r} entry nor LlamaPretraining's"
            " hyper-parameters): it was not saved by a LlamaPretraining run."
        )
    return LlamaConfig.from_name(hparams["preset"], **(hparams.get("overrides") or {}))


def _stored_tensors(reader: _GroupReader, config: LlamaConfig, path: Path) -> dict[str, TensorStorageMetadata]:
    """Our parameter names in the model's order, with their saved shape and dtype; checked against ``config``."""
    entries = reader.read_metadata().state_dict_metadata
    shapes = expected_shapes(config)
    missing = [name for name in shapes if _PREFIX + name not in entries]
    if missing:
        found = sorted(k for k in entries if k.startswith("state_dict."))[:4]
        raise ValueError(
            f"{str(path)!r} does not hold lightning_fedshard's Llama {config.name!r}: the model tensors"
            f" {[_PREFIX + n for n in missing[:4]]}{' ...' if len(missing) > 4 else ''} are missing"
            f" (its state_dict starts {found})."
        )
    stored = {}
    for name, shape in shapes.items():
        info = entries[_PREFIX + name]
        if not isinstance(info, TensorStorageMetadata) or tuple(info.size) != shape:
            found = tuple(info.size) if isinstance(info, TensorStorageMetadata) else type(info).__name__
            raise ValueError(f"{str(path)!r}: {_PREFIX + name} has shape {found}, but {config.name!r} has {shape}.")
        stored[name] = info
    return stored


def _read(readers: list[_GroupReader], name: str, info: TensorStorageMetadata) -> torch.Tensor:
    """The whole tensor ``name`` of one group, or the float64 mean over the groups of ``readers``."""
    total: torch.Tensor | None = None
    for reader in readers:
        whole = torch.empty(tuple(info.size), dtype=info.properties.dtype)
        try:
            with warnings.catch_warnings():  # DCP warns on every load without a process group, which is the intent
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                # no_dist: this process reads alone, also where a process group exists (rank 0 of a training job)
                state = {"state_dict": {"model." + name: whole}}
                dcp.load(state, storage_reader=reader, planner=_WeightsOnlyLoadPlanner(), no_dist=True)
        except dcp.CheckpointException as err:
            raise ValueError(f"Reading {name} from {reader.where} failed: {err}") from err
        if not bool(torch.isfinite(whole).all()):
            raise ValueError(f"{reader.where}: {name} holds non-finite values (NaN or inf).")
        if len(readers) == 1:
            return whole
        total = whole.double() if total is None else total.add_(whole.double())
    assert total is not None
    return total.div_(len(readers)).to(info.properties.dtype)


def _write_side_files(
    out: Path, config: LlamaConfig, meta: dict[str, Any], tokenizer: str | Path | None, dtype: torch.dtype
) -> None:
    """config.json, generation_config.json when the end-of-text id is known, and the tokenizer's files."""
    recorded = (meta.get(CHECKPOINT_MODEL_KEY) or {}).get("tokenizer") or {}
    spec = str(tokenizer) if tokenizer is not None else recorded.get("tokenizer")
    eos_id = bos_id = None
    if spec == "bytes":
        eos_id = ByteTokenizer.eos_id
    elif spec is not None:
        source = JSONTokenizer(spec)  # checks the file and finds its end-of-text token
        vocabulary = tokenizers.Tokenizer.from_file(str(source.path))
        eos_id = source.eos_id
        bos_id = next((i for i in map(vocabulary.token_to_id, _BOS_TOKENS) if i is not None), None)
        shutil.copyfile(source.path, out / "tokenizer.json")
        sidecars = [source.path.with_name(name) for name in _TOKENIZER_SIDECARS]
        for file in sidecars:
            if file.is_file():
                shutil.copyfile(file, out / file.name)
        if not sidecars[0].is_file():  # what AutoTokenizer needs to load tokenizer.json
            tokenizer_config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": vocabulary.id_to_token(eos_id),
                "bos_token": None if bos_id is None else vocabulary.id_to_token(bos_id),
                "model_max_length": config.max_seq_len,
            }
            (out / sidecars[0].name).write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    write_hf_config(config, out, dtype=dtype, bos_token_id=bos_id, eos_token_id=eos_id)
    if eos_id is not None:
        generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, "max_length": config.max_seq_len}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """``fedshard export CKPT OUT [--group K] [--dtype D] [--max-shard-size S] [--tokenizer FILE]``."""
    parser = argparse.ArgumentParser(
        prog="fedshard export",
        description="Write a checkpoint of fl_fsdp, fl_hsdp, fsdp2 or hsdp as a Hugging Face LlamaForCausalLM"
        " directory (config.json, safetensors, tokenizer files). Needs the [hf] extra.",
    )
    parser.add_argument("checkpoint", help="the checkpoint folder (e.g. runs/.../checkpoints/last.ckpt)")
    parser.add_argument("out", help="the new Hugging Face model folder")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--group", type=int, help="write this federation group's parameters")
    which.add_argument("--average", action="store_true", help="write the mean of all groups' parameters (default)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: keep their dtype)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    parser.add_argument("--tokenizer", help="a tokenizer.json to ship (default: the run's, if it used one)")
    args = parser.parse_args(argv)
    out = export_hf(
        args.checkpoint,
        args.out,
        group=args.group,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        max_shard_size=args.max_shard_size,
        tokenizer=args.tokenizer,
    )
    print(f"Wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
