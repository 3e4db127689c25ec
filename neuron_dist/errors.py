"""The package's communication error: a torch DistBackendError, so callers catch it as they
would NCCL's or Gloo's."""
import torch.distributed as dist


class GroupError(dist.DistBackendError):
    """A collective failed: names the rank, the collective, its sequence number and the cause."""
