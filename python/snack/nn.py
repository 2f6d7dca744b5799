"""snack's layers where torch users look for them: ``snack.nn.SparseLinear``, ``snack.nn.SparseConv2d``
(the same classes as ``snack.SparseLinear`` and ``snack.SparseConv2d``)."""

from .conv import SparseConv2d
from .layer import SparseLinear

__all__ = ["SparseLinear", "SparseConv2d"]
