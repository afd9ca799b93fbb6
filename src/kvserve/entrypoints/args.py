"""Command-line flags generated from kvserve's dataclasses.

Engine flags come from the fields of the engine's config groups
(``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``, ``ParallelConfig``, ``KVEventsConfig``); sampling flags from ``SamplingParams``. A field named
``max_num_seqs`` becomes ``--max-num-seqs``, its type decides how the value
is parsed, and its entry in the class docstring becomes the help text, so a
new config field shows up on every command without touching this module.

Values are validated by the dataclasses themselves (an
:class:`~kvserve.errors.InvalidParameterError` naming the field), not here.
``--chat-template``, which every command that renders conversations takes,
lives here too, and so do the configs that ``kvserve serve``'s flags describe
(:func:`engine_config_from_args`, :func:`server_config_from_args`), which the
single-process server and Ray Serve's (``serve/ray/cli.py``) both build.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from kvserve.config.engine import ENGINE_CONFIG_GROUPS, EngineConfig
from kvserve.entrypoints.openai.server_config import ServerConfig
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams

# Without --api-key, the server's key comes from this environment variable.
API_KEY_ENV = "KVSERVE_API_KEY"
# Namespace attributes that remember which flags belong to which dataclass.
_ENGINE_FIELDS = "_engine_fields"
_SAMPLING_FIELDS = "_sampling_fields"

# "name: text" or "name_a, name_b: text" at the start of a docstring line.
_DOC_ENTRY = re.compile(r"^(\w+(?:, \w+)*): (.*)$")
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}
_BYTE_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def field_docs(cls: type) -> dict[str, str]:
    """Per-field help text from a class docstring's ``name: description`` entries."""
    docs: dict[str, str] = {}
    names: list[str] = []
    for line in (inspect.getdoc(cls) or "").splitlines():
        match = _DOC_ENTRY.match(line)
        if match:
            names = match.group(1).split(", ")
            for name in names:
                docs[name] = match.group(2)
        elif line.startswith(" ") and names:
            for name in names:
                docs[name] += " " + line.strip()
        else:
            names = []
    return {name: text.replace("``", "") for name, text in docs.items()}


def parse_byte_size(text: str) -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1000000"`` → bytes."""
    match = _BYTE_SIZE.match(text.lower())
    if match is None or match.group(2) not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB or 512MiB, got {text!r}")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2)])


def _unwrap_optional(annotation: Any) -> Any:
    """``int | None`` → ``int``; ``str | list[str] | None`` → ``list[str]`` (lists win)."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return annotation
    members = [a for a in typing.get_args(annotation) if a is not type(None)]
    lists = [a for a in members if typing.get_origin(a) is list]
    return lists[0] if lists else members[0]


def _add_field_flag(
    group: argparse._ArgumentGroup, field: dataclasses.Field[Any], annotation: Any, help_text: str
) -> None:
    flag = "--" + field.name.replace("_", "-")
    help_text = help_text.replace("%", "%%")
    default = field.default if field.default is not dataclasses.MISSING else None
    kind = _unwrap_optional(annotation)
    if kind is bool:
        if field.default is None:
            # A feature decided automatically (None) can be forced either way.
            stem = field.name.removeprefix("enable_").replace("_", "-")
            group.add_argument(
                flag,
                dest=field.name,
                action="store_const",
                const=True,
                default=None,
                help=help_text,
            )
            group.add_argument(
                f"--no-{stem}",
                dest=field.name,
                action="store_const",
                const=False,
                help=f"turn off {field.name}",
            )
        elif default:
            # A feature on by default gets an off switch: enable_x -> --no-x.
            stem = field.name.removeprefix("enable_").replace("_", "-")
            group.add_argument(
                f"--no-{stem}",
                dest=field.name,
                action="store_false",
                help=f"turn off {field.name} (on by default): {help_text}",
            )
        else:
            group.add_argument(flag, dest=field.name, action="store_true", help=help_text)
        return
    if typing.get_origin(kind) is typing.Literal:
        choices = typing.get_args(kind)
        group.add_argument(
            flag,
            dest=field.name,
            choices=choices,
            default=default,
            help=help_text + " (default: %(default)s)",
        )
        return
    # %(default)s is filled in when help is shown, so set_defaults overrides show up.
    shown_default = "" if default is None else " (default: %(default)s)"
    if typing.get_origin(kind) is list:
        (item_type,) = typing.get_args(kind)
        group.add_argument(
            flag,
            dest=field.name,
            type=item_type,
            action="append",
            help=f"{help_text} Repeat the flag for several.",
        )
        return
    parse: Callable[[str], Any] = kind
    if field.name.endswith("_bytes"):
        parse = parse_byte_size
        help_text += " Units are accepted: 2GiB, 512MiB, 1GB."
    group.add_argument(
        flag,
        dest=field.name,
        type=parse,
        default=default,
        metavar=field.name.upper(),
        help=help_text + shown_default,
    )


def add_dataclass_flags(
    group: argparse._ArgumentGroup, cls: type, exclude: Collection[str] = ()
) -> list[str]:
    """One flag per init field of dataclass ``cls``; returns the field names added."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    added = []
    for field in dataclasses.fields(cls):
        if not field.init or field.name in exclude:
            continue
        _add_field_flag(group, field, hints[field.name], docs.get(field.name, ""))
        added.append(field.name)
    return added


def add_engine_args(parser: argparse.ArgumentParser, exclude: Collection[str] = ()) -> None:
    """``--model`` and one flag per engine config field (except those in ``exclude``)."""
    group = parser.add_argument_group("engine")
    names: list[str] = []
    for cls in ENGINE_CONFIG_GROUPS:
        names += add_dataclass_flags(group, cls, exclude)
    if "speculative_config" not in exclude:
        # One JSON object rather than a flag per field: vLLM's shape, checked by the config.
        group.add_argument(
            "--speculative-config",
            dest="speculative_config",
            metavar="JSON",
            help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
            '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (prompt lookup) or '
            '\'{"method": "suffix", "num_speculative_tokens": 5}\' (the request\'s context '
            'and recent outputs) or \'{"method": "draft_model", "model": "DRAFT", '
            '"num_speculative_tokens": 4}\' (a smaller model with the same tokenizer); '
            "unset: off",
        )
        names.append("speculative_config")
    parser.set_defaults(**{_ENGINE_FIELDS: tuple(names)})


def engine_kwargs(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The model and the engine keyword arguments (``EngineConfig.from_kwargs``) of ``args``."""
    names: tuple[str, ...] = getattr(args, _ENGINE_FIELDS)
    kwargs = {name: getattr(args, name) for name in names if name != "model"}
    return args.model, kwargs


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine flags in ``args`` describe."""
    model, engine_args = engine_kwargs(args)
    return EngineConfig.from_kwargs(model, **engine_args)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of ``kvserve serve``'s server flags (``cli_serve.py`` adds them);
    without --api-key, the key is $KVSERVE_API_KEY."""
    env_key = os.environ.get(API_KEY_ENV)
    api_keys = tuple(args.api_key or ([env_key] if env_key else []))
    return ServerConfig(
        served_model_name=args.served_model_name or args.model,
        api_keys=api_keys,
        salt_cache_by_api_key=args.salt_cache_by_api_key,
        max_request_body_bytes=args.max_request_body_bytes,
        max_n=args.max_n,
        max_prompts_per_request=args.max_prompts_per_request,
        max_stop_token_ids=args.max_stop_token_ids,
        max_chat_messages=args.max_chat_messages,
        max_waiting_requests=args.max_waiting_requests,
        limit_concurrency=args.limit_concurrency,
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_header=args.timeout_header,
        limit_concurrency_per_peer=args.limit_concurrency_per_peer,
        timeout_body=args.timeout_body,
        min_body_rate=args.min_body_rate,
        timeout_write=args.timeout_write,
        enable_dashboard=args.enable_dashboard,
    )


def add_sampling_args(
    parser: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None
) -> None:
    """One flag per ``SamplingParams`` field; ``defaults`` overrides some of its defaults."""
    group = parser.add_argument_group("sampling")
    names = add_dataclass_flags(group, SamplingParams)
    parser.set_defaults(**{_SAMPLING_FIELDS: tuple(names)}, **dict(defaults or {}))


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """``SamplingParams`` from the sampling flags (raises InvalidParameterError if out of range)."""
    names: tuple[str, ...] = getattr(args, _SAMPLING_FIELDS)
    kwargs = {name: getattr(args, name) for name in names}
    return SamplingParams(**kwargs)


def add_chat_template_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--chat-template``: replace the model's chat template (or give one it lacks)."""
    parser.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEMPLATE",
        help="a Jinja chat template file, or the template text itself; "
        "overrides the model's own template",
    )


def read_chat_template(value: str) -> str:
    """The template text of a ``--chat-template`` value: a file's contents or the value itself."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # template text too long for a file name, or with a NUL
        is_file = False
    if is_file:
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise InvalidParameterError(
        "chat_template", f"{value!r} is neither a file nor a Jinja template"
    )


def use_chat_template(tokenizer: Any, template: str | None, model: str) -> None:
    """Install ``template`` on the tokenizer if given; raise if the tokenizer then has none.

    A given template is checked as the model's own are at load: one that goes
    past its limits on a sample conversation raises ChatTemplateError.
    """
    # Imported here so that `kvserve --help` stays fast (it imports Jinja).
    from kvserve.chat.render import install_chat_template

    if template is not None:
        install_chat_template(tokenizer, template)
    if not tokenizer.chat_template:
        raise InvalidParameterError(
            "chat_template",
            f"the model {model!r} has no chat template (a base model completes text: use "
            "`kvserve generate`); pass one with --chat-template FILE_OR_TEMPLATE",
        )
