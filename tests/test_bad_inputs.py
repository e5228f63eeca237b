"""A new user's bad input, through the real console script: every case exits 2 before any
process starts, with no traceback and one line that names the flag. The table of inputs and
their messages is written to docs/bad_inputs.md (temporary paths shown as <tmp>), with the rows
of Megatron-LM's patched pretrain_gpt.py (tests/test_pretrain_gpt.py's ``BAD_LINES``, run there
the same way: Megatron-LM's parser with our checks, exit status 2 and one line)."""

from __future__ import annotations

import shlex
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cli_runner import run_cli

ROOT = Path(__file__).resolve().parents[1]

# (arguments, the flag the message must name); <tmp> is a scratch folder holding the files below
CASES: list[tuple[str, str]] = [
    ("train --pp-schedule no-such", "--pp-schedule"),
    ("train --num-layers 3", "--num-layers"),
    ("train --num-layers 0", "--num-layers"),
    ("train --microbatches 0", "--microbatches"),
    ("train --train-iters 0", "--train-iters"),
    ("train --train-iters -1", "--train-iters"),
    ("train --micro-batch-size 0", "--micro-batch-size"),
    ("train --seq-length 0", "--seq-length"),
    ("train --lr -1", "--lr"),
    ("train --clip-grad -1", "--clip-grad"),
    ("train --global-batch-size 7", "--global-batch-size"),
    ("train --data /nonexistent/corpus.txt", "--data"),
    ("train --data <tmp>", "--data"),
    ("train --save /proc/forbidden", "--save"),
    ("train --save <tmp>/a-file.txt", "--save"),
    ("train --load /nonexistent/checkpoints", "--load"),
    ("train --load <tmp>", "--load"),
    ("train --load <tmp>/a-file.txt", "--load"),
    ("train --ckpt-step 5", "--ckpt-step"),
    ("train --save-interval 5", "--save-interval"),
    ("train --pp-zb-costs 1,x", "--pp-zb-costs"),
    ("train --overlap-moe-expert-parallel-comm", "--overlap-moe-expert-parallel-comm"),
    (
        "train --num-experts 4 --expert-model-parallel-size 2 --data-parallel-size 2 "
        "--overlap-moe-expert-parallel-comm",
        "--overlap-moe-expert-parallel-comm",
    ),
    ("train --pp-timeline timeline.txt", "--pp-timeline"),
    ("train --use-pytorch-profiler", "--use-pytorch-profiler"),
    ("train --normalization LayerNorm", "--normalization"),
    ("train --num-query-groups 2", "--num-query-groups"),
    (
        "train --pp-chunks 2 --num-virtual-stages-per-pipeline-rank 3",
        "--num-virtual-stages-per-pipeline-rank",
    ),
    ("train --decoder-first-pipeline-num-layers 3", "--decoder-first-pipeline-num-layers"),
    ("train --pipeline-model-parallel-layout 'Et|t|t|t|t|t|t|tL'", "--pipeline-model-parallel-layout"),
    (
        "train --pipeline-model-parallel-layout 'E|tt|tt|t|t||tt|L' --pp-schedule interleaved-1f1b",
        "--pipeline-model-parallel-layout",
    ),
    ("train --hidden-size 60", "--hidden-size"),
    ("train --max-position-embeddings 64", "--max-position-embeddings"),
    ("train --hidden-dropout 0.1", "--hidden-dropout"),
    ("train --config no-such-config", "--config"),
    ("train --config <tmp>/broken.yaml", "--config"),
    ("train --config <tmp>/a-list.yaml", "--config"),
    ("train --sequence-parallel", "--sequence-parallel"),
    ("train --tensor-model-parallel-size 0", "--tensor-model-parallel-size"),
    ("train --context-parallel-size 3", "--context-parallel-size"),
    ("train --pp-seq-slices 0", "--pp-seq-slices"),
    ("train --pp-schedule slimpipe --pp-seq-slices 3", "--pp-seq-slices"),
    ("train --pp-attn-redistribution 0.5", "--pp-attn-redistribution"),
    ("train --pp-attn-redistribution 2 --pp-schedule slimpipe --pp-seq-slices 4", "--pp-attn-redistribution"),
    ("train --pp-offload sideways", "--pp-offload"),
    ("train --pp-vocab-parallel vocab-3", "--pp-vocab-parallel"),
    ("train --pp-post-validation-chain up", "--pp-post-validation-chain"),
    ("train --pp-p2p-timeout 0", "--pp-p2p-timeout"),
    ("train --transformer-impl transformer_engine", "--transformer-impl"),
    ("train --distributed-backend nccl", "--distributed-backend"),
    ("train --log-interval 0", "--log-interval"),
    ("train --data-path /nonexistent/text_doc --tokenizer-type NullTokenizer --vocab-size 9", "--data-path"),
    ("train --data <tmp>/a-file.txt --mock-data --tokenizer-type NullTokenizer --vocab-size 100", "--data"),
    ("train --mock-data", "--tokenizer-type"),
    ("train --mock-data --tokenizer-type NullTokenizer", "--vocab-size"),
    ("train --mock-data --tokenizer-type HuggingFaceTokenizer --tokenizer-model <tmp>", "--tokenizer-model"),
    ("train --mock-data --tokenizer-type HuggingFaceTokenizer", "--tokenizer-model"),
    ("train --mock-data --tokenizer-type SentencePieceTokenizer --tokenizer-model <tmp>", "--tokenizer-type"),
    ("train --split 98,2,0", "--split"),
    ("train --eval-interval 0", "--eval-interval"),
    ("train --eval-iters 5", "--eval-iters"),
    ("train --mock-data --split 98,2,0 --tokenizer-type NullTokenizer --vocab-size 100", "--split"),
    ("train --moe-router-topk 2", "--num-experts"),
    ("train --num-experts 4 --moe-router-topk 5", "--moe-router-topk"),
    (
        "train --num-experts 3 --expert-model-parallel-size 2 --data-parallel-size 2",
        "--expert-model-parallel-size",
    ),
    ("train --num-experts 4 --expert-model-parallel-size 2", "--expert-model-parallel-size"),
    ("train --num-experts 4 --moe-grouped-gemm", "--moe-grouped-gemm"),
    (
        "train --num-experts 4 --tensor-model-parallel-size 2 --sequence-parallel "
        "--expert-tensor-parallel-size 1",
        "--expert-tensor-parallel-size",
    ),
    ("train --num-experts 4 --tensor-model-parallel-size 2", "--sequence-parallel"),
    ("train --num-experts 4 --moe-token-dispatcher-type flex", "--moe-token-dispatcher-type"),
    ("train --pp-optimizer megatron", "--pp-optimizer"),
    ("train --num-experts 4 --moe-layer-freq '([0]*2+[1]*3)'", "--moe-layer-freq"),
    ("train --num-experts 4 --moe-layer-freq '([0]+[2]*7)'", "--moe-layer-freq"),
    (
        "train --num-experts 4 --moe-aux-loss-coeff 0.01 --moe-router-load-balancing-type seq_aux_loss "
        "--pp-schedule seq1f1b --pp-seq-slices 2",
        "--moe-router-load-balancing-type",
    ),
    (
        "train --num-experts 4 --expert-model-parallel-size 2 --data-parallel-size 2 --pp-post-validation",
        "--pp-post-validation",
    ),
    ("plan --gpus 8 --model tiny-mixtral --expert-model-parallel-size 3", "--expert-model-parallel-size"),
    ("plan --gpus 8 --model tiny-mixtral --pp-moe-imbalance 0.9", "--pp-moe-imbalance"),
    ("plan --gpus 8 --model llama2-7b --moe-ffn-hidden-size 512", "--moe-ffn-hidden-size"),
    ("simulate --model tiny-deepseek --expert-model-parallel-size 3", "--expert-model-parallel-size"),
    ("simulate --schedule no-such --pp 4 --microbatches 8", "--schedule"),
    ("simulate --model llama-7b --pp-expert-comm 1", "--pp-expert-comm"),
    (
        "simulate --schedule dualpipev --overlap-moe-expert-parallel-comm --pp-offload full",
        "--overlap-moe-expert-parallel-comm",
    ),
    ("simulate --schedule 1f1b --pp 0 --microbatches 4", "--pp"),
    ("simulate --schedule 1f1b --pp 4 --microbatches 0", "--microbatches"),
    ("simulate --schedule-file /nonexistent/schedule.txt", "--schedule-file"),
    ("simulate --schedule-file <tmp>/empty.txt", "--schedule-file"),
    ("simulate --schedule-file <tmp>/bad-op.txt", "--schedule-file"),
    ("plan --gpus 0 --model llama2-7b", "--gpus"),
    ("plan --gpus 8 --model no-such-model", "--model"),
    ("plan --gpus 8 --model llama2-7b --gpu no-such-gpu", "--gpu"),
    ("plan --gpus 8 --model llama2-7b --seq-length 0", "--seq-length"),
    ("bench --pp 1", "--pp"),
    ("bench --iterations 0", "--iterations"),
    ("bench --schedules no-such", "--schedules"),
    ("bench --timeout -1", "--timeout"),
    ("bench --against megatron --iterations 3", "--iterations"),
    ("bench --pp-seq-slices 0", "--pp-seq-slices"),
    ("bench --against deepspeed", "--against"),
    ("bench --emulate 20,abc,20", "--emulate"),
    ("bench --emulate 20,20,20 --emulate-skew 1,1,1", "--emulate-skew"),
]


def _scratch(folder: Path) -> None:
    (folder / "a-file.txt").write_text("not a directory\n")
    (folder / "broken.yaml").write_text("model: [\n")
    (folder / "a-list.yaml").write_text("- one\n- two\n")
    (folder / "empty.txt").write_text("")
    (folder / "bad-op.txt").write_text("pp: 2\nmicrobatches: 2\nrank 0: F0:0 XX\nrank 1: F1:0\n")
    (folder / "leftover.txt").write_text("a folder with files but no checkpoint\n")


def _run(args: str, scratch: Path) -> tuple[int, str]:
    argv = shlex.split(args.replace("<tmp>", str(scratch)))  # a layout's "|" stays quoted
    done = run_cli(argv, timeout=300)
    return done.returncode, done.stderr


def _pretrain_gpt(scratch: Path) -> list[tuple[tuple[str, str], tuple[int, str]]] | None:
    """((input, flag), (exit status, stderr)) of each of test_pretrain_gpt's ``BAD_LINES``; None
    without Megatron-LM's tree or its training dependencies."""
    import importlib.util

    from test_pretrain_gpt import BAD_LINES, TRAINING_DEPS, TREE, make_patched_tree, run_pretrain_lines

    if not TREE.is_dir() or any(importlib.util.find_spec(package) is None for package in TRAINING_DEPS):
        return None
    tree = make_patched_tree(scratch / "megatron-lm")
    results = run_pretrain_lines(tree, [(flags, None) for flags, _ in BAD_LINES])
    return [
        ((f"pretrain_gpt.py <tiny> {flags}", flag), result)
        for (flags, flag), result in zip(BAD_LINES, results)
    ]


@pytest.mark.slow
def test_every_bad_input_is_one_line_naming_its_flag_and_exit_2(tmp_path: Path, tier: str) -> None:
    """The full tier writes docs/bad_inputs.md; the quick one (where test_pretrain_gpt.py runs
    the pretrain_gpt.py lines) checks that each of our rows is in it as written."""
    _scratch(tmp_path)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda case: _run(case[0], tmp_path), CASES))
    assert len(CASES) >= 40
    pretrain_gpt = _pretrain_gpt(tmp_path / "pretrain_gpt") if tier == "full" else None
    rows, problems = [], []
    for (args, flag), (code, stderr) in [*zip(CASES, results), *(pretrain_gpt or [])]:
        last = (stderr.strip().splitlines() or [""])[-1]
        if code != 2 or "Traceback" in stderr or flag not in last or " error: " not in last:
            problems.append(
                f"{args}: exit {code}, last line {last!r}{' (traceback)' if 'Traceback' in stderr else ''}"
            )
        shown = args.replace("|", "\\|")  # a layout's stage separator, escaped in the table
        rows.append(f"| `{shown}` | {code} | {last.replace(str(tmp_path), '<tmp>').replace('|', '/')} |")
    table = "\n".join(
        [
            "# Bad input: what a user gets",
            "",
            "Written by `tests/test_bad_inputs.py` (each line is the last line of stderr; every case",
            "exits 2 before any process starts, with no traceback). `<tmp>` is the test's scratch folder.",
            "",
            "`pretrain_gpt.py` rows: Megatron-LM's `pretrain_gpt.py` with our patch (`patches/`), its",
            "processes started as `torchrun --nproc-per-node 4` starts them (`WORLD_SIZE=4`); `<tiny>` is",
            "`TIED` in `tests/test_pretrain_gpt.py`, a small model with tied embeddings (Megatron's",
            "default). Our checks run in Megatron-LM's argument parser, before torch.distributed starts:",
            "each process prints the parser's usage and this line (torchrun then adds its own summary).",
            "",
            "| input | exit | message |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )
    assert not problems, "\n".join(problems)
    written = (ROOT / "docs" / "bad_inputs.md").read_text()
    if tier != "full":
        stale = [row for row in rows if row not in written.splitlines()]
        assert not stale, "docs/bad_inputs.md is out of date (--tier full rewrites it):\n" + "\n".join(stale)
    elif pretrain_gpt is None:  # the table is written whole or not at all
        pytest.skip("no Megatron-LM tree or its training deps: docs/bad_inputs.md not rewritten")
    else:
        (ROOT / "docs" / "bad_inputs.md").write_text(table)
