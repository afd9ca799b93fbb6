"""What travels with the device call besides the repository, prepared on this machine.

The device machine's image (see docs/cuda.md) has Python 3.12, PyTorch,
transformers, tokenizers, safetensors, pytest and more, and no network. Of
kvserve's dependencies it lacks those in :data:`WHEELS` (the server's
fastapi stack, llguidance, gguf): ``make gpu-wheels`` downloads them as
manylinux wheels for Python 3.12, pinned to the versions installed here,
into ``.gpu-check/wheels``; the check installs them with ``pip --no-index``.
typing-extensions travels too because pydantic needs a recent one; the
check installs a carried wheel only where the image's own copy is missing
or older.

The random-weight models use SmolLM2's tokenizer, which kvserve builds from
the shipped GGUF's metadata; ``tokenizer DIR`` saves it as tokenizer files
(about 3.5 MB). ``size`` adds up what the call sends: the files git tracks or
would track, and the carried folders; the device tool refuses more than 64 MiB.

    python -m kvserve.benchmarks.gpu_check.prepare pins         # NAME==VERSION ...
    python -m kvserve.benchmarks.gpu_check.prepare tokenizer .gpu-check/tokenizer
    python -m kvserve.benchmarks.gpu_check.prepare size .gpu-check
    python -m kvserve.benchmarks.gpu_check.prepare needed .gpu-check/wheels  # on the device
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

# kvserve's dependencies missing from the device image, and what they need that it lacks.
WHEELS = (
    "fastapi",
    "starlette",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "opentelemetry-api",
    "uvicorn",
    "llguidance",
    "gguf",
)
# The modules the check imports that the image or the wheels must provide.
REQUIRED_MODULES = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
    "numpy",
    "jinja2",
    "psutil",
    "httpx",
    "prometheus_client",
    "matplotlib",
    "fastapi",
    "uvicorn",
    "pydantic",
    "llguidance",
    "gguf",
    "pytest",
    "pytest_timeout",
)
LIMIT_BYTES = 64 * 1024**2


def pins(names: tuple[str, ...] = WHEELS) -> list[str]:
    """``NAME==VERSION`` of each distribution as installed here."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in names]


def needed_wheels(folder: Path) -> list[Path]:
    """The wheels in ``folder`` whose distribution is missing here or older than the wheel."""
    from packaging.version import Version

    needed = []
    for wheel in sorted(folder.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        try:
            have = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            needed.append(wheel)
            continue
        if have < Version(version):
            needed.append(wheel)
    return needed


def export_tokenizer(folder: Path) -> list[str]:
    """Save SmolLM2's tokenizer (from the shipped GGUF) as tokenizer files in ``folder``.

    The class is written as ``PreTrainedTokenizerFast``, which every transformers
    version loads (the device's may be older than this machine's).
    """
    from kvserve.loader import resolve_model
    from kvserve.loader.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only", "backend"):
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return sorted(path.name for path in folder.iterdir())


def travel_size(repo: Path, carried: list[Path]) -> dict[str, int]:
    """Bytes the device call sends: git's files (tracked, and untracked but not ignored)
    and each carried folder."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout.decode()
    files = [repo / name for name in listing.split("\0") if name]
    sizes = {"repository": sum(path.stat().st_size for path in files if path.is_file())}
    for folder in carried:
        paths = folder.rglob("*") if folder.is_dir() else [folder]
        sizes[str(folder)] = sum(p.stat().st_size for p in paths if p.is_file())
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.benchmarks.gpu_check.prepare")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("pins", help="print NAME==VERSION of the wheels the device lacks")
    tokenizer = commands.add_parser("tokenizer", help="save SmolLM2's tokenizer files in DIR")
    tokenizer.add_argument("folder", type=Path)
    size = commands.add_parser("size", help="what the device call would send, against 64 MiB")
    size.add_argument("carried", type=Path, nargs="*")
    needed = commands.add_parser("needed", help="the wheels in DIR this Python lacks or has older")
    needed.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.command == "pins":
        print(" ".join(pins()))
    elif args.command == "needed":
        for wheel in needed_wheels(args.folder):
            print(wheel)
    elif args.command == "tokenizer":
        print(f"{args.folder}: {', '.join(export_tokenizer(args.folder))}")
    else:
        sizes = travel_size(Path.cwd(), args.carried)
        total = sum(sizes.values())
        for name, count in sizes.items():
            print(f"{name}: {count / 2**20:.1f} MiB")
        print(f"total: {total / 2**20:.1f} MiB of the device tool's {LIMIT_BYTES // 2**20} MiB")
        if total > LIMIT_BYTES:
            print("error: too large to travel", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
