"""`thermocline chat`: a conversation in the terminal, same engine, defaults and database as the window.

The prompt is a line editor with history (readline: arrows, Ctrl-R, kept between sessions);
lines starting with `/` are commands, never sent to the model. Without --model/--mode it runs
the window's model and mode; each chat is saved with the window's conversations, and a chat
longer than the context follows the window's context policy (forget the oldest messages, or
stop and say so).
"""

from __future__ import annotations

import sys
import threading

from engine.errors import ContextFullError, ModelFormatError, RemoteError, UserError

from .common import add_model_options, load_engine, sampling_params

COMMANDS = {
    "/help": "this list",
    "/new": "start a new conversation (also /reset)",
    "/quit": "leave (also /exit, Ctrl-D, or Ctrl-C twice)",
}
HELP = "Type /help for commands. Ctrl-C stops an answer."


def register(subparsers) -> None:
    parser = subparsers.add_parser("chat", help="chat in the terminal")
    add_model_options(parser)
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--no-save", action="store_true", help="do not keep this chat with the window's")
    parser.set_defaults(handler=run, model=None, mode=None)  # None: the window's choice


def _line_editor(history_file) -> None:
    """Arrow keys, editing and history for input(), where readline exists (not on Windows)."""
    try:
        import atexit
        import readline
    except ImportError:
        return
    try:
        readline.read_history_file(history_file)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save() -> None:
        try:
            history_file.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(history_file)
        except OSError:
            pass

    atexit.register(save)


def _load(args, settings):
    """The engine for the requested (or the window's) model; a sparse mode that cannot run here
    falls back to dense, as in the window."""
    args.model = args.model or settings["model.active"]
    args.mode = args.mode or settings["engine.mode"]
    from app.kernel_words import kernels_choice

    try:
        return load_engine(args, kernels_choice())
    except Exception:
        if args.mode == "dense":
            raise
        requested, args.mode = args.mode, "dense"
        engine = load_engine(args, kernels_choice())
        print(f"(running dense: {requested} mode is not available for this model)", file=sys.stderr)
        return engine


def run(args) -> int:
    from engine.runtime.context_policy import answer_room
    from app.settings import DEFAULT_SYSTEM_PROMPT, Settings, config_dir
    from app.single_instance import window_pid

    pid = window_pid()
    if pid is not None:
        sys.stderr.write(f"note: the Thermocline window (process {pid}) is open and holds a model in memory too; "
                         "this chat loads its own copy. Close the window to free that memory.\n")
    settings = Settings()
    engine = _load(args, settings)
    if args.max_new_tokens == 256:  # the option's default: the window's longest answer instead
        args.max_new_tokens = settings["chat.max_new_tokens"]
    for key in ("temperature", "top_p", "top_k", "repetition_penalty"):
        if getattr(args, key, None) is None:
            setattr(args, key, settings[f"chat.{key}"])
    params = sampling_params(args, engine)
    tokenizer = getattr(engine, "tokenizer", None)  # None: a remote model (its tokenizer is on its server)
    base = args.model == "demo" or (tokenizer is not None and not tokenizer.has_chat_template)
    system = args.system if args.system is not None else settings["chat.system_prompt"]
    if base and args.system is None and system.strip() == DEFAULT_SYSTEM_PROMPT:
        system = ""  # a base model continues text: an assistant prompt only takes room
    policy = settings["chat.context_policy"]
    saver = None
    if not args.no_save:
        try:
            from app.storage import Storage

            from .chat_saving import ChatSaver

            saver = ChatSaver(Storage())
        except Exception as exc:  # noqa: BLE001 - chatting matters more than keeping it
            print(f"(this chat will not be saved: {str(exc)[:200]})", file=sys.stderr)
    _line_editor(config_dir() / "chat_history")

    head = [{"role": "system", "content": system}] if system.strip() else []
    messages: list[dict] = list(head)
    started = False  # the conversation has its first message
    dropped = 0
    print(f"Thermocline chat · {args.model} · {engine.mode} · reads {engine.ctx:,} tokens. {HELP}")
    if args.model == "demo":
        print("(the demo model was trained only on Jane Austen's novels: it writes pastiche, not facts)")
    elif tokenizer is not None and tokenizer.is_chat_model is False:
        from engine.runtime.chat_formats import BASE_MODEL_NOTE

        print(f"note: {BASE_MODEL_NOTE}")
    from app.kernel_words import TerminalNote

    kernel_note = TerminalNote(engine, sys.stdout)
    kernel_note.after_load()
    interrupted = False
    try:
        while True:
            try:
                line = input("\nyou> ")
                interrupted = False
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                if interrupted:
                    print()
                    return 0
                interrupted = True
                print("\n(press Ctrl-C again, or type /quit, to leave)")
                continue
            except UnicodeDecodeError:  # bytes that are not UTF-8: this line is lost, the chat goes on
                print("(that line was not valid UTF-8 and was ignored; check the terminal's encoding)")
                continue
            text = line.strip()
            if not text:
                continue
            if not _is_utf8(text):  # a pipe's bytes arrive as lone surrogates instead of an exception
                print("(that line was not valid UTF-8 and was ignored; check the terminal's encoding)")
                continue
            if text.startswith("/"):
                command = text.split()[0].lower()
                if command in ("/quit", "/exit"):
                    return 0
                if command in ("/new", "/reset"):
                    messages, started, dropped = list(head), False, 0
                    engine.reset()
                    print("(new conversation)")
                elif command in ("/help", "/?"):
                    for name, what in COMMANDS.items():
                        print(f"  {name:7} {what}")
                    print("  Up/Down recall earlier lines; Ctrl-C stops an answer.")
                else:
                    print(f"(unknown command {command}; /help lists them)")
                continue
            messages.append({"role": "user", "content": text})
            try:  # counting renders the template, which may refuse this conversation
                # the window's and the server's count too (Engine.fit; a remote engine counts nothing)
                fitted = engine.fit(messages, policy, params.max_new_tokens, dropped)
            except UserError as exc:
                if isinstance(exc, ModelFormatError):
                    raise  # the model itself is broken: no other message will do better
                messages.pop()
                print(f"\n(error: {exc})")
                continue
            if fitted.tokens is not None and not fitted.fits:
                alone = engine.count_chat(head + [messages[-1]])
                if alone > engine.ctx - answer_room(engine.ctx, params.max_new_tokens):
                    # No policy helps a message that is itself too long: refuse it before it is sent.
                    messages.pop()
                    print(f"(not sent: this message is {alone:,} tokens long, but the model reads at most "
                          f"{engine.ctx:,} tokens at once, its answer included. Shorten it, or send it in parts)")
                    continue
            if fitted.dropped > dropped:
                oldest = "message" if fitted.dropped == 1 else f"{fitted.dropped} messages"
                print(f"(the conversation is longer than the model reads: it now forgets the oldest {oldest}; "
                      "/new starts afresh)")
            dropped = fitted.dropped
            if saver is not None and not started:
                saver.new_conversation(
                    " ".join(text.split())[:48], system_prompt=system,
                    sampling={k: getattr(params, k) for k in ("temperature", "top_p", "top_k",
                                                               "repetition_penalty", "max_new_tokens")},
                    model=args.model)
            started = True
            if saver is not None:
                saver.add("user", text)
            cancel = threading.Event()
            answer = []
            sys.stdout.write("bot> ")
            status = "complete"
            try:
                for event in engine.stream(fitted.messages, params, cancel):
                    answer.append(event.text)
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                cancel.set()
                status = "stopped"
                sys.stdout.write(" [stopped]")
            except ContextFullError:
                messages.pop()
                forget = ("" if policy == "truncate" else
                          "; or set Preferences → Chat to forget the oldest messages")
                print(f"\n(the conversation is full: the model cannot read any more of it. /new starts a "
                      f"new one{forget})")
                continue
            except RemoteError as exc:  # a remote model's server failed: say why, keep what arrived
                if not answer:
                    messages.pop()
                    print(f"\n(error: {exc})")
                    continue
                status = "interrupted"
                sys.stdout.write(f" [interrupted: {exc}]")
            except UserError as exc:  # this message cannot be answered (e.g. the template refused it)
                if isinstance(exc, ModelFormatError):
                    raise  # the model itself is broken: no other message will do better
                messages.pop()
                print(f"\n(error: {exc})")
                continue
            reply = "".join(answer).strip()
            messages.append({"role": "assistant", "content": reply})
            s = engine.last_stats
            if saver is not None:
                saver.add("assistant", reply, status=status,
                          stats={k: getattr(s, k) for k in ("new_tokens", "decode_tok_s", "ttft_s",
                                                            "prompt_tokens", "mode")})
            if s.finish_reason == "context_full":
                print("\n(the conversation filled what the model reads; /new starts a new one)")
            speed = f"{s.decode_tok_s:.1f} tokens/s, " if s.new_tokens > 1 else ""
            sys.stdout.write(f"\n  [{speed}first word after {s.ttft_s * 1000:.0f} ms]\n")
            kernel_note.after_answer()
    finally:
        if saver is not None:
            saver.close()


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
