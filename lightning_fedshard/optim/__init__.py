"""Structure-aware optimizers and shard planning: Muon, 8-bit AdamW, block-aligned FSDP2 shards.

``Muon`` and ``AdamW8bit`` are torch.optim optimizers that work on plain tensors and on FSDP2's sharded DTensors
(every strategy of this package); ``BlockShardPlan`` chooses block-aligned shard dimensions for FSDP2.
"""

from lightning_fedshard.optim.adamw8bit import AdamW8bit
from lightning_fedshard.optim.block_quant import dequantize_signed, dequantize_sqrt, quantize_signed, quantize_sqrt
from lightning_fedshard.optim.muon import Muon, muon_param_groups
from lightning_fedshard.optim.newton_schulz import NS_COEFFICIENTS, newton_schulz, ns_dtype
from lightning_fedshard.optim.owner_exchange import ShardLayout, local_shard, transform_on_owners
from lightning_fedshard.optim.owners import assign_owners, ns_cost
from lightning_fedshard.optim.shard_plan import BlockShardPlan, ParamBlockPlan, chunk_sizes, plan_param

__all__ = [
    "NS_COEFFICIENTS",
    "AdamW8bit",
    "Muon",
    "ParamBlockPlan",
    "ShardLayout",
    "BlockShardPlan",
    "assign_owners",
    "chunk_sizes",
    "dequantize_signed",
    "dequantize_sqrt",
    "local_shard",
    "muon_param_groups",
    "newton_schulz",
    "ns_cost",
    "ns_dtype",
    "plan_param",
    "quantize_signed",
    "quantize_sqrt",
    "transform_on_owners",
]
