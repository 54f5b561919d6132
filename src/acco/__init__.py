"""acco: communication-overlapped, optimizer-sharded data-parallel training.

ACCO ("Accumulate While You Communicate", Nabli et al., NeurIPS 2025,
arXiv 2406.02613) as a drop-in ``torch.optim`` optimizer.
"""

from . import checkpoint  # acco.checkpoint after a plain `import acco`
from . import errors
from .ddp import disable_gradient_allreduce
from .errors import *  # noqa: F401,F403  every public exception: the names errors.__all__ lists
from .launch import init_process_group
from .optimizer import AccoOptimizer
from .policies import DelayPolicy, HandoffPolicy, OuterPolicy, PrecisionPolicy, RobustnessPolicy
from .scheduler import StreamScheduler

__all__ = ["AccoOptimizer", "DelayPolicy", "HandoffPolicy", "OuterPolicy", "PrecisionPolicy", "RobustnessPolicy", "StreamScheduler", "disable_gradient_allreduce", "init_process_group", *errors.__all__]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``acco.integrations`` on first use, so that ``import acco`` alone reaches it (its modules import their
    frameworks only when used)."""
    if name == "integrations":
        import importlib

        return importlib.import_module(".integrations", __name__)
    raise AttributeError(f"module 'acco' has no attribute {name!r}")
