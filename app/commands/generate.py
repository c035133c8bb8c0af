"""`thermocline generate`: one completion, streamed to stdout or reported as JSON."""

from __future__ import annotations

import json
import sys

from .common import add_model_options, load_engine, sampling_params


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="complete one prompt")
    add_model_options(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from app.kernel_words import TerminalNote, kernels_choice

    engine = load_engine(args, kernels_choice())
    note = TerminalNote(engine, sys.stderr)
    note.after_load()
    params = sampling_params(args, engine)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    if args.json:
        from engine.errors import RemoteInterrupted

        try:
            result = engine.generate(prompt, params)
        except RemoteInterrupted as exc:  # a remote stream broke off: report what arrived, then the error
            print(json.dumps({"text": exc.partial, "token_ids": [], **engine.last_stats.to_dict(), "error": str(exc)}))
            raise
        report = {"text": result.text, "token_ids": result.token_ids, **result.stats.to_dict()}
        print(json.dumps(report))
        note.after_answer()
        return 0
    for event in engine.stream(prompt, params):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = engine.last_stats
    sys.stderr.write(
        f"[{s.new_tokens} tokens, ttft {s.ttft_s * 1000:.0f} ms, prefill {s.prefill_tok_s:.1f} tok/s, "
        f"decode {s.decode_tok_s:.1f} tok/s, mode {s.mode}, {s.finish_reason}]\n"
    )
    note.after_answer()
    return 0
