"""Llama 3.1 pre-training as a LightningModule: next-token loss, AdamW, warm-up + cosine, perplexity."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor
from torch.nn import functional as F
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import MeanMetric

from lightning_fedshard.data.packing import IGNORE_INDEX
from lightning_fedshard.models import GPT2, GPT2_PRESETS, GPT2Config, Llama, LlamaConfig, RopeScaling
from lightning_fedshard.models.hf import CHECKPOINT_MODEL_KEY, HFWeights, install_hf_init, read_hf_config, reset_from_hf
from lightning_fedshard.optim import AdamW8bit, Muon, muon_param_groups
from lightning_fedshard.training.float8 import check_float8_available, check_float8_device, convert_blocks_to_float8
from lightning_fedshard.training.schedule import warmup_cosine

__all__ = ["DEFAULT_PRESET", "OPTIMIZERS", "LlamaPretraining"]

OPTIMIZERS = ("adamw", "adamw8bit", "muon")
DEFAULT_PRESET = "llama3.1-tiny"

Batch = tuple[Tensor, Tensor]


class LlamaPretraining(pl.LightningModule):
    """Pre-trains a Llama 3.1 model from scratch on packed ``(inputs, targets)`` token batches.

    Arguments:
        preset: A name from :data:`lightning_fedshard.models.PRESETS` (``"llama3.1-8b"``, ``"llama3.1-1b"``,
            ``"llama3.1-tiny"``, ``"llama3.1-micro"``), or a GPT-2-style preset from
            :data:`~lightning_fedshard.models.GPT2_PRESETS` (``"gpt2-tiny"``; data-parallel strategies only).
            ``None``: ``"llama3.1-tiny"``, or the shape of ``init_from``.
        overrides: Fields of :class:`~lightning_fedshard.models.LlamaConfig` to change on the preset.
        seq_len: Training sequence length (linked to the data module's by ``fedshard``); must fit the
            rotary context ``max_seq_len``.
        lr, betas, eps, weight_decay: AdamW; weight decay applies to matrices and embeddings, not to norms.
            AdamW is fused on CUDA and takes the multi-tensor (``foreach``) path elsewhere.
        optimizer: ``"adamw"`` (torch's), ``"adamw8bit"`` (:class:`~lightning_fedshard.optim.AdamW8bit`, moments in
            8 bits per block of ``quant_block``) or ``"muon"`` (:class:`~lightning_fedshard.optim.Muon` for the blocks'
            matrices with the same ``lr`` and ``weight_decay`` — Moonshot's RMS matching — and AdamW with ``lr``,
            ``betas``, ``eps`` for embeddings, norms and the output head).
        quant_block: AdamW8bit's block size (32, 64, 128 or 256).
        warmup_fraction: Share of the run's optimizer steps spent warming up linearly.
        min_lr_ratio: The cosine decay ends at ``lr * min_lr_ratio``.
        init_from: A Hugging Face ``LlamaForCausalLM`` directory (``config.json`` and ``model.safetensors`` or its
            shards) whose weights start the run instead of a random initialisation: continued pre-training. The
            model's shape comes from its ``config.json``; ``preset`` and ``overrides``, if given too, must agree with
            it field by field. Needs the ``[hf]`` extra. A resumed run (``ckpt_path``) takes the checkpoint's weights.
        float8: Train the blocks' linear layers with float8 matrix products (torchao's dynamic per-tensor scaling,
            :mod:`~lightning_fedshard.training.float8`; not the embedding or the output head). Needs the ``[float8]``
            extra and an NVIDIA GPU of compute capability ≥ 8.9 (H100, H200, L4, ...; the CPU runs it too, for
            tests); fast only with the strategy's ``compile=[TransformerBlock]``. Llama presets only.

    Under a sharding strategy (``fl_fsdp``, ``fl_hsdp``, ``fsdp2``, ``hsdp``) the model is built on the meta
    device and each rank materialises only its shards. Validation logs ``val_loss`` (mean next-token
    cross-entropy over all ranks' tokens) and ``val_ppl`` = ``exp(val_loss)``.

    Example::

        model = LlamaPretraining("llama3.1-tiny", seq_len=128, lr=3e-3)
        trainer = Trainer(strategy="fl_hsdp", devices=4, max_steps=100)
        trainer.fit(model, datamodule=TextDataModule(seq_len=128))
    """

    def __init__(
        self,
        preset: str | None = None,
        overrides: dict[str, Any] | None = None,
        seq_len: int = 256,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        warmup_fraction: float = 0.1,
        min_lr_ratio: float = 0.1,
        optimizer: Literal["adamw", "adamw8bit", "muon"] = "adamw",
        quant_block: int = 128,
        init_from: str | Path | None = None,
        float8: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        name = type(self).__name__
        self.config: LlamaConfig | GPT2Config
        if init_from is not None:
            self.config = _config_of_hf_directory(Path(init_from), preset, overrides or {}, name)
            HFWeights(init_from).check(self.config)  # missing or misshapen tensors fail here, before any process group
        elif preset in GPT2_PRESETS:
            self.config = GPT2Config.from_name(preset, **(overrides or {}))
        else:
            self.config = LlamaConfig.from_name(preset or DEFAULT_PRESET, **(overrides or {}))
        preset = self.config.name
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"{name}: `seq_len` must be a positive integer, got {seq_len!r}.")
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"{name}: seq_len={seq_len} exceeds the rotary context of {preset!r}"
                f" (max_seq_len={self.config.max_seq_len}); shorten the sequences or override `max_seq_len`."
            )
        if lr <= 0 or not 0.0 <= warmup_fraction < 1.0 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(
                f"{name}: need lr > 0, 0 ≤ warmup_fraction < 1 and 0 ≤ min_lr_ratio ≤ 1; got lr={lr},"
                f" warmup_fraction={warmup_fraction}, min_lr_ratio={min_lr_ratio}."
            )
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"{name}: unknown `optimizer={optimizer!r}`; choose one of {OPTIMIZERS}.")
        if float8:
            if not isinstance(self.config, LlamaConfig):
                raise ValueError(f"{name}: float8=True converts Llama blocks; {preset!r} is not a Llama preset.")
            check_float8_available()  # here, before any process starts
        self.float8 = float8
        self.seq_len = seq_len
        self.init_from = None if init_from is None else Path(init_from)
        self.model: Llama | GPT2 | None = None
        #: The data module's tokenizer (``"bytes"`` or a tokenizer.json path) and end-of-text id, for the export.
        self.tokenizer_info: dict[str, Any] | None = None
        self.val_loss = MeanMetric()
        #: Read by TokenThroughputMonitor for MFU; set per batch since batch shapes are known only then.
        self.flops_per_batch = 0

    def check_vocab(self, vocab_size: int) -> None:
        """Raises unless the tokenizer's ``vocab_size`` ids all have an embedding row."""
        if vocab_size > self.config.vocab_size:
            raise ValueError(
                f"{type(self).__name__}: the tokenizer has {vocab_size} ids but {self.config.name!r} embeds only"
                f" {self.config.vocab_size}; choose a matching tokenizer or override `vocab_size`."
            )

    def configure_model(self) -> None:
        if self.model is not None:
            return  # Lightning calls this again for every fit/validate/test
        sharded = self._trainer is not None and isinstance(self._trainer.strategy, ModelParallelStrategy)
        if isinstance(self.config, GPT2Config):
            if sharded:
                raise ValueError(
                    f"{type(self).__name__}: {self.config.name!r} trains under data-parallel strategies (ddp,"
                    " ddp_dynamiq); the sharding strategies shard Llama blocks."
                )
            self.model = GPT2(self.config)
            return
        # sharding strategies materialise the meta model one shard per rank
        with torch.device("meta") if sharded else nullcontext():
            self.model = Llama(self.config)
        if self.float8:
            check_float8_device(self._trainer.strategy.root_device if self._trainer is not None else self.device)
            convert_blocks_to_float8(self.model)  # before the strategy shards the blocks (and loads init_from)
        if self.init_from is not None:
            # The strategies materialise a meta model through each module's reset_parameters(), which now loads.
            install_hf_init(self.model, self.init_from, self.config)
            if not sharded:
                reset_from_hf(self.model)

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "vocab_size"):
            self.check_vocab(datamodule.vocab_size)
        tokenizer = getattr(datamodule, "tokenizer", None)
        if tokenizer is not None and hasattr(tokenizer, "eos_id"):
            path = getattr(tokenizer, "path", None)
            self.tokenizer_info = {"tokenizer": "bytes" if path is None else str(path), "eos_id": tokenizer.eos_id}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The whole config (an init_from directory may be gone by export time) and the tokenizer the run used.
        checkpoint[CHECKPOINT_MODEL_KEY] = {
            "config": dataclasses.asdict(self.config),
            "architecture": type(self.config).__name__,
            "tokenizer": self.tokenizer_info,
        }

    def forward(self, tokens: Tensor) -> Tensor:
        assert self.model is not None, "configure_model() builds the model"
        return self.model(tokens)

    def _token_losses(self, batch: Batch, training: bool) -> Tensor:
        inputs, targets = batch
        flops = self.config.flops_per_token(inputs.shape[1]) * inputs.numel()
        self.flops_per_batch = flops if training else flops // 3  # evaluation runs the forward pass only
        logits = self(inputs)
        return F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        )[targets.flatten() != IGNORE_INDEX]

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self._token_losses(batch, training=True).mean()
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.val_loss.update(self._token_losses(batch, training=False))

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # a token-weighted mean over every rank's batches
        self.val_loss.reset()
        # already equal on every rank; sync_dist only tells Lightning so (one scalar all-reduce)
        self.log_dict({"val_loss": loss, "val_ppl": loss.exp()}, sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = self._optimizer()
        total = int(self.trainer.estimated_stepping_batches)
        schedule = warmup_cosine(total, round(hp.warmup_fraction * total), hp.min_lr_ratio)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": LambdaLR(optimizer, schedule), "interval": "step"},
        }

    def _optimizer(self) -> torch.optim.Optimizer:
        hp = self.hparams
        betas = tuple(hp.betas)
        name = hp.get("optimizer", "adamw")
        if name == "muon":
            assert self.model is not None
            return Muon(
                muon_param_groups(self.model),
                lr=hp.lr,
                weight_decay=hp.weight_decay,
                adamw_betas=betas,
                adamw_eps=hp.eps,
                adamw_weight_decay=hp.weight_decay,
            )
        decayed = [p for p in self.parameters() if p.ndim >= 2]
        kept = [p for p in self.parameters() if p.ndim < 2]
        groups = [{"params": decayed, "weight_decay": hp.weight_decay}, {"params": kept, "weight_decay": 0.0}]
        if name == "adamw8bit":
            return AdamW8bit(groups, lr=hp.lr, betas=betas, eps=hp.eps, block_size=hp.get("quant_block", 128))
        # one fused kernel per step on CUDA; elsewhere the multi-tensor (foreach) path, which torch picks by itself
        # only for CUDA tensors (on the CPU it would step one tensor at a time)
        cuda = self.device.type == "cuda"
        return torch.optim.AdamW(groups, lr=hp.lr, betas=betas, eps=hp.eps, fused=cuda, foreach=not cuda)


def _config_of_hf_directory(directory: Path, preset: str | None, overrides: dict[str, Any], name: str) -> LlamaConfig:
    """The config of a Hugging Face Llama directory; ``preset`` and ``overrides``, if given, must describe the same
    model (a mismatch names the field), so that a recipe cannot silently train another shape than it says."""
    config = read_hf_config(directory)
    if preset is None and not overrides:
        return config
    if preset in GPT2_PRESETS:
        raise ValueError(f"{name}: init_from={str(directory)!r} holds a Llama, but preset={preset!r} is GPT-2.")
    if preset is not None:
        wanted = LlamaConfig.from_name(preset, **overrides)
    else:
        fields = dict(overrides)
        if isinstance(fields.get("rope_scaling"), dict):
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        wanted = dataclasses.replace(config, **fields)
    for field in dataclasses.fields(LlamaConfig):
        if field.name != "name" and getattr(wanted, field.name) != getattr(config, field.name):
            raise ValueError(
                f"{name}: {field.name}={getattr(wanted, field.name)!r} from preset={preset!r} and overrides, but the"
                f" init_from directory {str(directory)!r} has {field.name}={getattr(config, field.name)!r}"
                " in its config.json. Drop `preset`/`overrides` to take the directory's shape."
            )
    return dataclasses.replace(config, name=wanted.name)
