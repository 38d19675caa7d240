"""What a data-parallel rank's model wrappers share: :class:`ModelWrapper` (this package's own wrappers),
:func:`unwrap` (the user's model inside ``torch.compile``, DDP, DataParallel and them) and DDP's unused-parameter
error with the option that fixes it. The rank's step runner (``parallel/steps.py``) composes a strategy's two
steps, placement (``parallel/placement.py``) and replication (``parallel/replication.py``), itself.
"""

from __future__ import annotations

import re
from typing import Optional

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

__all__ = ["ModelWrapper", "unwrap", "explain_ddp_error"]


class ModelWrapper(nn.Module):
    """Marker base of this package's own wrappers (``unwrap`` peels them like DDP)."""

    module: nn.Module


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside ``torch.compile``, DDP, DataParallel and our own wrappers."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    while isinstance(model, (DistributedDataParallel, DataParallel, ModelWrapper)):
        model = model.module
    return model


_DDP_UNUSED = "Expected to have finished reduction in the prior iteration"


def explain_ddp_error(exc: RuntimeError, model: nn.Module) -> Optional[RuntimeError]:
    """DDP's unused-parameter error with the TrainConfig option that fixes it; None for any other error.

    DDP raises it in the forward *after* a step in which some parameters got no gradient;
    torch lists their indices, which we translate into names. (A function the forward's ``except``
    calls, not a context manager around every forward: entering one costs a few us a micro-batch.)
    """
    if _DDP_UNUSED not in str(exc):
        return None
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", str(exc))
    unused = [names[int(i)] for i in found.group(1).split() if int(i) < len(names)] if found else []
    which = f" Parameters that got no gradient: {', '.join(unused)}." if unused else ""
    return RuntimeError(
        f"DDP: some parameters were not used in producing the loss, so their gradients were never "
        f"all-reduced.{which} Set TrainConfig.find_unused_parameters=True (costs one autograd-graph "
        f"walk per step), or static_graph=True if the same parameters are unused in every step; "
        f"or make every output of forward() take part in the loss. (torch: {exc})")
