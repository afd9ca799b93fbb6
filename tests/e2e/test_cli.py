"""The ``kvserve`` command line, run in-process against a tiny random Llama."""

from __future__ import annotations

import dataclasses
import io
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.cli import build_parser, main
from kvserve.config.engine import ENGINE_CONFIG_GROUPS
from kvserve.engine import LLMEngine, request_group
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.entrypoints import args as cli_args
from model_fixtures import save_tiny_model, train_tiny_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
GREEDY_FLAGS = ["--temperature", "0", "--max-tokens", "6", "--ignore-eos"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama", train_tiny_tokenizer())


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(CHAT_TEMPLATE, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> LLM:
    """The offline API on the same model: what the CLI must agree with."""
    llm = LLM(str(model_dir), dtype="float32")
    llm.get_tokenizer().chat_template = CHAT_TEMPLATE
    return llm


def model_flags(model_dir: Path) -> list[str]:
    return ["--model", str(model_dir), "--dtype", "float32"]


def wrap_engine_step(
    monkeypatch: pytest.MonkeyPatch, before_step: Callable[[LLMEngine, int], None]
) -> None:
    """Call ``before_step(engine, call_number)`` before every ``LLMEngine.step``."""
    real_step = LLMEngine.step
    calls = iter(range(10**9))

    def step(engine: LLMEngine) -> Any:
        before_step(engine, next(calls))
        return real_step(engine)

    monkeypatch.setattr(LLMEngine, "step", step)


def test_generate_prints_what_llm_generate_returns(
    model_dir: Path, reference: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "The quick brown fox"
    params = SamplingParams(temperature=0, max_tokens=5)
    expected = reference.generate(prompt, params, use_tqdm=False)[0].outputs[0].text

    flags = ["--temperature", "0", "--max-tokens", "5"]
    assert main(["generate", *model_flags(model_dir), *flags, prompt]) == 0

    assert expected
    assert capsys.readouterr().out == expected + "\n"


def test_generate_reports_a_failed_prompt_and_exits_1(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class BrokenDetokenizer(IncrementalDetokenizer):
        def append(self, token_id: int) -> str | None:
            raise RuntimeError("broken detokenizer")

    monkeypatch.setattr(request_group, "IncrementalDetokenizer", BrokenDetokenizer)
    assert main(["generate", *model_flags(model_dir), *GREEDY_FLAGS, "The quick brown fox"]) == 1
    assert "error: prompt 1 failed: " in capsys.readouterr().err


def test_generate_prints_several_prompts_in_order(
    model_dir: Path, reference: LLM, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = ["Paged attention stores", "Once upon a time", "Numbers like 12"]
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text(f"{prompts[1]}\n\n{prompts[2]}\n", encoding="utf-8")
    expected = [o.outputs[0].text for o in reference.generate(prompts, GREEDY, use_tqdm=False)]

    argv = ["generate", *model_flags(model_dir), *GREEDY_FLAGS, "--prompt-file", str(prompt_file)]
    assert main([*argv, prompts[0]]) == 0

    out = capsys.readouterr().out
    blocks = [f"=== prompt {i + 1}/3: {p!r} ===\n{expected[i]}\n" for i, p in enumerate(prompts)]
    assert out == "".join(blocks)


@pytest.mark.parametrize(
    ("flags", "param"),
    [
        (["--top-p", "2"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--block-size", "0"], "block_size"),
        (["--no-chunked-prefill", "--max-num-seqs", "-1"], "max_num_seqs"),
    ],
)
def test_bad_flag_value_exits_2_naming_the_parameter_before_loading(
    flags: list[str],
    param: str,
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def never_load(self: LLMEngine, config: Any) -> None:
        raise AssertionError("the model was loaded despite a bad flag")

    monkeypatch.setattr(LLMEngine, "__init__", never_load)

    assert main(["generate", *model_flags(model_dir), *flags, "hello"]) == 2

    err = capsys.readouterr().err
    assert err.startswith(f"error: {param}: ")
    assert "Traceback" not in err


def test_every_config_field_has_a_flag_with_the_same_default() -> None:
    args = build_parser().parse_args(["generate", "a prompt"])

    model, engine_args = cli_args.engine_kwargs(args)

    config_fields = {
        f.name: f.default for cls in ENGINE_CONFIG_GROUPS for f in dataclasses.fields(cls)
    }
    assert model == config_fields.pop("model")
    config_fields.pop("seed")  # --seed is the sampling seed on generate and chat
    config_fields["speculative_config"] = None  # one JSON flag beside the groups' fields
    assert engine_args == config_fields
    assert cli_args.sampling_params(args) == SamplingParams()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [([], None), (["--enable-prefix-caching"], True), (["--no-prefix-caching"], False)],
)
def test_prefix_caching_is_automatic_unless_a_flag_forces_it(
    flags: list[str], expected: bool | None
) -> None:
    args = build_parser().parse_args(["generate", *flags, "x"])

    assert cli_args.engine_kwargs(args)[1]["enable_prefix_caching"] is expected


def test_kv_cache_size_flag_accepts_units() -> None:
    args = build_parser().parse_args(["generate", "--kv-cache-memory-bytes", "1.5GiB", "x"])

    assert cli_args.engine_kwargs(args)[1]["kv_cache_memory_bytes"] == 3 * 512 * 1024**2


def test_chat_streams_the_reply_step_by_step(
    model_dir: Path,
    template_file: Path,
    reference: LLM,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    conversation = [{"role": "user", "content": "hello"}]
    expected = reference.chat(conversation, GREEDY, use_tqdm=False)[0].outputs[0].text
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/exit\n"))
    # What reached stdout before each engine step: a streamed reply grows between steps.
    printed_before_step: list[str] = []
    wrap_engine_step(
        monkeypatch, lambda engine, call: printed_before_step.append(capsys.readouterr().out)
    )

    argv = ["chat", *model_flags(model_dir), *GREEDY_FLAGS, "--chat-template", str(template_file)]
    assert main(argv) == 0

    transcript = "".join(printed_before_step) + capsys.readouterr().out
    assert expected.strip()
    assert transcript == f">>> {expected}\n>>> "
    assert sum(1 for chunk in printed_before_step[1:] if chunk) >= 2


def test_chat_without_a_template_is_a_clear_error(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/exit\n"))

    assert main(["chat", *model_flags(model_dir)]) == 2

    err = capsys.readouterr().err
    assert err.startswith("error: chat_template: ")
    assert "--chat-template" in err


# Templates that raise on every conversation; the first two load, the last two are
# refused by the load check (out of the sandbox; past the limits).
FAILING_TEMPLATES = {
    "{{ 2.0 ** 100000 }}": "OverflowError",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}": "RecursionError",
    "{{ messages.append(1) }}": "sandbox",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}": "limits",
}


@pytest.mark.parametrize("template", FAILING_TEMPLATES)
def test_generate_chat_on_a_failing_template_prints_an_error_and_exits_2(
    model_dir: Path, template: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--chat", *model_flags(model_dir), *GREEDY_FLAGS, "--chat-template"]
    assert main([*argv, template, "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: chat_template: the chat template ")
    assert FAILING_TEMPLATES[template] in err and "Traceback" not in err


@pytest.mark.parametrize("template", FAILING_TEMPLATES)
def test_generate_chat_on_a_model_whose_own_template_fails_exits_2(
    tmp_path: Path, template: str, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = train_tiny_tokenizer()
    tokenizer.chat_template = template
    folder = save_tiny_model(tmp_path / "model", "llama", tokenizer)
    capsys.readouterr()  # what saving printed
    assert main(["generate", "--chat", *model_flags(folder), *GREEDY_FLAGS, "hello"]) == 2
    err = capsys.readouterr().err
    # A template that fails on every request loads, and each chat says why; one that
    # leaves its sandbox or its limits on the load check's sample is refused at load.
    assert err.startswith(("error: chat_template: the chat template ", "error: model: cannot load"))
    assert FAILING_TEMPLATES[template] in err and "Traceback" not in err


def test_ctrl_c_aborts_the_reply_and_the_chat_goes_on(
    model_dir: Path,
    template_file: Path,
    reference: LLM,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nsecond try\n/exit\n"))
    engines: list[LLMEngine] = []

    def press_ctrl_c_during_first_reply(engine: LLMEngine, call: int) -> None:
        engines.append(engine)
        if call == 1:
            signal.raise_signal(signal.SIGINT)

    wrap_engine_step(monkeypatch, press_ctrl_c_during_first_reply)
    argv = ["chat", *model_flags(model_dir), *GREEDY_FLAGS, "--chat-template", str(template_file)]
    assert main(argv) == 0

    out = capsys.readouterr().out
    first_turn, second_turn = out.split("(interrupted)\n")
    assert first_turn.startswith(">>> ")
    # The aborted exchange is dropped: the second reply answers a fresh conversation.
    conversation = [{"role": "user", "content": "second try"}]
    expected = reference.chat(conversation, GREEDY, use_tqdm=False)[0].outputs[0].text
    assert second_turn == f">>> {expected}\n>>> "
    engine = engines[0]
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_usable_blocks


def test_a_failed_reply_is_reported_and_the_chat_goes_on(
    model_dir: Path,
    template_file: Path,
    reference: LLM,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    created: list[IncrementalDetokenizer] = []

    class FirstReplyFails(IncrementalDetokenizer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            created.append(self)
            self.broken = len(created) == 1

        def append(self, token_id: int) -> str | None:
            if self.broken:
                raise RuntimeError("broken detokenizer")
            return super().append(token_id)

    monkeypatch.setattr(request_group, "IncrementalDetokenizer", FirstReplyFails)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nsecond try\n/exit\n"))
    argv = ["chat", *model_flags(model_dir), *GREEDY_FLAGS, "--chat-template", str(template_file)]
    assert main(argv) == 0

    captured = capsys.readouterr()
    assert "error: the reply failed: " in captured.err
    # The failed exchange is dropped: the second reply answers a fresh conversation.
    conversation = [{"role": "user", "content": "second try"}]
    expected = reference.chat(conversation, GREEDY, use_tqdm=False)[0].outputs[0].text
    assert captured.out == f">>> \n>>> {expected}\n>>> "
