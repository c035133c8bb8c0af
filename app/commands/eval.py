"""`thermocline eval`: perplexity dense / sparse / oracle, agreement and predictor figures."""

from __future__ import annotations

import json

from .progress_bar import ProgressBar


def register(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="measure the quality of sparse inference")
    parser.add_argument("--model", default="demo", help="model folder or catalogue id (default: demo)")
    parser.add_argument("--corpus", nargs="+", default=None, metavar="FILE",
                        help="held-out text (default: the model's thermocline/eval.txt)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="tokens to score")
    parser.add_argument("--window", type=int, default=256, help="tokens per scored window")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads")
    parser.add_argument("--cpu-weights", default="int8", choices=("int4", "int8", "fp32"),
                        help="format of the weights on the CPU, shared by all three scorings "
                             "(int8: as chat runs by default; int4: 4-bit Q4_0 rows; fp32: the checkpoint's exact weights)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from app.open_model import open_engine
    from engine.errors import UserError
    from engine.calibration.evaluation import EvalSettings, evaluate

    if args.max_tokens < 2 or args.window < 2:
        raise UserError("--max-tokens and --window must be at least 2")
    engine = open_engine(args.model, mode="sparse", ctx=args.window, device=args.device,
                         threads=args.threads, cpu_weights=args.cpu_weights)
    bar = ProgressBar("eval", quiet=args.json)
    report = evaluate(engine, args.corpus, EvalSettings(args.max_tokens, args.window), progress=bar)
    bar.done()
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['tokens']} tokens of held-out text, CPU weights in {report['cpu_weights']}")
    print(f"perplexity dense {report['ppl_dense']:.3f}  sparse {report['ppl_sparse']:.3f} "
          f"({report['ppl_sparse_ratio']:.4f}x)  oracle {report['ppl_oracle']:.3f}")
    print(f"greedy agreement sparse vs dense {report['greedy_agreement'] * 100:.1f}%")
    print(f"sparsity {report['sparsity'] * 100:.1f}%  predicted {report['predicted_sparsity'] * 100:.1f}%  "
          f"recall {report['recall']:.3f}  precision {report['precision']:.3f}")
    print(f"placed predictors ({report['cpu_weights']}) vs their original: selected "
          f"{report['selected_vs_original']:.3f}x (worst layer {report['selected_vs_original_max']:.3f}x), "
          f"recall of the original's selection {report['recall_of_original']:.3f} "
          f"(worst {report['recall_of_original_min']:.3f})")
    print("layer  sparsity  predicted  recall  precision")
    for r in report["per_layer"]:
        print(f"{r['layer']:5d}  {r['sparsity'] * 100:7.1f}%  {r['predicted_sparsity'] * 100:8.1f}%  "
              f"{r['recall']:6.3f}  {r['precision']:9.3f}")
    return 0
