"""``kvserve chat``: an interactive conversation that streams the model's replies.

The session keeps the conversation, renders it with the chat template each
turn, and drives :class:`~kvserve.engine.LLMEngine` one ``step()`` at a time,
printing the new part of the (cumulative) reply text after every step.

Ctrl-C while a reply streams aborts that request and returns to the prompt.
The signal only sets a flag, checked between steps, so an engine step is never
cut in half and the engine stays consistent for the next turn.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TextIO

from kvserve.entrypoints.args import (
    add_chat_template_arg,
    add_engine_args,
    add_sampling_args,
    engine_kwargs,
    read_chat_template,
    sampling_params,
    use_chat_template,
)
from kvserve.errors import InvalidParameterError
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.llm import LLM

# A reply's token limit unless --max-tokens says otherwise (SamplingParams' 16 is
# too short for a conversation); it is also capped by the context left.
DEFAULT_CHAT_MAX_TOKENS = 512
PROMPT = ">>> "
HELP = "/reset clears the conversation, /exit or Ctrl-D quits, Ctrl-C stops a reply"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="talk with a model in the terminal, replies streamed",
        usage="%(prog)s [options]",
        description=f"Interactive chat. {HELP}.",
    )
    parser.add_argument("--system", help="a system message that opens the conversation")
    add_chat_template_arg(parser)
    add_sampling_args(parser, defaults={"max_tokens": DEFAULT_CHAT_MAX_TOKENS})
    # --seed is the sampling seed here; the engine's own seed keeps its default.
    add_engine_args(parser, exclude=("seed",))
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    if params.n != 1:
        raise InvalidParameterError(
            "n", f"chat streams a single reply, so n must be 1, got {params.n}"
        )
    template = read_chat_template(args.chat_template) if args.chat_template else None
    model, engine_args = engine_kwargs(args)

    from kvserve.llm import LLM  # imports torch: only once the command line is known good

    llm = LLM(model, **engine_args)
    use_chat_template(llm.get_tokenizer(), template, model)
    print(f"kvserve chat with {model}: {HELP}.", file=sys.stderr)
    ChatSession(llm, params, args.system).run(sys.stdout)
    return 0


@contextlib.contextmanager
def sigint_sets_flag() -> Iterator[threading.Event]:
    """While inside, Ctrl-C sets the yielded event instead of raising KeyboardInterrupt."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted  # signal handlers can only be installed from the main thread
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.set())
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


class ChatSession:
    """A conversation with one model; each turn is one engine request."""

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.params = params
        self.opening = [{"role": "system", "content": system}] if system else []
        self.history: list[dict[str, str]] = list(self.opening)
        self._turn_ids = itertools.count()

    def run(self, out: TextIO) -> None:
        """Read user lines until /exit or end of input; answer each one."""
        while True:
            try:
                line = input(PROMPT).strip()
            except EOFError:
                out.write("\n")
                return
            except KeyboardInterrupt:
                out.write(f"\n({HELP})\n")
                continue
            if not line:
                continue
            if line in ("/exit", "/quit"):
                return
            if line == "/reset":
                self.history = list(self.opening)
                out.write("(conversation cleared)\n")
                continue
            try:
                reply = self.reply(line, out)
            except InvalidParameterError as exc:
                print(f"error: {exc} (/reset starts a new conversation)", file=sys.stderr)
                continue
            if reply is not None:
                self.history += [
                    {"role": "user", "content": line},
                    {"role": "assistant", "content": reply},
                ]

    def reply(self, user_text: str, out: TextIO) -> str | None:
        """Stream the answer to ``user_text`` into ``out``; None if Ctrl-C aborted it or it failed.

        Raises InvalidParameterError, before anything is generated, when the
        conversation no longer fits the context.
        """
        prompt = self.llm.apply_chat_template(
            [*self.history, {"role": "user", "content": user_text}]
        )
        room = self.engine.max_model_len - len(prompt["prompt_token_ids"])
        max_tokens = max(1, min(self.params.max_tokens, room))
        params = dataclasses.replace(
            self.params, max_tokens=max_tokens, min_tokens=min(self.params.min_tokens, max_tokens)
        )
        request_id = f"chat-{next(self._turn_ids)}"
        self.engine.add_request(request_id, prompt, params)
        text = ""
        with sigint_sets_flag() as interrupted:
            while not interrupted.is_set():
                for output in self.engine.step():
                    if output.request_id != request_id:
                        continue
                    completion = output.outputs[0]
                    # Cumulative text: print what is new. (A stop string completed
                    # by this step may shorten it; what was shown stays shown.)
                    if completion.text.startswith(text):
                        out.write(completion.text[len(text) :])
                        out.flush()
                    text = completion.text
                    if output.finished:
                        out.write("\n")
                        if output.error is not None:
                            print(f"error: the reply failed: {output.error}", file=sys.stderr)
                            return None
                        if completion.finish_reason == "length":
                            print(f"(reply cut at {max_tokens} tokens)", file=sys.stderr)
                        return text
        self.engine.abort_request(request_id)
        out.write("\n(interrupted)\n")
        return None
