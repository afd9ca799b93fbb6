"""Which files of a model folder the loader may open: regular files inside the folder.

A Hugging Face folder names its own files: ``model.safetensors.index.json``
maps tensors to shard file names, and any file may be a symlink (a git clone
keeps them). Followed blindly, a name like ``../../.ssh/id_rsa``, an absolute
path or a symlink could make the loader read any file on the machine, and a
FIFO or ``/dev/zero`` would block or never end. So every file is checked
before it is opened:

- a name is relative, with no ``..`` part;
- after following symlinks it is a regular file inside the folder, or, for a
  snapshot in the Hugging Face cache (``models--org--name/snapshots/<rev>/``,
  whose files are symlinks to ``../../blobs/<hash>``), inside that repo's
  ``blobs`` folder.
"""

from __future__ import annotations

from pathlib import Path, PurePath

from kvserve.errors import ModelLoadError


def checked_folder_file(folder: Path, name: str, named_by: str) -> Path:
    """``folder / name`` after the checks above; ModelLoadError naming ``name`` otherwise.

    named_by: where the name came from (a file name, or ``"the folder"``), for messages.
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise ModelLoadError(
            f"{named_by} names a file {name!r}, which is not a file name", field=name
        )
    relative = PurePath(name)
    if relative.is_absolute() or relative.anchor or ".." in relative.parts:
        raise ModelLoadError(
            f"{named_by} names {name!r}, which is outside the model folder {folder}", field=name
        )
    path = folder / relative
    try:
        resolved = path.resolve()
        is_regular = resolved.is_file()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise ModelLoadError(f"cannot read {path}: {exc}", field=name) from exc
    if not any(resolved.is_relative_to(root) for root in _allowed_roots(folder)):
        raise ModelLoadError(
            f"{named_by} names {name!r}, a link to {resolved}, outside the model folder {folder}",
            field=name,
        )
    if not is_regular:
        what = "missing" if not resolved.exists() else "not a regular file"
        raise ModelLoadError(f"{named_by} names {name!r}, which is {what}", field=name)
    return path


def _allowed_roots(folder: Path) -> list[Path]:
    root = folder.resolve()
    roots = [root]
    snapshots = root.parent
    if snapshots.name == "snapshots" and (snapshots.parent / "blobs").is_dir():
        roots.append((snapshots.parent / "blobs").resolve())
    return roots
