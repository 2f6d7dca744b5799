"""snack's modules where torch users look for them: ``snack.nn.SparseLinear``, ``snack.nn.SparseConv2d``
(the same classes as ``snack.SparseLinear`` and ``snack.SparseConv2d``), ``snack.nn.SparseAttention``,
and ``snack.nn.functional.sparse_attention``."""

from ..attention import SparseAttention
from ..conv import SparseConv2d
from ..layer import SparseLinear
from . import functional

__all__ = ["SparseLinear", "SparseConv2d", "SparseAttention", "functional"]
