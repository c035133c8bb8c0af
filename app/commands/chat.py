"""`thermocline chat`: a conversation in the terminal, same engine as the window."""

from __future__ import annotations

import sys
import threading

from engine.errors import ContextFullError

from .common import add_model_options, load_engine, sampling_params

HELP = "Commands: /reset starts over, /quit leaves. Ctrl-C stops an answer."


def register(subparsers) -> None:
    parser = subparsers.add_parser("chat", help="chat in the terminal")
    add_model_options(parser)
    parser.add_argument("--system", default=None, help="system prompt")
    parser.set_defaults(handler=run)


def run(args) -> int:
    engine = load_engine(args)
    params = sampling_params(args, engine)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print(f"Thermocline chat · {engine.model_dir.name} · {engine.mode} · context {engine.ctx}. {HELP}")
    if engine.tokenizer.is_chat_model is False:
        from engine.chat_formats import BASE_MODEL_NOTE

        print(f"note: {BASE_MODEL_NOTE}")
    while True:
        try:
            line = input("\nyou> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return 0
        if text == "/reset":
            messages = messages[:1] if args.system else []
            engine.reset()
            print("(conversation cleared)")
            continue
        messages.append({"role": "user", "content": text})
        cancel = threading.Event()
        answer = []
        sys.stdout.write("bot> ")
        try:
            for event in engine.stream(messages, params, cancel):
                answer.append(event.text)
                sys.stdout.write(event.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            cancel.set()
            sys.stdout.write(" [stopped]")
        except ContextFullError as exc:
            messages.pop()
            print(f"\n(context full: {exc}; type /reset)")
            continue
        messages.append({"role": "assistant", "content": "".join(answer).strip()})
        s = engine.last_stats
        sys.stdout.write(f"\n  [{s.decode_tok_s:.1f} tok/s, ttft {s.ttft_s * 1000:.0f} ms]\n")
