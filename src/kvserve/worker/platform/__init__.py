"""One plan per device: every decision of the model runner that depends on the device."""

from __future__ import annotations

from kvserve.config import EngineConfig
from kvserve.config.checks import require
from kvserve.distributed.group import TensorParallelGroup
from kvserve.worker.device import resolve_device
from kvserve.worker.platform.cpu import CpuPlan
from kvserve.worker.platform.cuda import CudaPlan
from kvserve.worker.platform.plan import DecodeFastPath, DevicePlan, FastPathInputs, Precision

__all__ = ["DecodeFastPath", "DevicePlan", "FastPathInputs", "Precision", "device_plan"]


def device_plan(config: EngineConfig, tp: TensorParallelGroup) -> DevicePlan:
    """The plan of the configured device (``auto``: CUDA when there is one)."""
    device = resolve_device(config.model_config.device)
    if device.type == "cuda":
        # ModelConfig refuses an explicit device='cuda'; this is 'auto' finding a GPU.
        quantization = config.model_config.quantization
        require(
            quantization in ("auto", "none"),
            "quantization",
            f"{quantization!r} quantizes weights for kvserve's CPU kernels, but the device "
            "is CUDA; use device='cpu' or one of ('auto', 'none')",
        )
        return CudaPlan(device, config, tp)
    return CpuPlan(config, tp)
