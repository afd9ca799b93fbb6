"""The ``kvserve`` command imports only the subcommand it runs.

Checked in a fresh interpreter: what a process imports stays resident for as
long as it runs, and the benchmarks' HTTP client and terminal renderers have
no business in a server's memory.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.cli import COMMANDS, build_parser, main
from kvserve.errors import InvalidParameterError


def _modules_after(code: str) -> set[str]:
    script = f"import sys\n{code}\nprint('\\n'.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    return set(result.stdout.split())


def test_serve_command_line_imports_no_other_subcommand() -> None:
    modules = _modules_after(
        "from kvserve.cli import build_parser\n"
        "build_parser('serve').parse_args(['serve', '--model', 'm.gguf'])"
    )
    assert COMMANDS["serve"] in modules
    # serve takes --trace from the trace command's module; the others it never needs.
    others = [COMMANDS[name] for name in ("generate", "chat", "bench", "demo", "dashboard")]
    assert not [module for module in others if module in modules]
    assert "httpx" not in modules  # the benchmarks' client


def test_importing_the_command_imports_no_subcommand() -> None:
    modules = _modules_after("import kvserve.cli")
    assert not [module for module in COMMANDS.values() if module in modules]


def test_full_parser_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    usage = capsys.readouterr().out
    for name in ("generate", "chat", "serve", "bench", "trace", "demo", "dashboard"):
        assert name in usage


def test_one_subcommand_parser_parses_like_the_full_one() -> None:
    argv = ["serve", "--model", "m.gguf", "--port", "8123", "--max-num-seqs", "7"]
    alone = vars(build_parser("serve").parse_args(argv))
    full = vars(build_parser().parse_args(argv))
    assert alone.keys() == full.keys()
    assert {k: v for k, v in alone.items() if k != "run"} == {
        k: v for k, v in full.items() if k != "run"
    }
    assert alone["port"] == 8123 and alone["max_num_seqs"] == 7


def test_unknown_subcommand_gets_the_full_parsers_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serv", "--model", "m.gguf"])
    assert exc.value.code == 2
    assert "invalid choice: 'serv'" in capsys.readouterr().err


def test_build_parser_refuses_an_unknown_command() -> None:
    with pytest.raises(InvalidParameterError, match="command"):
        build_parser("serv")
