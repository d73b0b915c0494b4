"""Process-group plumbing shared by the training strategies and the sharded verifier: one timeout for every group,
ranks that end together after a failure, restarts under torchrun checked, and a clean gloo shutdown."""

from lightning_fedshard.distributed.elastic import SHARE_STORE_SWITCH, check_elastic_restarts
from lightning_fedshard.distributed.gloo_exit import destroy_process_group_at_exit
from lightning_fedshard.distributed.job_end import SIGTERM_EXIT_CODE, JobEnd, JobEndHooks
from lightning_fedshard.distributed.model_parallel import TimedModelParallelStrategy
from lightning_fedshard.distributed.timeouts import check_timeout, init_device_mesh_with_timeout

__all__ = [
    "SHARE_STORE_SWITCH",
    "SIGTERM_EXIT_CODE",
    "JobEnd",
    "JobEndHooks",
    "TimedModelParallelStrategy",
    "check_elastic_restarts",
    "check_timeout",
    "destroy_process_group_at_exit",
    "init_device_mesh_with_timeout",
]
