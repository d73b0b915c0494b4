import math

import pytest
import torch
from lightning.fabric.utilities.throughput import measure_flops
from torch import nn
from torch.nn import functional as F

from lightning_fedshard.models import PRESETS, Llama, LlamaConfig, RopeScaling, TransformerBlock
from lightning_fedshard.models.llama import Attention, apply_rotary, rotary_frequencies, scale_frequencies
from lightning_fedshard.strategies.apply import apply_activation_checkpointing, materialize

# Published sizes: Llama 3.1 8B has 8,030,261,248 parameters (Meta's model card / HF safetensors index).
# Llama 3.2 1B has 1,235,814,400 with a tied head; our 1B preset unties it: + 128256 × 2048.
EXPECTED_PARAMETERS = {
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-1b": 1_235_814_400 + 128256 * 2048,
    # tiny presets by hand: 2·V·d + d + L·(2d² + 2d·kv + 3d·ffn + 2d)
    "llama3.1-tiny": 2 * 257 * 128 + 128 + 4 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384 + 2 * 128),
    "llama3.1-micro": 2 * 257 * 64 + 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64),
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_counts_on_meta(name):
    assert set(EXPECTED_PARAMETERS) == set(PRESETS)
    config = LlamaConfig.from_name(name)
    with torch.device("meta"):
        model = Llama(config)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == EXPECTED_PARAMETERS[name] == config.num_parameters


def test_8b_shapes():
    c = LlamaConfig.from_name("llama3.1-8b")
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    assert c.head_dim == 128 and c.rope_theta == 500000.0
    assert c.rope_scaling == RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192
    )


def _meta_apply_scaling(freqs: list[float]) -> list[float]:
    """Meta's published Llama 3.1 `apply_scaling` (llama-models, reference_impl/model.py), scalar form."""
    scale_factor, low_freq_factor, high_freq_factor, old_context_len = 8, 1, 4, 8192
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return new_freqs


def test_rotary_scaling_matches_published_formula():
    base = [1.0 / 500000 ** (i / 128) for i in range(0, 128, 2)]
    expected = torch.tensor(_meta_apply_scaling(base), dtype=torch.float32)
    ours = rotary_frequencies(128, 500000.0, RopeScaling())
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    assert ours[0] == 1.0  # the fastest pair is untouched
    assert (ours < torch.tensor(base, dtype=torch.float32)).sum() > 0


@pytest.mark.parametrize(
    ("wavelength", "factor"),
    [
        (1024, 1.0),  # shorter than 8192/4: kept
        (2048, 1.0),  # the short edge: smooth = 1
        (4096, 5 / 12),  # inside the band: smooth = 1/3 -> (2/3)/8 + 1/3
        (8192, 1 / 8),  # the long edge: smooth = 0
        (16384, 1 / 8),  # longer than 8192: stretched by 8
    ],
)
def test_rotary_scaling_known_frequencies(wavelength, factor):
    freq = torch.tensor([2 * math.pi / wavelength], dtype=torch.float64)
    assert scale_frequencies(freq, RopeScaling()).item() == pytest.approx(freq.item() * factor, rel=1e-12)


def test_rotary_rotates_pairs_and_keeps_relative_positions():
    config = LlamaConfig.from_name("llama3.1-micro")
    model = Llama(config)
    rotation = model.rope(8)
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, config.head_dim).unbind(0)
    q, k = q.expand(1, 8, 1, -1), k.expand(1, 8, 1, -1)  # the same vector at every position
    rq, rk = apply_rotary(q, rotation), apply_rotary(k, rotation)
    torch.testing.assert_close(rq[:, 0], q[:, 0])  # position 0 is not rotated
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    # pair i of position p turns by p * freq_i
    p, i = 5, 3
    angle = p * rotary_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)[i]
    x, y = q[0, p, 0, 2 * i], q[0, p, 0, 2 * i + 1]
    expected = torch.stack([x * angle.cos() - y * angle.sin(), x * angle.sin() + y * angle.cos()])
    torch.testing.assert_close(rq[0, p, 0, 2 * i : 2 * i + 2], expected)
    # scores depend on the offset only
    scores = torch.einsum("bpd,bqd->pq", rq[:, :, 0], rk[:, :, 0])
    torch.testing.assert_close(scores[3, 1], scores[6, 4], rtol=1e-5, atol=1e-5)


def _naive_attention(attn: Attention, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    b, t, _ = x.shape
    h, kvh, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = apply_rotary((x @ attn.wq.weight.T).view(b, t, h, d), rotation).transpose(1, 2)
    k = apply_rotary((x @ attn.wk.weight.T).view(b, t, kvh, d), rotation).transpose(1, 2)
    v = (x @ attn.wv.weight.T).view(b, t, kvh, d).transpose(1, 2)
    k, v = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)  # query head j uses kv j // g
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h * d)
    return out @ attn.wo.weight.T


def test_gqa_attention_equals_naive_reference():
    torch.manual_seed(0)
    config = LlamaConfig.from_name("llama3.1-micro", n_heads=8, n_kv_heads=2)
    model = Llama(config)
    attn = model.layers[0].attention
    x = torch.randn(3, 11, config.dim)
    rotation = model.rope(11)
    torch.testing.assert_close(attn(x, rotation), _naive_attention(attn, x, rotation), rtol=1e-5, atol=1e-5)


def test_model_is_causal():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_name("llama3.1-micro"))
    tokens = torch.randint(0, 257, (2, 12))
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 257
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_initialisation_follows_the_llama_scheme():
    torch.manual_seed(0)
    config = LlamaConfig.from_name("llama3.1-micro", dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512, n_layers=3)
    model = Llama(config)
    block = model.layers[2]
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attention.wo.weight.std().item() == pytest.approx(0.02 / math.sqrt(6) * 0.9866, rel=0.05)
    assert block.attention.wq.weight.abs().max() <= 3 * 0.02  # truncated at 3σ
    assert torch.equal(block.ffn_norm.weight, torch.ones(256))
    assert model.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.05)


def test_meta_model_materialises_through_reset_parameters():
    config = LlamaConfig.from_name("llama3.1-micro")
    with torch.device("meta"):
        model = Llama(config)
    materialize(nn.ModuleDict({"model": model}), torch.device("cpu"))  # what the strategies call
    expected = rotary_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(model.rope.inv_freq, expected)
    assert torch.equal(model.norm.weight, torch.ones(config.dim))
    assert torch.isfinite(model(torch.randint(0, 257, (1, 8)))).all()


def test_flops_per_token_equals_counted_flops():
    config = LlamaConfig.from_name("llama3.1-micro")
    seq_len, batch = 32, 2
    with torch.device("meta"):
        model = Llama(config)
        tokens = torch.randint(0, 257, (batch, seq_len))
    counted = measure_flops(model, lambda: model(tokens), loss_fn=torch.Tensor.sum)
    assert counted == config.flops_per_token(seq_len) * batch * seq_len


def test_activation_checkpointing_keeps_gradients_and_names():
    torch.manual_seed(0)
    config = LlamaConfig.from_name("llama3.1-micro")
    plain = Llama(config)
    checkpointed = Llama(config)
    checkpointed.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(checkpointed, [TransformerBlock]) == config.n_layers
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    tokens = torch.randint(0, 257, (2, 16))
    for model in (plain, checkpointed):
        F.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_bad_configs_fail_clearly():
    with pytest.raises(ValueError, match="Unknown Llama preset 'llama9'"):
        LlamaConfig.from_name("llama9")
    with pytest.raises(ValueError, match="no fields"):
        LlamaConfig.from_name("llama3.1-tiny", width=3)
    with pytest.raises(ValueError, match="not a multiple of n_kv_heads"):
        LlamaConfig.from_name("llama3.1-tiny", n_kv_heads=3)
    model = Llama(LlamaConfig.from_name("llama3.1-micro", max_seq_len=8))
    with pytest.raises(ValueError, match="exceeds the rotary context"):
        model(torch.zeros(1, 9, dtype=torch.long))
