"""snack's functional forms: ``sparse_attention`` (``snack.attention``) and ``sparse_linear``."""

from ..attention import dilated_pattern, local_pattern, sparse_attention, strided_pattern
from ..layer import sparse_linear

__all__ = ["sparse_attention", "sparse_linear", "local_pattern", "strided_pattern", "dilated_pattern"]
