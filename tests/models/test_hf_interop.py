"""Hugging Face interop: ``fedshard export`` against transformers' LlamaForCausalLM, the import (``init_from``) back,
and a real checkpoint of two federation groups saved by a 2-process fl_fsdp Trainer run."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from lightning_fedshard import LlamaPretraining, export_hf
from lightning_fedshard.cli import main as fedshard
from lightning_fedshard.models import Llama, LlamaConfig
from lightning_fedshard.models.hf import CHECKPOINT_MODEL_KEY, HFWeights, read_hf_config, to_hf_name
from lightning_fedshard.strategies.group_checkpoint import (
    FEDSHARD_KEY,
    describe_group_share,
    finish_save,
    save_group_state,
    staging_dir,
)
from tests.launching import run_isolated

transformers = pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("hf_worker.py")

# save_checkpoint writes each group from this one process, which DCP warns about
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def save_checkpoint(path: Path, groups: list[Llama], record_config: bool = True, extra: dict | None = None) -> Path:
    """A checkpoint folder in the strategies' layout, written by their own functions: one DCP folder per group
    (a single process writes each whole), then the manifest with what LlamaPretraining records (or, as older
    checkpoints, only its hyper-parameters)."""
    staging = staging_dir(path, uuid.uuid4().hex)
    files = {}
    for k, model in enumerate(groups):
        state = {"state_dict": {f"model.{name}": p for name, p in model.state_dict().items()}}
        save_group_state(staging, k, state, None)
        files.update(describe_group_share(staging, k, 0, 1))
    config = groups[0].config
    meta = {"hyper_parameters": {"preset": config.name}, FEDSHARD_KEY: {"num_groups": len(groups)}, **(extra or {})}
    if record_config:
        meta[CHECKPOINT_MODEL_KEY] = {"config": dataclasses.asdict(config), "architecture": "LlamaConfig"}
    finish_save(staging, path, meta, files)
    return path


def model_of(preset: str, seed: int, **overrides: object) -> Llama:
    torch.manual_seed(seed)
    model = Llama(LlamaConfig.from_name(preset, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms start at 1: random ones check that each lands where it belongs
                p.uniform_(0.5, 1.5)
            if name.endswith(("wq.weight", "wk.weight")):  # sharp attention, so that the logits feel the rotary angles
                p.mul_(8)
    return model


def hf_rows(ours: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face's row order of a q/k projection, row by row from its definition: in each head, first the even
    rows of our interleaved pairs (the real parts), then the odd ones."""
    head_dim = ours.shape[0] // n_heads
    order = [h * head_dim + 2 * j + half for h in range(n_heads) for half in (0, 1) for j in range(head_dim // 2)]
    return ours[order]


# The tiny presets have plain RoPE; Llama 3.1's own scaling (original context 8192) on a context past it; and a
# scaling whose every field differs from Llama 3.1's.
LLAMA31_CONTEXT = {"rope_scaling": {}, "max_seq_len": 16384}
SHORT_CONTEXT = {
    "rope_scaling": {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0, "original_max_position": 32}
}


class TransformersLog(logging.Handler):
    """What ``transformers`` logs at WARNING or above while it is attached (its loggers do not propagate)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [("llama3.1-tiny", {}), ("llama3.1-micro", LLAMA31_CONTEXT), ("llama3.1-micro", SHORT_CONTEXT)],
    ids=["tiny", "micro-llama3.1-scaling", "micro-short-context"],
)
def test_exported_model_gives_transformers_the_same_logits(preset, overrides, tmp_path):
    model = model_of(preset, seed=0, **overrides)
    ckpt = save_checkpoint(tmp_path / "last.ckpt", [model])
    out = export_hf(ckpt, tmp_path / "hf", max_shard_size="200KB")  # several shards and their index
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(weight_map) == 2 + 9 * len(model.layers) + 1 and len(set(weight_map.values())) > 1
    config = json.loads((out / "config.json").read_text())
    scaling = model.config.rope_scaling
    assert config["rope_scaling"] == (
        None
        if scaling is None
        else {
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position,
            "rope_type": "llama3",
        }
    )
    assert (config["tie_word_embeddings"], config["rms_norm_eps"], config["rope_theta"]) == (False, 1e-5, 500000.0)
    assert config["num_key_value_heads"] == 2 and config["torch_dtype"] == "float32"

    log = TransformersLog()
    logging.getLogger("transformers").addHandler(log)
    try:
        hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    finally:
        logging.getLogger("transformers").removeHandler(log)
    assert log.messages == []  # an exported config.json loads without warnings
    tokens = torch.randint(0, 257, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=0, atol=1e-5)
        if scaling is not None:  # the comparison sees the scaling: without it our logits move far past the tolerance
            unscaled = Llama(dataclasses.replace(model.config, rope_scaling=None))
            unscaled.load_state_dict(model.state_dict())
            assert (unscaled(tokens) - model(tokens)).abs().max() > 1e-4


def test_round_trip_reproduces_every_parameter_bit_for_bit(tmp_path):
    model = model_of("llama3.1-micro", seed=2)
    ckpt = save_checkpoint(tmp_path / "last.ckpt", [model], record_config=False)  # the config from its preset
    out = export_hf(ckpt, tmp_path / "hf", max_shard_size=50_000)
    imported = LlamaPretraining(init_from=out, seq_len=64)
    imported.configure_model()
    assert dataclasses.replace(imported.config, name=model.config.name) == model.config
    ours = dict(model.named_parameters())
    for name, p in imported.model.named_parameters():
        assert torch.equal(p, ours[name]), name
    # and the same directory read by transformers' conventions: q/k rows in Hugging Face's order
    saved = {name: t for f in out.glob("*.safetensors") for name, t in load_file(f).items()}
    assert torch.equal(
        saved["model.layers.1.self_attn.q_proj.weight"], hf_rows(ours["layers.1.attention.wq.weight"], 4)
    )
    assert torch.equal(
        saved["model.layers.0.self_attn.k_proj.weight"], hf_rows(ours["layers.0.attention.wk.weight"], 2)
    )
    assert torch.equal(saved["model.layers.0.mlp.gate_proj.weight"], ours["layers.0.feed_forward.w1.weight"])


def test_import_reads_a_transformers_saved_directory(tmp_path):
    """transformers' own save (its v5 config format) starts our model with the same logits."""
    config = transformers.LlamaConfig(
        vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )  # fmt: skip
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    module = LlamaPretraining(init_from=tmp_path / "hf", seq_len=32)
    module.configure_model()
    assert module.config.rope_theta == 10000.0 and module.config.rope_scaling.original_max_position == 64
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # a tied head: our untied output starts as the embedding
        torch.testing.assert_close(module(tokens), hf(tokens).logits, rtol=0, atol=1e-5)


def test_export_and_import_refuse_bad_input(tmp_path):
    model = model_of("llama3.1-micro", seed=0)
    ckpt = save_checkpoint(tmp_path / "last.ckpt", [model, model])
    out = export_hf(ckpt, tmp_path / "hf")
    with pytest.raises(ValueError, match="there is no group 2"):
        export_hf(ckpt, tmp_path / "other", group=2)
    with pytest.raises(FileExistsError, match="not empty"):
        export_hf(ckpt, out)
    with pytest.raises(ValueError, match="dim=128 from preset='llama3.1-tiny' and overrides, but .* has dim=64"):
        LlamaPretraining("llama3.1-tiny", init_from=out)
    with pytest.raises(ValueError, match="n_layers=3 from preset=None"):
        LlamaPretraining(init_from=out, overrides={"n_layers": 3})

    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type is 'gpt2', not 'llama'"):
        LlamaPretraining(init_from=out)
    (out / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"down_proj.weight has shape \(64, 128\), but config.json implies \(64, 96\)"):
        LlamaPretraining(init_from=out)  # at construction, before any process group
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(
        ValueError, match=r"does not hold a Llama of its config.json: missing \['model.layers.2.input_layernorm.weight'"
    ):
        LlamaPretraining(init_from=out)

    foreign = tmp_path / "foreign.ckpt"
    staging = staging_dir(foreign, "0")
    save_group_state(staging, 0, {"state_dict": {"net.weight": torch.zeros(3)}}, None)
    meta = {"hyper_parameters": {"preset": "llama3.1-micro"}, FEDSHARD_KEY: {"num_groups": 1}}
    finish_save(staging, foreign, meta, describe_group_share(staging, 0, 0, 1))
    with pytest.raises(ValueError, match=r"does not hold lightning_fedshard's Llama .*model.tok_embeddings.weight"):
        export_hf(foreign, tmp_path / "foreign-hf")
    with pytest.raises(FileNotFoundError, match="not an FL\\+FSDP/FL\\+HSDP checkpoint"):
        export_hf(tmp_path / "nowhere", tmp_path / "x")


def test_export_command_casts_and_ships_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.train_from_iterator(["a b c"], trainers.WordLevelTrainer(special_tokens=["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]))  # fmt: skip
    tok.save(str(tmp_path / "tokenizer.json"))
    model = model_of("llama3.1-micro", seed=0)
    ckpt = save_checkpoint(tmp_path / "last.ckpt", [model])
    out = tmp_path / "hf"
    fedshard(["export", str(ckpt), str(out), "--dtype", "bfloat16", "--tokenizer", str(tmp_path / "tokenizer.json")])
    saved = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in saved.values())
    assert torch.equal(saved["lm_head.weight"], model.output.weight.detach().bfloat16())
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (hf_tok.eos_token, hf_tok.bos_token) == ("<|end_of_text|>", "<|begin_of_text|>")


def test_the_training_path_imports_no_safetensors():
    # transformers is left out: torchmetrics (MeanMetric's package) imports it whenever it is installed
    code = (
        "import sys, lightning_fedshard.training, lightning_fedshard.cli\n"
        "print([m for m in ('safetensors', 'lightning_fedshard.models.hf_export') if m in sys.modules])"
    )
    result = run_isolated([sys.executable, "-c", code])
    assert result.returncode == 0 and result.stdout.split()[-1] == "[]", result.stderr[-3000:]


def test_missing_safetensors_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"\[hf\]"):
        HFWeights(tmp_path)


def _read_group(ckpt: Path, group: int, key: str, like: torch.Tensor) -> torch.Tensor:
    """One tensor of one group, read with DCP's stock reader."""
    state = {key: torch.empty_like(like)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(ckpt / f"group{group}"), no_dist=True)
    return state[key]


@pytest.mark.multiproc
def test_export_of_a_two_group_fl_fsdp_run_and_sharded_import(tmp_path):
    result = run_isolated([sys.executable, str(WORKER), str(tmp_path)])
    assert result.returncode == 0, result.stderr[-6000:]
    ckpt = tmp_path / "step=1.ckpt"  # between syncs
    average = export_hf(ckpt, tmp_path / "average")
    group0 = export_hf(ckpt, tmp_path / "group0", group=0)
    config = read_hf_config(average)
    assert config == dataclasses.replace(read_hf_config(tmp_path / "group1-hf"), name="average")
    assert (config.n_layers, config.dim) == (2, 64)
    assert json.loads((average / "generation_config.json").read_text())["eos_token_id"] == 256  # the byte tokenizer
    files = {name: load_file(d / "model.safetensors") for name, d in [("avg", average), ("g0", group0), ("g1", tmp_path / "group1-hf")]}  # fmt: skip
    template = Llama(config)
    differ = 0
    for name, p in template.named_parameters():
        hf_name = to_hf_name(name)
        g0, g1 = (_read_group(ckpt, k, f"state_dict.model.{name}", p) for k in (0, 1))
        if "wq" in name or "wk" in name:
            heads = config.n_heads if "wq" in name else config.n_kv_heads
            g0, g1 = hf_rows(g0, heads), hf_rows(g1, heads)
        assert torch.equal(files["g0"][hf_name], g0) and torch.equal(files["g1"][hf_name], g1), name
        assert torch.equal(files["avg"][hf_name], ((g0.double() + g1.double()) / 2).float()), name
        differ += not torch.equal(g0, g1)
    assert differ > 20  # the groups never synced: they trained apart from the same start
    # the fsdp2 run over both ranks started from group 1's export, exactly, in its DTensor shards
    started = torch.load(tmp_path / "init.pt", weights_only=True)
    assert set(started["sharded"]) == {"DTensor"}
    for name, whole in started["whole"].items():
        assert torch.equal(whole, _read_group(ckpt, 1, f"state_dict.model.{name}", whole)), name
