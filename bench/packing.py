"""Instruction tuning's packing: how much padding --pack saves, and what the recipe costs on top of a bare loop.

    python bench/packing.py --out runs/bench-packing            # ~5 minutes here (7 repeats): make bench-packing
    python bench/packing.py --quick --out /tmp/bench-packing     # seconds: what the tests run

The data: a word-level tokenizer with a chat template (made here, nothing downloaded) and --conversations
prompt/answer pairs whose lengths are long-tailed as instruction data sets' are (log-normal prompts and answers,
the longest dropped by prepare.py --chat as the recipe would see them), prepared for --seq-len. The runs, one
process each with one thread, alternated (padded, packed, bare; then padded, bare, packed; --repeats times):

- padded: recipes/ddp on the data, one conversation per window (the default);
- packed: the same with --pack (whole conversations packed into each window, attention kept within each);
- bare:   bench/bare_loop.py on the very same packed batches (the GPT's forward with positions, backward,
          AdamW): what a minimal script does, against which the recipe's overhead is measured (goal >= 0.97).

Figures: windows per epoch and how full they are (fill: the share of a window's tokens that are conversation,
not padding); conversation tokens per second (steady samples/s x window x fill), packed against padded (the
speed-up the scientist sees: the same data in fewer windows); packed recipe against the bare loop (samples/s).
The packed run and the bare loop must train the same model (their losses within 1e-6). Writes OUT/packing.json
and OUT/packing.md (bench/packing.md is the last full run's, included in docs/instruction-tuning.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from run import in_turn, max_rel_diff, ratio_summary, run, steady_samples_per_s, WARMUP_STEPS  # noqa: E402

SPECIALS = ["<unk>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
OVERHEAD_TARGET = 0.97


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs") / "bench-packing")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: seconds (the tests)")
    p.add_argument("--seq-len", type=int, default=None, help="the window (default 512; --quick 128)")
    p.add_argument("--conversations", type=int, default=None, help="how many (default 600; --quick 80)")
    p.add_argument("--repeats", type=int, default=None, help="alternated repeats (default 7; --quick 1)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 40; --quick 6)")
    args = p.parse_args(argv)
    defaults = (128, 80, 1, 6) if args.quick else (512, 600, 7, 40)
    for name, value in zip(("seq_len", "conversations", "repeats", "steps"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def make_data(args: argparse.Namespace) -> tuple[Path, int, dict]:
    """The tokenizer directory, the conversations and prepare.py --chat's token file: (prefix, vocabulary size,
    the length distribution used)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [f"w{i}" for i in range(1000)]
    model_dir = args.out / "tokenizer"
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|end|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(model_dir)

    # Long-tailed lengths, scaled to the window: median prompt ~ window/12 words, median answer ~ window/8
    rng = np.random.default_rng(0)
    shape = {"prompt_median_words": args.seq_len / 12, "answer_median_words": args.seq_len / 8, "sigma": 0.9}
    lines = []
    for _ in range(args.conversations):
        prompt, answer = (max(1, int(rng.lognormal(np.log(shape[key]), shape["sigma"])))
                          for key in ("prompt_median_words", "answer_median_words"))
        text = lambda n: " ".join(f"w{i}" for i in rng.integers(0, 1000, n))  # noqa: E731
        lines.append(json.dumps({"prompt": text(prompt), "completion": text(answer)}))
    jsonl = args.out / "conversations.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    prefix = args.out / "sft" / "tokens"
    run([sys.executable, str(REPO / "recipes" / "data" / "prepare.py"), "--chat", str(model_dir), "--out", str(prefix),
         "--seq-len", str(args.seq_len), "--valid-fraction", "0.05", str(jsonl)])
    return prefix, len(words), shape


def recipe(args, work: Path, name: str, data: Path, model: list[str], pack: bool) -> dict:
    out = work / name
    run([sys.executable, str(REPO / "recipes" / "ddp" / "train.py"), "--out-dir", str(out), "--no-resume",
         "--checkpoint-every", "0", "--log-every", "1000", "--data", str(data), *model, "--max-steps", str(args.steps),
         *(["--pack"] if pack else [])])
    metrics = json.loads((out / "metrics.json").read_text())
    return {"samples_per_s": steady_samples_per_s(metrics["history"]), "losses": [r["loss"] for r in metrics["history"]],
            "windows": metrics["conversations"]}


def bare(args, work: Path, name: str, data: Path, model: list[str]) -> dict:
    out = work / f"{name}.json"
    run([sys.executable, str(REPO / "bench" / "bare_loop.py"), "--out", str(out), "--data", str(data), "--pack",
         *model, "--max-steps", str(args.steps)])
    history = json.loads(out.read_text())["history"]
    return {"samples_per_s": steady_samples_per_s(history), "losses": [r["loss"] for r in history]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data, vocab, shape = make_data(args)
    width = 64 if args.quick else 128
    model = ["--seq-len", str(args.seq_len), "--vocab-size", str(vocab), "--n-layer", "2", "--n-head", "4",
             "--n-embd", str(width), "--global-batch", "4" if args.quick else "8"]
    work = args.out / "runs"
    padded_runs, packed_runs, bare_runs = [], [], []
    for i in range(args.repeats):  # alternated: a slow phase of a shared machine hits all three alike
        padded_runs.append(recipe(args, work, f"padded-{i}", data, model, pack=False))
        packed, bare_loop = in_turn(i, lambda: recipe(args, work, f"packed-{i}", data, model, pack=True),
                                    lambda: bare(args, work, f"bare-{i}", data, model))  # (bare first when i is odd)
        packed_runs.append(packed)
        bare_runs.append(bare_loop)
    window = args.seq_len + 1
    padded_windows, packed_windows = padded_runs[0]["windows"], packed_runs[0]["windows"]

    def conversation_tokens_per_s(runs: list[dict], windows: dict) -> list[float]:
        return [r["samples_per_s"] * window * windows["fill"] for r in runs]

    speedup = ratio_summary(conversation_tokens_per_s(packed_runs, packed_windows),
                            conversation_tokens_per_s(padded_runs, padded_windows))
    overhead = ratio_summary([r["samples_per_s"] for r in packed_runs], [r["samples_per_s"] for r in bare_runs])
    result = {
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "quick": args.quick,
                 "host": platform.node(), "python": platform.python_version(), "threads_per_process": 1,
                 "repeats": args.repeats, "steps": args.steps, "warmup_steps_excluded": WARMUP_STEPS, "model_args": model},
        "data": {"conversations": args.conversations, "kept": padded_windows["conversations"], "seq_len": args.seq_len,
                 "lengths": shape, "windows_padded": padded_windows["windows"], "windows_packed": packed_windows["windows"],
                 "fill_padded": padded_windows["fill"], "fill_packed": packed_windows["fill"],
                 "padding_saved": round(1 - packed_windows["windows"] / padded_windows["windows"], 3)},
        "speedup": {**speedup, "what": "conversation tokens per second, packed / padded",
                    "packed_conversation_tokens_per_s": conversation_tokens_per_s(packed_runs, packed_windows),
                    "padded_conversation_tokens_per_s": conversation_tokens_per_s(padded_runs, padded_windows)},
        "overhead": {**overhead, "target": OVERHEAD_TARGET, "meets_target": overhead["ratio"] >= OVERHEAD_TARGET,
                     "what": "samples per second, the packed recipe / the bare loop on the same batches",
                     "recipe_samples_per_s": [r["samples_per_s"] for r in packed_runs],
                     "bare_samples_per_s": [r["samples_per_s"] for r in bare_runs],
                     "loss_max_rel_diff": max(max_rel_diff(r["losses"], b["losses"]) for r, b in zip(packed_runs, bare_runs))},
    }
    (args.out / "packing.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "packing.md").write_text(table(result))
    print(table(result), end="")
    return 0


def table(result: dict) -> str:
    data, speedup, overhead = result["data"], result["speedup"], result["overhead"]
    spread = lambda values: f"{min(values):.2f}-{max(values):.2f}"  # noqa: E731
    return (f"| {data['kept']} conversations, --seq-len {data['seq_len']} | padded | packed (`--pack`) |\n"
            f"|---|---:|---:|\n"
            f"| windows per epoch | {data['windows_padded']} | {data['windows_packed']} |\n"
            f"| fill (conversation tokens / window tokens) | {data['fill_padded']:.2f} | {data['fill_packed']:.2f} |\n"
            f"| conversation tokens/s (median of {len(speedup['ratios'])}) | "
            f"{statistics.median(speedup['padded_conversation_tokens_per_s']):.0f} | "
            f"{statistics.median(speedup['packed_conversation_tokens_per_s']):.0f} |\n\n"
            f"Packing saves {data['padding_saved']:.0%} of the windows: {speedup['ratio']:.2f}x the conversation tokens per "
            f"second (pairs {spread(speedup['ratios'])}). The packed recipe runs at {overhead['ratio']:.3f} of the bare loop "
            f"on the same batches (pairs {spread(overhead['ratios'])}; goal {overhead['target']}"
            f"{', met' if overhead['meets_target'] else ', not met'}), the same model trained (losses within "
            f"{overhead['loss_max_rel_diff']:.1e}). {result['meta']['steps']} steps per run, the first "
            f"{result['meta']['warmup_steps_excluded']} left out, one thread per process; {result['meta']['date'][:10]}.\n")


if __name__ == "__main__":
    sys.exit(main())
