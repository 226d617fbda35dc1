"""Where things live: strategies, meshes, placement rules and spec trees (pure: nothing runs).

The bottom layer of parallax. Imports flow one way: ``sharding`` → ``models`` → ``step`` →
``train``; nothing here imports a model library's module API or a layer above.
"""

from parallax.sharding.parts import FSDP, DataParallel, TensorParallel
from parallax.sharding.strategy import Combined, Strategy, combine

__all__ = ["FSDP", "Combined", "DataParallel", "Strategy", "TensorParallel", "combine"]
