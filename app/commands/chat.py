"""`thermocline chat`: a conversation in the terminal, same engine as the window."""

from __future__ import annotations

import sys
import threading

from engine.errors import ContextFullError, ModelFormatError, RemoteError, UserError

from .common import add_model_options, load_engine, sampling_params

HELP = "Commands: /reset starts over, /quit leaves. Ctrl-C stops an answer."


def register(subparsers) -> None:
    parser = subparsers.add_parser("chat", help="chat in the terminal")
    add_model_options(parser)
    parser.add_argument("--system", default=None, help="system prompt")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from app.single_instance import window_pid

    pid = window_pid()
    if pid is not None:
        sys.stderr.write(f"note: the Thermocline window (process {pid}) is open and holds a model in memory too; "
                         "this chat loads its own copy. Close the window to free that memory.\n")
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
        except UnicodeDecodeError:  # bytes that are not UTF-8: this line is lost, the chat goes on
            print("(that line was not valid UTF-8 and was ignored; check the terminal's encoding)")
            continue
        text = line.strip()
        if not text:
            continue
        if not _is_utf8(text):  # a pipe's bytes arrive as lone surrogates instead of an exception
            print("(that line was not valid UTF-8 and was ignored; check the terminal's encoding)")
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
        except RemoteError as exc:  # a remote model's server failed: say why, keep what arrived
            if not answer:
                messages.pop()
                print(f"\n(error: {exc})")
                continue
            sys.stdout.write(f" [interrupted: {exc}]")
        except UserError as exc:  # this message cannot be answered (e.g. the template refused it)
            if isinstance(exc, ModelFormatError):
                raise  # the model itself is broken: no other message will do better
            messages.pop()
            print(f"\n(error: {exc})")
            continue
        messages.append({"role": "assistant", "content": "".join(answer).strip()})
        s = engine.last_stats
        sys.stdout.write(f"\n  [{s.decode_tok_s:.1f} tok/s, ttft {s.ttft_s * 1000:.0f} ms]\n")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
