"""``EngineConfig``: the config groups together, and building them from flat engine arguments.

Each group (model, cache, scheduler, parallel, KV events) is a frozen
dataclass in its own module, validated on construction. Values that depend
on the loaded model or on the machine (the model's context length, the number
of KV blocks that fit the budget, the dtype ``auto`` picks) are computed by
functions and returned, never written back into a config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvserve.config.cache import CacheConfig
from kvserve.config.checks import require
from kvserve.config.kv_events import KVEventsConfig
from kvserve.config.model import ModelConfig
from kvserve.config.parallel import ParallelConfig
from kvserve.config.scheduler import SchedulerConfig
from kvserve.config.speculative import SpeculativeConfig
from kvserve.errors import InvalidParameterError

ENGINE_CONFIG_GROUPS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, KVEventsConfig)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, grouped.

    speculative_config: speculative decoding (``config/speculative.py``); None: off.
    """

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        # The checks that span groups; each group has checked its own fields already.
        quantization = self.model_config.quantization
        tp_size = self.parallel_config.tensor_parallel_size
        require(
            tp_size == 1 or quantization in ("auto", "none"),
            "quantization",
            f"{quantization!r} cannot split quantized weights over ranks; with "
            f"tensor_parallel_size={tp_size} it must be one of ('auto', 'none')",
        )
        require(
            tp_size == 1 or self.cache_config.prefix_cache_dir is None,
            "prefix_cache_dir",
            f"the disk tier keeps whole blocks of one process's pool; with "
            f"tensor_parallel_size={tp_size} leave it unset",
        )

    @classmethod
    def from_kwargs(cls, model: str, **engine_args: Any) -> EngineConfig:
        """Build from flat keyword arguments named like the config fields (vLLM style).

        ``EngineConfig.from_kwargs("smollm2-135m-instruct", block_size=32, dtype="float32")``.
        An unknown name raises, naming it.
        """
        groups: dict[type, dict[str, Any]] = {ModelConfig: {"model": model}}
        owners = {
            f.name: group for group in ENGINE_CONFIG_GROUPS for f in dataclasses.fields(group)
        }
        speculative = SpeculativeConfig.from_value(engine_args.pop("speculative_config", None))
        for name, value in engine_args.items():
            owner = owners.get(name)
            if owner is None or name == "model":
                allowed = ", ".join(sorted(n for n in owners if n != "model"))
                raise InvalidParameterError(
                    name, f"is not an engine argument; known: {allowed}, speculative_config"
                )
            groups.setdefault(owner, {})[name] = value
        return cls(
            model_config=ModelConfig(**groups[ModelConfig]),
            cache_config=CacheConfig(**groups.get(CacheConfig, {})),
            scheduler_config=SchedulerConfig(**groups.get(SchedulerConfig, {})),
            parallel_config=ParallelConfig(**groups.get(ParallelConfig, {})),
            kv_events_config=KVEventsConfig(**groups.get(KVEventsConfig, {})),
            speculative_config=speculative,
        )
