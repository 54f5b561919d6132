"""acco: communication-overlapped, optimizer-sharded data-parallel training.

ACCO ("Accumulate While You Communicate", Nabli et al., NeurIPS 2025,
arXiv 2406.02613) as a drop-in ``torch.optim`` optimizer.
"""

from .optimizer import AccoOptimizer
from .scheduler import StreamScheduler

__all__ = ["AccoOptimizer", "StreamScheduler"]
__version__ = "0.1.0"
