"""Command line: ``moecompress <command> ...``. Argument parsing only; the work is in the public API.

Every :class:`~moecompress.errors.MoecompressError` is printed as one line (``error: ...``) with exit
status 2 and no traceback. Environment variables are read here and nowhere else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from moecompress.errors import MoecompressError


def _cmd_info(args: argparse.Namespace) -> int:
    from moecompress.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(args.model)
    info = {
        "path": str(ckpt.path),
        "model_type": ckpt.model_type,
        "num_layers": ckpt.adapter.num_layers,
        "moe_layers": ckpt.moe_layer_indices,
        "num_experts": ckpt.adapter.num_experts,
        "expert_width": ckpt.adapter.expert_width,
        "router": ckpt.adapter.router_spec().gating.value,
        "top_k": ckpt.adapter.router_spec().top_k,
        "shards": ckpt.reader.shards,
        "tensors": len(ckpt.reader.keys),
    }
    print(json.dumps(info, indent=2))
    return 0


def _cmd_rewrite(args: argparse.Namespace) -> int:
    from moecompress.engine.layer_loop import rewrite_checkpoint

    out = rewrite_checkpoint(
        args.model,
        args.output,
        fused=args.fused,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    print(out)
    return 0


def _cmd_apply(args: argparse.Namespace) -> int:
    from moecompress.engine.distributed import Launch
    from moecompress.engine.executor import apply

    launch = Launch.from_env(os.environ)  # torchrun's RANK / WORLD_SIZE / LOCAL_RANK (docs/distributed.md)
    result = apply(
        args.recipe,
        args.set or [],
        dry_run_only=args.dry_run,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=not args.quiet,
        launch=launch,
    )
    if launch.rank > 0 and not result.dry_run:  # rank 0 writes and reports
        return 0
    if result.dry_run:
        print(json.dumps(result.report["dry_run"], indent=2))
        return 0
    if result.resumed_finished:
        print(f"{result.output_dir} is already finished by this recipe; nothing to do")
        return 0
    report = result.output_dir / "report.md"
    print(f"wrote {result.output_dir} (report: {report})")
    for w in result.report.get("warnings", []):
        print(f"warning: {w}", file=sys.stderr)
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from moecompress.engine.distributed import Launch
    from moecompress.engine.executor import calibrate
    from moecompress.errors import RecipeError

    if Launch.from_env(os.environ).world_size > 1:
        raise RecipeError(
            "moecompress calibrate does not run under torchrun (apply calibrates data-parallel); run one process"
        )
    print(calibrate(args.recipe, args.set or [], progress=not args.quiet))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from moecompress.io.compressed_tensors import export

    out = export(
        args.model,
        args.output,
        scale_dtype=args.scale_dtype,
        quantize_protected=args.quantize_protected,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    print(out)
    return 0


def _routing_arg(text: str | None):
    """``--routing``: ``off``, ``stored`` or a JSON object of policy knobs (``docs/routing.md``)."""
    if text is None or text in ("off", "stored"):
        return text
    from moecompress.errors import RoutingError

    try:
        value = json.loads(text)
    except ValueError:
        raise RoutingError(
            f"--routing {text!r} is not off, stored or JSON such as '{{\"capacity_drop\": {{\"gamma\": 1.5}}}}'"
        ) from None
    return value


def _cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moecompress.tools.evaluation import EvaluationError, evaluate

    if args.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars
    card = None
    if args.card:  # before the work: OUT must be a finished run directory
        from moecompress.hub.card import card_inputs

        if not Path(args.model).is_dir():
            raise EvaluationError(f"--card rewrites MODEL/README.md: {args.model} is not a local directory")
        card = card_inputs(Path(args.model))
    result = evaluate(
        args.model,
        against=args.against,
        texts=args.text,
        max_tokens=args.max_tokens,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        dtype=args.dtype,
        device=args.device,
        progress=not args.quiet,
        tasks=args.tasks,
        task_dir=args.task_dir,
        limit=args.limit,
        routing=_routing_arg(args.routing),
    )
    text = json.dumps(result, indent=2)
    if args.json:
        try:
            Path(args.json).write_text(text + "\n")
        except OSError as err:
            raise EvaluationError(f"cannot write --json {args.json}: {err.strerror}") from None
    print(text)
    if card is not None:
        from moecompress.hub.card import write_model_card

        print(f"wrote {write_model_card(Path(args.model), **card, evaluation=result)}", file=sys.stderr)
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    from moecompress.hub.push import push

    token = args.token or os.environ.get("HF_TOKEN") or None
    summary = push(args.path, args.repo_id, private=args.private, dry_run=args.dry_run, token=token)
    print(json.dumps(summary, indent=2))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from moecompress.tools.inspect import format_report, inspect_checkpoint

    report = inspect_checkpoint(args.model, align=args.align, load=args.load)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["ok"] else 1


def _size(text: str) -> int:
    from moecompress.io.outputs import parse_size

    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moecompress", description="Compress Mixture-of-Experts checkpoints.")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = p.add_subparsers(dest="command", required=True)

    ap = sub.add_parser("apply", help="run a recipe: calibrate, compress layer by layer, write + report")
    ap.add_argument("recipe", help="recipe YAML file")
    ap.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a recipe field (repeatable)"
    )
    ap.add_argument("--dry-run", action="store_true", help="check the recipe on shapes only; write nothing")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted run of the same recipe")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    ap.set_defaults(func=_cmd_apply)

    cal = sub.add_parser("calibrate", help="compute (or find cached) calibration statistics only")
    cal.add_argument("recipe", help="recipe YAML file")
    cal.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a recipe field")
    cal.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    cal.set_defaults(func=_cmd_calibrate)

    ins = sub.add_parser(
        "inspect", help="layouts, sizes and loadability checks of a checkpoint (exit 1 on problems)"
    )
    ins.add_argument("model", help="checkpoint directory or Hub repo id")
    ins.add_argument("--align", type=int, default=None, help="require expert widths divisible by N")
    ins.add_argument("--load", action="store_true", help="also load the model and run a 4-token forward")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.set_defaults(func=_cmd_inspect)

    info = sub.add_parser("info", help="describe a checkpoint: model type, MoE layers, experts, shards")
    info.add_argument("model", help="checkpoint directory or Hub repo id")
    info.set_defaults(func=_cmd_info)

    rw = sub.add_parser("rewrite", help="stream a checkpoint into a new directory, layer by layer (lossless)")
    rw.add_argument("model", help="checkpoint directory or Hub repo id")
    rw.add_argument("output", help="output directory (must not exist unless --overwrite)")
    rw.add_argument("--fused", action="store_true", help="write transformers 5 fused expert keys")
    rw.add_argument(
        "--max-shard-size", type=_size, default="5GB", help="shard size limit, e.g. 5GB or 500MiB"
    )
    rw.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    rw.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    rw.set_defaults(func=_cmd_rewrite)

    ex = sub.add_parser(
        "export", help="convert an rtn output (symmetric, 4/8 bits) into a compressed-tensors checkpoint"
    )
    ex.add_argument("model", help="moecompress checkpoint whose experts are all rtn-quantised")
    ex.add_argument("output", help="output directory (must not exist unless --overwrite)")
    ex.add_argument(
        "--format", choices=["compressed-tensors"], default="compressed-tensors", help="target format"
    )
    ex.add_argument(
        "--scale-dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="dtype of weight_scale (float32: loaders dequantise exactly)",
    )
    ex.add_argument(
        "--quantize-protected", action="store_true", help="quantise protected (dense) experts too"
    )
    ex.add_argument(
        "--max-shard-size", type=_size, default="5GB", help="shard size limit, e.g. 5GB or 500MiB"
    )
    ex.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    ex.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ex.set_defaults(func=_cmd_export)

    ev = sub.add_parser("eval", help="perplexity, tokens/s and KL / top-1 vs a base on held-out text (JSON)")
    ev.add_argument("model", help="checkpoint directory or Hub repo id (with tokenizer files)")
    ev.add_argument(
        "--against", metavar="BASE", help="base checkpoint: adds kl, top1_agreement, base_perplexity"
    )
    ev.add_argument(
        "--text",
        action="append",
        metavar="FILE",
        help="text file or directory of *.txt (repeatable; default builtin); only its last 2%% is used",
    )
    ev.add_argument("--max-tokens", type=int, default=8192, help="tokens to evaluate at most (default 8192)")
    ev.add_argument("--seq-len", type=int, default=256, help="window length in tokens (default 256)")
    ev.add_argument("--batch-size", type=int, default=4, help="windows per forward pass (default 4)")
    ev.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="load the models in this dtype"
    )
    ev.add_argument("--device", default="cpu", help="device to load the models on (default cpu)")
    ev.add_argument(
        "--tasks",
        metavar="NAMES",
        help="lm-eval tasks, comma-separated (needs moecompress[eval]); bundled offline: "
        "moecompress_nextword, moecompress_continuation",
    )
    ev.add_argument("--task-dir", metavar="DIR", help="directory of lm-eval task YAML configs (with --tasks)")
    ev.add_argument("--limit", type=int, metavar="N", help="at most N documents per lm-eval task")
    ev.add_argument(
        "--routing",
        metavar="POLICY",
        help="routing policies of MODEL: off, stored (default) or JSON knobs, e.g. "
        "'{\"capacity_drop\": {\"gamma\": 1.5}}' (docs/routing.md)",
    )
    ev.add_argument(
        "--card", action="store_true", help="rewrite MODEL/README.md (the model card) with these results"
    )
    ev.add_argument("--json", metavar="OUT", help="also write the JSON result to this file")
    ev.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ev.set_defaults(func=_cmd_eval)

    pu = sub.add_parser("push", help="upload a checkpoint directory (+ model card) to the Hugging Face Hub")
    pu.add_argument("path", help="checkpoint directory (e.g. the output of `moecompress apply`)")
    pu.add_argument("--repo-id", required=True, metavar="ID", help="Hub repo id, owner/name")
    pu.add_argument("--private", action="store_true", help="create the repo as private")
    pu.add_argument(
        "--dry-run",
        action="store_true",
        help="no upload: copy exactly what would be uploaded into PATH.push-preview",
    )
    pu.add_argument(
        "--token", help="Hub token (default: $HF_TOKEN; prefer the variable, arguments show in `ps`)"
    )
    pu.set_defaults(func=_cmd_push)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.INFO if args.verbose or os.environ.get("MOECOMPRESS_VERBOSE") else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except MoecompressError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # `moecompress eval ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
