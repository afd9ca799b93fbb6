"""The demo framework: tables, context, registry, the CLI and the docs page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from demo_fixtures import SHRUNK_SIZES
from kvserve.cli import main
from kvserve.demos import DemoContext, DemoResult, Table, demo_names
from kvserve.demos.docs import render
from kvserve.demos.registry import get_demo
from kvserve.demos.waste import Sizes
from kvserve.errors import InvalidParameterError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_table_formats_numbers_only_when_shown() -> None:
    table = Table.build("T", ("name", "steps", "seconds"), [("a", 1234, 0.5), ("bb", 7, 12.345)])
    assert table.rows[0] == ("a", 1234, 0.5)
    assert table.text().splitlines() == [
        "T",
        "name  steps  seconds",
        "----  -----  -------",
        "a     1,234     0.50",
        "bb        7    12.35",
    ]
    assert "| name | steps | seconds |\n| :--- | ---: | ---: |" in table.markdown()
    assert Table.from_json(json.loads(json.dumps(table.to_json()))) == table


def test_table_refuses_a_row_of_the_wrong_width() -> None:
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        Table.build("T", ("a", "b", "c"), [(1, 2)])


def test_context_refuses_unknown_sizes_and_arguments_the_demo_sets() -> None:
    with pytest.raises(InvalidParameterError, match=r"unknown field.*max_tokens, max_tokens_each"):
        DemoContext(sizes={"num_prompts": 3}).resolve_sizes(Sizes())
    assert DemoContext(sizes={"max_tokens": 5}).resolve_sizes(Sizes()).max_tokens == 5
    with pytest.raises(InvalidParameterError, match="engine_args"):
        DemoContext(engine_args={"dtype": "float32"})
    with pytest.raises(InvalidParameterError, match="max_num_seqs: is set by the demo"):
        DemoContext(engine_args={"max_num_seqs": 2}).engine(max_num_seqs=4)


def test_unknown_demo_names_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidParameterError, match="known: static-vs-continuous, waste"):
        get_demo("static")
    assert main(["demo", "nope"]) == 2
    error = capsys.readouterr().err
    assert "unknown demo 'nope'" in error
    for name in demo_names():
        assert name in error


def test_cli_refuses_an_out_folder_that_is_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked before any model loads (the model named here does not exist)."""
    taken = tmp_path / "file"
    taken.write_text("")
    assert main(["demo", "waste", "--model", str(tmp_path / "none"), "--out", str(taken)]) == 2
    assert "error: out: cannot be used as a folder" in capsys.readouterr().err


def test_every_demo_result_round_trips_through_json(demo_results: dict[str, DemoResult]) -> None:
    for name in SHRUNK_SIZES:
        result = demo_results[name]
        payload = json.loads(json.dumps(result.to_json()))
        assert payload["name"] == name
        assert payload["context"]["sizes"] == json.loads(json.dumps(SHRUNK_SIZES[name]))
        assert [Table.from_json(t) for t in payload["tables"]] == list(result.tables)
        assert payload["data"] == json.loads(json.dumps(dict(result.data)))
        assert payload["explanation"] and "{" not in payload["explanation"]


def test_cli_writes_json_and_png(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = [
        "demo",
        "waste",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "== waste:" in printed and "waste %" in printed
    payload = json.loads((out / "waste.json").read_text())
    assert payload["name"] == "waste"
    assert payload["context"]["model"] == str(tiny_model_dir)
    assert (out / "waste.png").read_bytes().startswith(PNG_MAGIC)


def test_docs_page_shows_every_demo(demo_results: dict[str, DemoResult], tmp_path: Path) -> None:
    json_dir = tmp_path / "docs" / "demos"
    names = list(SHRUNK_SIZES)
    for name in names:
        written = demo_results[name].write(json_dir)
        assert written.png_path.read_bytes().startswith(PNG_MAGIC)
        assert written.png_path.stat().st_size < 150_000
    page = render(json_dir, tmp_path / "docs" / "demos.md", names)
    for name in names:
        result = demo_results[name]
        assert f"## `{name}`: {result.title}" in page
        assert result.explanation in page
        assert f"![{name}](demos/{name}.png)" in page
        for table in result.tables:
            assert table.markdown() in page
    with pytest.raises(FileNotFoundError, match="missing"):
        render(json_dir, tmp_path / "demos.md", ["no-such-demo"])
