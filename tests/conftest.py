"""Settings every test starts from."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest

from model_fixtures import save_tiny_model, train_tiny_tokenizer


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the local Ray cluster run last, after every other test.

    ``ray_session`` is session-scoped and starts on first use, so this way no
    other test shares its process with a Ray driver: its threads and daemons
    (GCS, raylet, workers) live only while the Ray tests run.
    """
    items.sort(key=lambda item: "ray_session" in getattr(item, "fixturenames", ()))


@pytest.fixture(autouse=True, scope="session")
def _run_private_converted_model_cache(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """Converted GGUF models are kept in a folder of this run's own, not the user's cache.

    Each run converts each file once, on its first load (the path a new user's
    first start takes), and every later load reads that entry (the path every
    other start takes): converting SmolLM2 costs about 10 s, reading it 2 s.
    Session-scoped so that module-scoped engines and the servers the tests
    start are covered too; the tests of the cache itself use their own folders.
    """
    folder = tmp_path_factory.mktemp("converted-models")
    folder.chmod(0o700)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_WEIGHT_CACHE", "1")
        patch.setenv("KVSERVE_WEIGHT_CACHE_DIR", str(folder))
        yield


@pytest.fixture(autouse=True, scope="session")
def _compiled_kernel_defaults() -> Iterator[None]:
    """The quantized kernels keep their compiled many-row threshold: measured at load (as
    users' engines do), it would make which path a test runs depend on a timing. The
    tuning's own tests turn it back on."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_KERNEL_TUNING", "0")
        yield


@pytest.fixture(autouse=True, scope="session")
def _hugging_face_hub_offline() -> Iterator[None]:
    """No test downloads: hub ids resolve from a cache folder the test builds, or fail.

    huggingface_hub reads HF_HUB_OFFLINE when it is imported, so the setting it
    already holds is patched too; the variable covers child processes.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with its tokenizer, shared by the server tests."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", train_tiny_tokenizer())


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray cluster for the whole run: Ray allows one per process, and
    tests/ray and tests/batch both need it. Loopback only, no dashboard."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'kvserve[ray]')")
    import faulthandler
    import sys

    import kvserve

    src = str(Path(kvserve.__file__).resolve().parents[1])
    # Logical CPUs, not cores: the app's two replicas and a batch job's two actors
    # each reserve one, plus room for Serve's and Ray Data's own tasks.
    ray.init(
        num_cpus=6,
        include_dashboard=False,
        object_store_memory=100 * 1024**2,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": src, "KVSERVE_WEIGHT_CACHE": "0"}},
    )
    try:
        yield
    finally:
        # A stuck shutdown must not hold the run: give up after a minute.
        faulthandler.dump_traceback_later(60, exit=True, file=sys.__stderr__)
        ray.shutdown()
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap() -> None:
    """What is alive when a test module starts (imported modules, session fixtures) is
    moved out of the garbage collector's reach.

    Every engine build runs a full collection (``kernels/heap.py``, so that loading's
    temporaries leave the heap); in a test process holding torch, transformers and
    every test module that walk took a quarter of a second or more per engine, and the
    suite builds hundreds of engines. Frozen objects are still freed when their last
    reference goes; only a reference cycle among them would outlive its module.
    """
    gc.collect()
    gc.freeze()
