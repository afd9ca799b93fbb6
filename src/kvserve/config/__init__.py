"""Engine configuration: frozen dataclasses, validated on construction.

``EngineConfig`` groups one dataclass per concern, each in its own module:
``ModelConfig`` (``model.py``), ``CacheConfig`` (``cache.py``),
``SchedulerConfig`` (``scheduler.py``), ``ParallelConfig`` (``parallel.py``),
``KVEventsConfig`` (``kv_events.py``), ``SpeculativeConfig``
(``speculative.py``, optional); ``engine.py`` builds them from flat
engine arguments, ``dtype.py`` resolves the precision ``auto`` picks and
``checks.py`` holds the checks they share. The config classes are importable
from here.
"""

from __future__ import annotations

from kvserve.config.cache import CacheConfig
from kvserve.config.engine import EngineConfig
from kvserve.config.kv_events import KVEventsConfig
from kvserve.config.model import ModelConfig
from kvserve.config.parallel import ParallelConfig
from kvserve.config.scheduler import SchedulerConfig
from kvserve.config.speculative import SpeculativeConfig

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "KVEventsConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
]
