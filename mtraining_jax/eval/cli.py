"""``mtraining-eval`` (also ``python -m mtraining_jax.eval``): evaluate a checkpoint on long contexts.

Examples::

    mtraining-eval runs/tiny_cpu --out eval/tiny --lengths 2048,4096 --samples 4
    mtraining-eval ckpt/qwen0.5b --backend mtraining --mesh 1x1 --lengths 32768 --out eval/q   # converter output
    mtraining-eval path/to/hf-qwen2 --backend cudnn --out eval/hf                              # Hugging Face dir
    mtraining-eval --compare eval/dense eval/mtraining --labels dense,mtraining --out eval/cmp

CHECKPOINT is a training run dir (newest step), a run's ``checkpoints/<step>``, a converter output
dir or a Hugging Face Qwen2 dir (:mod:`mtraining_jax.eval.checkpoints`). The sequence runs in the
model's layout, sharded over the ``--mesh`` (default: the run's) as in training. Writes
``results.json`` + PNGs into ``--out`` (``--compare``: ``compare.md`` + side-by-side PNGs).
Exit status: 0 done, 2 bad arguments / checkpoint / length / output folder (one line on stderr),
130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from pallas_kernels.registry import IMPLS as KERNEL_IMPLS


EXIT_CODES = """exit status:
  0    done
  2    bad arguments, checkpoint, length or --out folder (one line on stderr)
  130  interrupted (Ctrl-C)"""


def check_out(out: str) -> None:
    """``ValueError`` naming ``--out`` unless it is (or can be created as) a writable folder."""
    from mtraining_jax.train.rundir import check_dir

    check_dir("--out", out, create=False)


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _words(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _mesh(s: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in s.lower().split("x"))
        return a, b
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh must look like NODExLOCAL (e.g. 1x8), got {s!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtraining-eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXIT_CODES)
    p.add_argument("checkpoint", nargs="?", help="run dir, checkpoints/<step>, converter output or HF dir")
    p.add_argument("--compare", nargs=2, metavar=("RUN_A", "RUN_B"), help="compare two results dirs / results.json")
    p.add_argument("--labels", type=_words, help="labels of the compared runs (default: folder names)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--lengths", type=_ints, default=[1024, 2048], help="context lengths (NIAH, RULER)")
    p.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths in [0, 1]")
    p.add_argument("--samples", type=int, default=4, help="examples per NIAH cell (0: skip)")
    p.add_argument("--tasks", type=_words, default=["multikey", "multivalue", "vartrack"], help="RULER-style tasks")
    p.add_argument("--ruler-samples", type=int, default=4, help="examples per RULER task and length (0: skip)")
    p.add_argument("--ppl-len", type=int, help="perplexity-by-position length (default: the largest --lengths)")
    p.add_argument("--ppl-windows", type=int, default=4, help="held-out windows for perplexity (0: skip)")
    p.add_argument("--buckets", type=int, default=16, help="position buckets")
    p.add_argument("--recall-p", type=_floats, default=[0.9, 0.5], help="top-p values of the index recall ('' : skip)")
    p.add_argument("--recall-rows", type=int, default=512, help="query rows sampled for the recall")
    p.add_argument("--haystack", choices=["filler", "heldout"], default="filler")
    p.add_argument("--data", default="stdlib", help="held-out data when the checkpoint is not a run: stdlib, "
                   "a .npy/.bin token file or a .txt/.jsonl text file (a run uses its own held-out split)")
    p.add_argument("--tokenizer", help="tokenizer ('byte' or a tokenizers JSON; default: the run's, else byte)")
    p.add_argument("--backend", help="attention backend of every layer (reference, cudnn, ring, mtraining)")
    p.add_argument("--dense-layers", type=_ints, help="layers on the dense backend (with --backend mtraining)")
    p.add_argument("--dtype", help="compute dtype (float32, bfloat16)")
    p.add_argument("--impl", choices=KERNEL_IMPLS, help="kernel implementation (pallas_kernels.registry)")
    p.add_argument("--mesh", type=_mesh, help="NODExLOCAL context-parallel mesh (default: the run's, else 1x1)")
    p.add_argument("--cpu-devices", type=int, help="run on CPU with this many virtual devices")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="task generation seed")
    p.add_argument("--label", help="name of this run in plots (default: the checkpoint folder name)")
    p.add_argument("--no-progress", action="store_true")
    return p


def _run_yaml(path: str) -> dict:
    """The run's ``config.yaml`` as a dict (``{}`` when the path is not a run), read without JAX."""
    import yaml

    for cand in (os.path.join(path, "config.yaml"), os.path.join(path, "..", "..", "config.yaml")):
        if os.path.isfile(cand) and os.path.isdir(os.path.join(os.path.dirname(cand), "checkpoints")):
            with open(cand) as f:
                return yaml.safe_load(f) or {}
    return {}


def heldout_stream(loaded, data: str, tokenizer):
    """The held-out token stream: the run's own split, else ``data`` (see ``--data``)."""
    from mtraining_jax.train import data as data_lib

    if loaded.train_config is not None and loaded.train_config.data.source != "passkey":
        return data_lib.build_streams(loaded.train_config.data, tokenizer)[1]
    if data == "stdlib":
        return data_lib.stdlib_streams(tokenizer)[1]
    if data.endswith((".txt", ".jsonl")):
        return data_lib.text_stream(data, tokenizer)
    return data_lib.token_file_stream(data, "uint32" if tokenizer.vocab_size >= 2**16 else "uint16")


def _compare(args) -> int:
    from mtraining_jax.eval.compare import compare_results, load_results

    labels = args.labels or [os.path.basename(os.path.normpath(p)) for p in args.compare]
    if len(labels) != 2:
        raise ValueError(f"--labels needs two names, got {labels}")
    runs = [(lab, load_results(p)) for lab, p in zip(labels, args.compare)]
    for f in compare_results(runs, args.out):
        print(f)
    return 0


def _evaluate(args) -> int:
    run = _run_yaml(args.checkpoint)
    cpu = args.cpu_devices or (run.get("mesh") or {}).get("cpu_devices")
    if cpu:
        from mtraining_jax.train.cli import setup_platform

        setup_platform(int(cpu))
    from mtraining_jax.eval.api import EvalSpec, check_spec, evaluate_params
    from mtraining_jax.eval.checkpoints import load_for_eval
    from mtraining_jax.mesh import num_cp_ranks
    from mtraining_jax.train.config import MeshConfig
    from mtraining_jax.train.loop import build_mesh
    from mtraining_jax.train.tokenizer import load_tokenizer

    spec = EvalSpec(lengths=args.lengths, depths=args.depths, samples=args.samples, ruler_tasks=args.tasks,
                    ruler_samples=args.ruler_samples, ppl_len=args.ppl_len, ppl_windows=args.ppl_windows,
                    ppl_buckets=args.buckets, recall_ps=args.recall_p, recall_rows=args.recall_rows,
                    haystack=args.haystack, batch_size=args.batch_size, seed=args.seed)
    over = {k: v for k, v in (("attention_backend", args.backend), ("dtype", args.dtype),
                              ("attention_impl", args.impl)) if v is not None}
    if args.dense_layers is not None:
        over["dense_layers"] = tuple(args.dense_layers)
    loaded = load_for_eval(args.checkpoint, args.tokenizer, **over)
    shape = args.mesh or tuple((run.get("mesh") or {}).get("shape") or (1, 1))
    mesh = build_mesh(MeshConfig(shape=tuple(shape)))
    check_spec(loaded.config, spec, num_cp_ranks(mesh))  # lengths vs RoPE range and layout, before any work
    tok = load_tokenizer(loaded.tokenizer)
    needs_data = args.haystack == "heldout" or (args.ppl_windows and spec.perplexity_len) or args.recall_p
    held = heldout_stream(loaded, args.data, tok) if needs_data else None
    label = args.label or os.path.basename(os.path.normpath(args.checkpoint))
    print(f"evaluating {loaded.source}: {loaded.config.num_params():,} parameters, backends "
          f"{sorted(set(loaded.config.layer_backends))}, mesh {dict(mesh.shape)}", file=sys.stderr)
    res = evaluate_params(loaded.config, loaded.params, tok, spec, mesh=mesh, heldout=held, out_dir=args.out,
                          label=label, progress=not args.no_progress)
    from mtraining_jax.eval.compare import markdown_table

    print(markdown_table([(label, res)]), end="")
    print(f"wrote {os.path.join(args.out, 'results.json')} and plots")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if (args.checkpoint is None) == (args.compare is None):
        p.error("give either CHECKPOINT or --compare RUN_A RUN_B")
    try:
        check_out(args.out)  # before any work
        return _compare(args) if args.compare else _evaluate(args)
    except (ValueError, OSError) as e:
        print(f"mtraining-eval: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mtraining-eval: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
