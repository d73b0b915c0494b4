"""Verification in a Lightning predict loop: :class:`VerificationModule` verifies one VNN-COMP instance per predict
batch, sharded over the ``tensor_parallel`` dim of ``ModelParallelStrategy``'s mesh, and :class:`VnncompInstances`
deals the instances of an ``instances.csv`` over its ``data_parallel`` dim; :func:`run_predict` puts them together.

Example (a script: on CPU the other ranks re-run it)::

    from lightning_fedshard.verify import VerifyConfig, read_instances
    from lightning_fedshard.verify.lightning import run_predict

    results = run_predict(read_instances("instances.csv"), VerifyConfig(timeout=60), "fsdp", devices=2)
    if results is not None:  # global rank 0
        for r in results:
            print(r.vnnlib, r.verdict.value, [p.peak_memory_bytes for p in r.per_rank])
"""

from lightning_fedshard.verify.lightning.data import (
    InstanceDataset,
    InstanceSampler,
    VnncompInstances,
    as_instance,
)
from lightning_fedshard.verify.lightning.module import (
    VerificationModule,
    merge_rank_outputs,
    predict_layout,
    run_predict,
)

__all__ = [
    "InstanceDataset",
    "InstanceSampler",
    "VerificationModule",
    "VnncompInstances",
    "as_instance",
    "merge_rank_outputs",
    "predict_layout",
    "run_predict",
]
