"""Communication and time cost of one optimizer step for fsdp2, hsdp, fl_fsdp and fl_hsdp, in closed form.

Bytes are what one rank sends, per mesh tier, with the ring costs the strategies' :class:`CommLedger`
counts, so that for a real model (FSDP2's padded shards, root units gathered once) they equal the ledger
exactly. A placement of the ``("fed", "replicate", "shard")`` mesh on nodes turns them into per-link
traffic (intra-node, inter-node inside a group, across groups), and a :class:`Cluster` turns that and
the model FLOPs into seconds. Derivation and the reference-cluster numbers: ``docs/cost-model.md``.

``fedshard bench costmodel`` prints Llama 3.1 8B on the reference cluster (128 nodes × 4 A100).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn

from lightning_fedshard.dynamiq.collective import plan_transfer
from lightning_fedshard.dynamiq.settings import Compression
from lightning_fedshard.models.config import LlamaConfig
from lightning_fedshard.strategies.apply import fsdp_units
from lightning_fedshard.strategies.averager import BUCKET_BYTES
from lightning_fedshard.strategies.dims import FedShardDims
from lightning_fedshard.strategies.ledger import TIERS, ring_bytes

__all__ = [
    "LEONARDO",
    "LINKS",
    "Cluster",
    "ShardedSizes",
    "StepTime",
    "Workload",
    "fed_sync_bytes",
    "link_bytes",
    "main",
    "mean_step_bytes",
    "node_egress_bytes",
    "step_bytes",
    "step_time",
]

#: Physical links, innermost first: inside a node, between the nodes of one group, between groups.
LINKS = ("intra_node", "inter_node", "cross_group")


# ---- what the model is made of ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardedSizes:
    """The element counts that decide one step's traffic.

    FSDP2 shards every parameter along dim 0 in ``torch.chunk`` pieces and pads it to ``shard_size`` equal
    pieces, so all-gathers and reduce-scatters move padded tensors; the cross-group average moves each
    rank's own, unpadded shards. Root units (top-level ones) keep their parameters gathered from forward
    to backward and are gathered once per micro-batch, every other unit twice.

    Example::

        sizes = ShardedSizes.of_module(llama_module, shard_size=4, auto_wrap=[TransformerBlock])
        ideal = ShardedSizes.ideal(8_030_261_248, shard_size=4, units=33, root_numel=1_050_677_248)
    """

    padded_numel: int
    root_padded_numel: int
    units: int
    root_units: int
    local_numel: float
    """Elements of this rank's parameter shards (fractional for :meth:`ideal` sizes)."""

    @classmethod
    def of_module(
        cls, module: nn.Module, shard_size: int, auto_wrap: Sequence[type[nn.Module]] = (), shard_rank: int = 0
    ) -> ShardedSizes:
        """Sizes of ``module`` (unsharded) as the strategies shard it, seen by the rank at ``shard_rank``."""
        units = fsdp_units(module, auto_wrap)
        roots = {id(child) for child in module.children()}
        names = {id(m): name for name, m in module.named_modules()}
        # a parameter belongs to the innermost unit around it: the longest unit name that prefixes it
        prefixes = sorted(((names[id(u)] + ".", id(u) in roots) for u in units), key=lambda p: -len(p[0]))
        padded = root_padded = 0
        local = 0
        for name, param in module.named_parameters():
            is_root = next((root for prefix, root in prefixes if name.startswith(prefix)), None)
            if is_root is None:
                raise ValueError(f"{name} is in no FSDP unit; apply_fsdp refuses such a module.")
            rows = param.shape[0] if param.dim() else 1
            per_row = param.numel() // rows
            chunk = -(-rows // shard_size)
            padded += chunk * shard_size * per_row
            root_padded += chunk * shard_size * per_row if is_root else 0
            local += max(0, min(chunk, rows - shard_rank * chunk)) * per_row
        return cls(padded, root_padded, len(units), sum(id(u) in roots for u in units), local)

    @classmethod
    def ideal(cls, numel: int, shard_size: int, *, units: int, root_numel: int, root_units: int = 1) -> ShardedSizes:
        """Sizes without padding, for models too large to build: every rank holds ``numel / shard_size``."""
        return cls(numel, root_numel, units, root_units, numel / shard_size)

    @classmethod
    def of_llama(cls, config: LlamaConfig, shard_size: int) -> ShardedSizes:
        """Llama sharded one unit per block plus the root (embeddings, final norm, head), without padding."""
        block = (config.num_parameters - 2 * config.vocab_size * config.dim - config.dim) // config.n_layers
        return cls.ideal(
            config.num_parameters,
            shard_size,
            units=config.n_layers + 1,
            root_numel=config.num_parameters - config.n_layers * block,
        )


@dataclass(frozen=True)
class Workload:
    """One training configuration: mesh, model sizes, wire dtypes and schedule.

    Example::

        w = Workload.for_llama(LlamaConfig.from_name("llama3.1-8b"), FedShardDims(128, 1, 4), seq_len=2048,
                               micro_batch=2, sync_every=8)
        mean_step_bytes(w)   # {"shard": ..., "replicate": 0.0, "fed": ...}
    """

    dims: FedShardDims
    sizes: ShardedSizes
    sync_every: int = 8
    micro_batches: int = 1
    """Micro-batches per optimizer step: FSDP2 gathers and reduces once per micro-batch."""
    gather_itemsize: int = 4
    """Bytes per element FSDP2 all-gathers (2 under ``bf16-mixed``)."""
    reduce_itemsize: int = 4
    """Bytes per element of gradient reduce-scatters and HSDP all-reduces (fp32 also under ``bf16-mixed``)."""
    sync_itemsize: int = 4
    """Bytes per element of the cross-group average (the strategies' ``sync_dtype``)."""
    sync_mode: Literal["all_replicas", "leader"] = "all_replicas"
    fed_compression: Compression | None = None
    """DynamiQ settings when the cross-group average is compressed."""
    tokens_per_step: int = 0
    """Tokens one rank processes per optimizer step."""
    flops_per_token: float = 0.0
    """Training FLOPs per token (forward and backward, no recomputation)."""
    fragment_shares: tuple[float, ...] = (1.0,)
    """Streaming sync: each fragment's share of the parameters (one fragment, the whole model: blocking sync)."""
    fragment_sync_delay: int = 0
    """Streaming sync's τ: steps of compute a fragment's average has to cross the network before it is applied."""

    @classmethod
    def for_llama(
        cls,
        config: LlamaConfig,
        dims: FedShardDims,
        *,
        seq_len: int,
        micro_batch: int,
        sync_every: int = 8,
        micro_batches: int = 1,
        precision: str = "bf16-mixed",
        **kwargs,
    ) -> Workload:
        return cls(
            dims,
            ShardedSizes.of_llama(config, dims.shard_size),
            sync_every=sync_every,
            micro_batches=micro_batches,
            gather_itemsize=2 if precision == "bf16-mixed" else 4,
            tokens_per_step=seq_len * micro_batch * micro_batches,
            flops_per_token=config.flops_per_token(seq_len),
            **kwargs,
        )


# ---- bytes per mesh tier (what the ledger counts) ------------------------------------------------------


@dataclass(frozen=True)
class _Collectives:
    """All calls of one collective on one mesh tier in one step: the bytes one rank sends in them together."""

    tier: str
    kind: str
    nbytes: float
    calls: int


def _step_collectives(w: Workload) -> list[_Collectives]:
    """FSDP2's traffic in one step: per micro-batch every unit is gathered (non-root units twice: again for
    backward) and reduce-scattered, and under HSDP its reduced shard all-reduced across replicas."""
    s, r, m = w.dims.shard_size, w.dims.replicate_size, w.micro_batches
    p, root, units = w.sizes.padded_numel, w.sizes.root_padded_numel, w.sizes.units
    gathered = (2 * p - root) * w.gather_itemsize
    return [
        _Collectives(
            "shard", "all_gather", m * ring_bytes("all_gather", gathered, s), m * (2 * units - w.sizes.root_units)
        ),
        _Collectives("shard", "reduce_scatter", m * ring_bytes("reduce_scatter", p * w.reduce_itemsize, s), m * units),
        _Collectives("replicate", "all_reduce", m * ring_bytes("all_reduce", p // s * w.reduce_itemsize, r), m * units),
    ]


def _sync_collectives(w: Workload, replicate_rank: int = 0) -> list[_Collectives]:
    """One cross-group round, every fragment once."""
    return [c for share in w.fragment_shares for c in _fragment_collectives(w, share, replicate_rank)]


def _fragment_collectives(w: Workload, share: float, replicate_rank: int = 0) -> list[_Collectives]:
    """The average of one fragment (``share`` of the parameters): the all-reduce of this rank's shards over the F
    groups (bucketed), and in ``leader`` mode the broadcast of the result from replica 0 to the other replicas."""
    f, r = w.dims.num_groups, w.dims.replicate_size
    if f == 1:
        return []
    numel = w.sizes.local_numel * share
    buckets = _sync_buckets(w, numel)
    leader = w.sync_mode == "leader" and r > 1
    out = []
    if not leader or replicate_rank == 0:
        out.append(_Collectives("fed", "all_reduce", sum(_fed_all_reduce_bytes(w, n) for n in buckets), len(buckets)))
    if leader:
        out.append(
            _Collectives("replicate", "broadcast", ring_bytes("broadcast", numel * w.sync_itemsize, r), len(buckets))
        )
    return out


def _by_tier(collectives: list[_Collectives]) -> dict[str, float]:
    out = dict.fromkeys(TIERS, 0.0)
    for c in collectives:
        out[c.tier] += c.nbytes
    return out


def step_bytes(w: Workload, *, syncs: bool, replicate_rank: int = 0) -> dict[str, float]:
    """Bytes one rank sends in one optimizer step, per mesh tier; ``syncs`` when the step ends with a
    cross-group round. ``replicate_rank`` matters in ``leader`` mode, where only replica 0 crosses groups."""
    return _by_tier(_step_collectives(w) + (_sync_collectives(w, replicate_rank) if syncs else []))


def fed_sync_bytes(w: Workload, replicate_rank: int = 0) -> dict[str, float]:
    """Bytes one rank sends in one cross-group round, per mesh tier."""
    return _by_tier(_sync_collectives(w, replicate_rank))


def mean_step_bytes(w: Workload, replicate_rank: int = 0) -> dict[str, float]:
    """Bytes per step averaged over a sync period of ``sync_every`` steps."""
    plain, synced = step_bytes(w, syncs=False), fed_sync_bytes(w, replicate_rank)
    return {tier: plain[tier] + synced[tier] / w.sync_every for tier in TIERS}


def _sync_buckets(w: Workload, numel: float) -> list[float]:
    """Element counts of the flat buckets the averager all-reduces for ``numel`` elements (at most ``BUCKET_BYTES``
    each)."""
    per_bucket = BUCKET_BYTES // w.sync_itemsize
    full, rest = divmod(numel, per_bucket)
    return [per_bucket] * int(full) + ([rest] if rest else [])


def _fed_all_reduce_bytes(w: Workload, numel: float) -> float:
    f, compression = w.dims.num_groups, w.fed_compression
    if compression is None:
        return ring_bytes("all_reduce", numel * w.sync_itemsize, f)
    if numel < compression.min_numel:  # DynamiQ sends small tensors through a plain fp32 all-reduce
        return ring_bytes("all_reduce", numel * 4, f)
    return compressed_all_reduce_bytes(int(numel), f, compression)


def compressed_all_reduce_bytes(numel: int, group_size: int, compression: Compression) -> float:
    """Bytes one rank sends in a DynamiQ all-reduce of ``numel`` fp32 elements: the messages of its plan,
    at the rate the codec picks for that plan (at most ``bits`` per coordinate of an exact ring)."""
    codec = compression.make_codec()
    if not codec.fixed_size or codec.name == "thc":
        raise ValueError(f"The cost model has no closed form for codec {codec.name!r}; use a fixed-size codec.")
    per_rank = -(-numel // group_size)
    chunk = -(-per_rank // codec.block) * codec.block
    transfer = plan_transfer(compression.topology, group_size, chunk, numel, all_gather=True)
    codec.prepare(None, transfer, None)  # rate-adaptive codecs pick their rate from the plan alone
    return float(sum(codec.message_bytes(msg.numel, msg.summands) for msg in transfer.messages))


# ---- from mesh tiers to links --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ring:
    """Where the rings of one mesh tier run: ``members`` ranks per ring, ``per_node`` of them on each node."""

    members: int
    per_node: int

    @property
    def nodes(self) -> int:
        return self.members // self.per_node

    def crossing_fraction(self) -> float:
        """Fraction of a ring's edges that leave a node (a ring in rank order enters and leaves each node once)."""
        return 0.0 if self.nodes == 1 else self.nodes / self.members


def _rings(dims: FedShardDims, devices_per_node: int) -> dict[str, _Ring]:
    """Rank-major placement (shard innermost, as ``init_device_mesh`` lays ranks out) on nodes of
    ``devices_per_node`` consecutive ranks."""
    strides = {"shard": 1, "replicate": dims.shard_size, "fed": dims.shard_size * dims.replicate_size}
    sizes = {"shard": dims.shard_size, "replicate": dims.replicate_size, "fed": dims.num_groups}
    rings = {}
    for tier in TIERS:
        stride, members, g = strides[tier], sizes[tier], devices_per_node
        span = stride * members
        if members == 1 or stride % g == 0:
            per_node = 1
        elif g % stride == 0 and (g % span == 0 or span % g == 0):
            per_node = min(members, g // stride)
        else:
            raise ValueError(f"{tier}: groups of {members} ranks {stride} apart split nodes of {g} devices unevenly.")
        rings[tier] = _Ring(members, per_node)
    return rings


def link_bytes(w: Workload, devices_per_node: int) -> dict[str, float]:
    """Mean bytes per rank per step on each link (:data:`LINKS`): the shard and replicate tiers split by
    how many of their ring edges leave a node; the fed tier is the cross-group traffic."""
    per_tier = mean_step_bytes(w)
    rings = _rings(w.dims, devices_per_node)
    out = dict.fromkeys(LINKS, 0.0)
    for tier in ("shard", "replicate"):
        crossing = rings[tier].crossing_fraction()
        out["inter_node"] += per_tier[tier] * crossing
        out["intra_node"] += per_tier[tier] * (1 - crossing)
    out["cross_group"] = per_tier["fed"]
    return out


# ---- time ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """Compute and network of one machine type, for :func:`step_time`.

    Bandwidths are what one sender gets: ``intra_node_bandwidth`` per device, ``inter_node_bandwidth``
    per node (all its NICs together, one direction), shared by the rings that leave the node at once.

    Example::

        step_time(workload, LEONARDO)                               # the reference cluster
        step_time(workload, dataclasses.replace(LEONARDO, mfu=0.3))
    """

    name: str
    devices_per_node: int
    peak_flops: float
    """Dense FLOP/s of one device at the training precision."""
    mfu: float
    """Achieved fraction of ``peak_flops`` in the computation itself."""
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float
    """Seconds per ring hop inside a node."""
    inter_node_latency: float
    call_latency: float = 0.0
    """Seconds every collective call costs on top of its hops."""
    reduce_scatter_factor: float = 1.0
    """Wire bytes of a reduce-scatter over its ring cost: 1 for NCCL's ring, 2 for gloo (all-reduce, then slice)."""
    codec_seconds_per_coord: float = 0.0
    """DynamiQ's decompress-accumulate-recompress time per coordinate and hop."""
    overlap: bool = True
    """Whether FSDP's gathers and reductions hide behind computation (the cross-group round never does)."""
    sources: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step (the cross-group round amortised over ``sync_every`` steps)."""

    compute: float
    comm: dict[str, float]
    """Per mesh tier, all of it, hidden or not."""
    total: float
    fed_hidden: float = 0.0
    """Seconds of the cross-group round (per step) that streaming sync hides behind the next steps' compute."""

    def tokens_per_second(self, w: Workload) -> float:
        return w.dims.world_size * w.tokens_per_step / self.total


def step_time(w: Workload, cluster: Cluster) -> StepTime:
    """Predicted step time: compute from FLOPs and MFU; each collective costs its calls' and hops' latency
    plus its bytes over the slowest link of its rings; with ``overlap`` FSDP's traffic hides behind
    compute. The cross-group round (divided by ``sync_every``) blocks, except under streaming sync: each
    fragment's average is in flight during the ``fragment_sync_delay`` steps before it is applied, so up to
    that many steps' time of it is hidden and only the rest waits (DynamiQ's ring runs in the training thread
    and hides nothing)."""
    compute = w.tokens_per_step * w.flops_per_token / (cluster.peak_flops * cluster.mfu)
    rings = _rings(w.dims, cluster.devices_per_node)
    comm = dict.fromkeys(TIERS, 0.0)
    for c in _step_collectives(w):
        comm[c.tier] += _seconds(c, rings[c.tier], cluster)
    inner = sum(comm.values())
    local_step = max(compute, inner) if cluster.overlap else compute + inner
    sync = hidden = 0.0
    for share in w.fragment_shares:
        seconds = sum(_seconds(c, rings[c.tier], cluster) for c in _fragment_collectives(w, share))
        if w.fed_compression is not None and w.dims.num_groups > 1:
            f = w.dims.num_groups
            seconds += 2 * (f - 1) / f * w.sizes.local_numel * share * cluster.codec_seconds_per_coord
        else:
            hidden += min(seconds, w.fragment_sync_delay * local_step)
        sync += seconds
    comm["fed"] += sync / w.sync_every
    return StepTime(compute, comm, local_step + (sync - hidden) / w.sync_every, hidden / w.sync_every)


_HOPS_PER_MEMBER = {"all_gather": 1, "reduce_scatter": 1, "broadcast": 1, "all_reduce": 2}


def _seconds(c: _Collectives, ring: _Ring, cluster: Cluster) -> float:
    if ring.members == 1 or not c.nbytes:
        return 0.0
    widen = _widening(c, cluster)
    hops = c.calls * _HOPS_PER_MEMBER[c.kind] * (ring.members - 1) * widen
    if ring.nodes == 1:
        latency, bandwidth = cluster.intra_node_latency, cluster.intra_node_bandwidth
    else:  # every ring of this tier leaves each node through one edge: they share the node's NICs
        latency = cluster.inter_node_latency
        bandwidth = cluster.inter_node_bandwidth * ring.per_node / cluster.devices_per_node
    return c.calls * cluster.call_latency + hops * latency + widen * c.nbytes / bandwidth


def _widening(c: _Collectives, cluster: Cluster) -> float:
    return cluster.reduce_scatter_factor if c.kind == "reduce_scatter" else 1.0


def node_egress_bytes(w: Workload, cluster: Cluster) -> float:
    """Bytes one node sends to other nodes per step (cross-group round amortised), as the backend puts them on
    the wire: each ring that spans nodes leaves every node once, carrying one rank's share."""
    rings = _rings(w.dims, cluster.devices_per_node)

    def egress(c: _Collectives) -> float:
        ring = rings[c.tier]
        if ring.nodes == 1:
            return 0.0
        return _widening(c, cluster) * c.nbytes * cluster.devices_per_node / ring.per_node

    step = sum(egress(c) for c in _step_collectives(w))
    return step + sum(egress(c) for c in _sync_collectives(w)) / w.sync_every


# ---- the reference cluster and the 512-GPU report --------------------------------------------------------

#: CINECA Leonardo Booster, where the FL+FSDP paper ran Llama 3.1 8B on 128 nodes × 4 A100.
LEONARDO = Cluster(
    name="leonardo-booster",
    devices_per_node=4,
    peak_flops=312e12,
    mfu=0.5,
    intra_node_bandwidth=100e9,
    inter_node_bandwidth=45e9,
    intra_node_latency=3.4e-6,
    inter_node_latency=14e-6,
    call_latency=8.4e-6,
    sources=(
        (
            "4 × A100 SXM 64 GB per node, NVLink 3.0 at 200 GB/s, 2 × dual-port HDR100 (400 Gb/s) per node, "
            "Dragonfly+: leonardo-supercomputer.cineca.eu/hpc-system and the CINECA LEONARDO User Guide"
        ),
        "A100 dense BF16 312 TFLOP/s: NVIDIA A100 datasheet",
        (
            "MFU 0.5: PyTorch blog 'Maximizing training throughput using PyTorch FSDP' (Llama 2 7B, 128 A100, "
            "400 Gb/s: 57 % MFU); torchtitan docs/performance.md (Llama 3 8B, 64 A100, FSDP2: 57-58 %)"
        ),
        "45 GB/s per node: ~90 % of the 400 Gb/s line rate, as nccl-tests bus bandwidth reaches on HDR",
        (
            "latencies: NCCL's own tuning model (src/graph/tuning.cc, Simple protocol): 14 µs per network hop, "
            "3.4 µs per NVLink hop, 8.4 µs per call"
        ),
    ),
)

#: The paper's four layouts at 512 GPUs (``(num_groups, replicate_size, shard_size)``).
PAPER_LAYOUTS = {
    "fsdp2": FedShardDims(1, 1, 512),
    "hsdp": FedShardDims(1, 128, 4),
    "fl_fsdp": FedShardDims(128, 1, 4),
    "fl_hsdp": FedShardDims(16, 8, 4),
}
#: Each FL variant against the baseline it augments.
COUNTERPARTS = {"fl_fsdp": "fsdp2", "fl_hsdp": "hsdp"}
REFERENCE_SPEEDUP = 8.04


#: Wire dtypes (bytes per element: gradient reductions, cross-group average): this package's strategies reduce
#: and average in fp32 under ``bf16-mixed``; the paper's xFFL code does both in bf16.
WIRE_DTYPES = {"fedshard": (4, 4), "xffl": (2, 2)}


def paper_workload(
    dims: FedShardDims, *, sync_every: int = 8, fed_bits: float | None = None, wire: str = "fedshard"
) -> Workload:
    """Llama 3.1 8B as the paper trains it: micro-batch 2 × 2048 tokens per GPU, bf16, FedAvg every 8 steps."""
    reduce_itemsize, sync_itemsize = WIRE_DTYPES[wire]
    return Workload.for_llama(
        LlamaConfig.from_name("llama3.1-8b"),
        dims,
        seq_len=2048,
        micro_batch=2,
        sync_every=sync_every,
        reduce_itemsize=reduce_itemsize,
        sync_itemsize=sync_itemsize,
        fed_compression=Compression(bits=fed_bits) if fed_bits is not None else None,
    )


def speedups(
    cluster: Cluster, *, sync_every: int = 8, fed_bits: float | None = None, wire: str = "fedshard"
) -> dict[str, float]:
    """Tokens/s of each FL variant over its counterpart on ``cluster``."""
    times = {
        name: step_time(paper_workload(dims, sync_every=sync_every, fed_bits=fed_bits, wire=wire), cluster).total
        for name, dims in PAPER_LAYOUTS.items()
    }
    return {fl: times[base] / times[fl] for fl, base in COUNTERPARTS.items()}


def implied_bandwidth(cluster: Cluster, target: float = REFERENCE_SPEEDUP, wire: str = "xffl") -> float | None:
    """The per-node inter-node bandwidth at or below which the larger speed-up reaches ``target``, or None when
    no bandwidth does (the speed-up grows as bandwidth falls, towards the ratio of bytes each NIC carries)."""

    def best(bandwidth: float) -> float:
        return max(speedups(dataclasses.replace(cluster, inter_node_bandwidth=bandwidth), wire=wire).values())

    low, high = 1e6, cluster.inter_node_bandwidth
    if best(high) >= target:
        return high
    if best(low) < target:
        return None
    for _ in range(60):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if best(mid) >= target else (low, mid)
    return low


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:9.3f}"


def report(cluster: Cluster, sync_every: int = 8, fed_bits: float = 5.0) -> str:
    lines = [
        (
            f"Llama 3.1 8B, 512 GPUs on {cluster.name} ({cluster.devices_per_node} per node), micro-batch 2 × 2048 tokens,"
            f" bf16, sync every {sync_every} steps; MFU {cluster.mfu:.2f}, inter-node"
            f" {cluster.inter_node_bandwidth / 1e9:.0f} GB/s per node, overlap {'on' if cluster.overlap else 'off'}"
        ),
        "GB per rank per step on each link (cross-group amortised over the sync interval)",
        (
            f"{'strategy':<16} {'F×R×S':<10} {'intra-node':>9} {'inter-node':>9} {'cross-grp':>9}"
            f" {'step s':>7} {'tokens/s':>10} {'vs fsdp2':>8} {'vs hsdp':>8}"
        ),
    ]
    rows = [(name, dims, None) for name, dims in PAPER_LAYOUTS.items()]
    rows += [(f"{name}+dynamiq{fed_bits:g}", PAPER_LAYOUTS[name], fed_bits) for name in COUNTERPARTS]
    results = []
    for name, dims, bits in rows:
        w = paper_workload(dims, sync_every=sync_every, fed_bits=bits)
        t = step_time(w, cluster)
        results.append((name, dims, t, t.tokens_per_second(w), link_bytes(w, cluster.devices_per_node)))
    tokens = {name: rate for name, _, _, rate, _ in results}
    for name, dims, t, rate, links in results:
        layout = f"{dims.num_groups}×{dims.replicate_size}×{dims.shard_size}"
        lines.append(
            f"{name:<16} {layout:<10} {_gb(links['intra_node'])} {_gb(links['inter_node'])} {_gb(links['cross_group'])}"
            f" {t.total:7.3f} {rate:10.0f} {rate / tokens['fsdp2']:7.2f}× {rate / tokens['hsdp']:7.2f}×"
        )
    lines += ["", f"reference (FL+FSDP paper, 512 A100): up to {REFERENCE_SPEEDUP}× faster data processing"]
    for wire in WIRE_DTYPES:
        bandwidth = implied_bandwidth(cluster, wire=wire)
        bound = max(speedups(dataclasses.replace(cluster, inter_node_bandwidth=1e6), wire=wire).values())
        reached = (
            f"reached once the baselines see ≤ {bandwidth / 1e9:.2f} GB/s per node between nodes"
            f" ({bandwidth / cluster.inter_node_bandwidth:.1%} of the {cluster.inter_node_bandwidth / 1e9:.0f} GB/s assumed)"
            if bandwidth is not None
            else "not reached at any bandwidth"
        )
        lines.append(f"  {wire} wire dtypes: {reached}; the bandwidth-bound limit is {bound:.2f}×")
    return "\n".join(lines)


def sweep_report(cluster: Cluster) -> str:
    """How the speed-ups grow with the number of groups (512 GPUs, 4-way shards) and the sync interval."""
    lines = ["speed-up over the counterpart, 512 GPUs, sync every 8 steps, by number of groups F:"]
    lines.append(f"{'F':>5} {'fl_fsdp F×1×(512/F)':>20} {'fl_hsdp F×(128/F)×4':>20}")
    for f in (1, 2, 4, 8, 16, 32, 64, 128):
        fsdp = _speedup(cluster, FedShardDims(f, 1, 512 // f), PAPER_LAYOUTS["fsdp2"], 8)
        hsdp = _speedup(cluster, FedShardDims(f, 128 // f, 4), PAPER_LAYOUTS["hsdp"], 8) if f < 128 else math.nan
        lines.append(f"{f:>5} {fsdp:>19.2f}× {hsdp:>19.2f}×")
    lines += ["", "by sync interval H (fl_fsdp 128×1×4, fl_hsdp 16×8×4):"]
    lines.append(f"{'H':>5} {'fl_fsdp':>10} {'fl_hsdp':>10}")
    for h in (1, 2, 4, 8, 16, 32, 64):
        s = speedups(cluster, sync_every=h)
        lines.append(f"{h:>5} {s['fl_fsdp']:>9.2f}× {s['fl_hsdp']:>9.2f}×")
    return "\n".join(lines)


def _speedup(cluster: Cluster, fl: FedShardDims, base: FedShardDims, sync_every: int) -> float:
    fl_time = step_time(paper_workload(fl, sync_every=sync_every), cluster).total
    return step_time(paper_workload(base, sync_every=sync_every), cluster).total / fl_time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedshard bench costmodel", description=__doc__.splitlines()[0])
    parser.add_argument("--mfu", type=float, default=LEONARDO.mfu)
    parser.add_argument("--inter-node-gbytes", type=float, default=LEONARDO.inter_node_bandwidth / 1e9,
                        help="GB/s one node sends to others (all NICs)")  # fmt: skip
    parser.add_argument("--no-overlap", action="store_true", help="FSDP traffic does not hide behind compute")
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--fed-bits", type=float, default=5.0, help="DynamiQ bits per coordinate across groups")
    args = parser.parse_args(argv)
    if not 0 < args.mfu <= 1 or args.inter_node_gbytes <= 0 or args.sync_every < 1:
        parser.error("--mfu must lie in (0, 1], --inter-node-gbytes be positive and --sync-every ≥ 1")
    cluster = dataclasses.replace(
        LEONARDO, mfu=args.mfu, inter_node_bandwidth=args.inter_node_gbytes * 1e9, overlap=not args.no_overlap
    )
    print(report(cluster, args.sync_every, args.fed_bits))
    print()
    print(sweep_report(cluster))
    print("\nsources:\n" + "\n".join(f"  - {s}" for s in cluster.sources))


if __name__ == "__main__":
    main()
