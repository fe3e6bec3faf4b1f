"""Megatron-LM's own Mixtral launch configuration (examples/mixtral/train_mixtral_8x7b_distributed.sh
at core_v0.16.1, its flag arrays below) with only the sizes overridden, on 2 CPU ranks with
pretrain_gpt_moe.py: trains, saves, resumes exactly and generates with tools/generate.py. Its
--moe-grouped-gemm runs without Transformer Engine as torch grouped_mm experts
(megatron_moe/moe/grouped_experts.py).

Substitutions, each stated: --split 99990,8,2 becomes 98,2,0 for the 120-document corpus (a data
size: Megatron's split leaves it no validation document). The exact resume runs without the
script's --no-load-optim --no-load-rng (with them Megatron loads weights only, by
design not an exact resume); it keeps the distributed optimizer, whose Adam state resumes on CPU
through compat/distrib_optimizer.py. The configuration as Megatron wrote it (with
--no-load-optim --no-load-rng) then continues from that checkpoint, loading the weights as the
script asks.
"""

import functools
import os
import shutil

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _data_helpers as H
from tests._ckpt_cases import run_pretrain_steps
from tests._train_cases import generate_cli


# Megatron-LM's arrays, verbatim flag names and values (core_v0.16.1)
MODEL_ARGS = """--use-mcore-models --disable-bias-linear --seq-length 4096
    --max-position-embeddings 32768 --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0
    --normalization RMSNorm --position-embedding-type rope --swiglu
    --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8
    --no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000"""
MOE_ARGS = """--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    --overlap-param-gather --overlap-grad-reduce"""
DATA_ARGS = """--tokenizer-type Llama2Tokenizer --tokenizer-model TOKENIZER_MODEL
    --data-path DATA_PATH --split 99990,8,2"""
TRAINING_ARGS = """--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000
    --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1
    --lr-warmup-iters 500 --clip-grad 1.0 --bf16"""
MODEL_PARALLEL_ARGS = """--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
    --expert-model-parallel-size 8 --use-distributed-optimizer --sequence-parallel"""
LOGGING_ARGS = """--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
    --save CHECKPOINT_PATH --load CHECKPOINT_PATH --tensorboard-dir CHECKPOINT_PATH/tensorboard
    --no-load-optim --no-load-rng"""

ITERS = 4
SIZES = {  # the only values changed: a 2-layer model on 2 CPU ranks for ITERS iterations
    "--seq-length": "64", "--max-position-embeddings": "256", "--num-layers": "2",
    "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
    "--num-query-groups": "2", "--global-batch-size": "8", "--train-iters": str(ITERS),
    "--lr-decay-iters": str(ITERS), "--lr-warmup-iters": "1", "--pipeline-model-parallel-size": "1",
    "--expert-model-parallel-size": "2", "--save-interval": str(ITERS),
    # 99990,8,2 assumes a corpus of >= 1e5 documents: on the 120-document test corpus the
    # validation split would hold no document (megatron-core's index builder then never ends)
    "--split": "98,2,0",
}
DROPPED = set()                           # no flag dropped (--moe-grouped-gemm: torch grouped_mm)


def mixtral_argv(paths, drop=()):
    argv = []
    for block in (MODEL_ARGS, MOE_ARGS, DATA_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS, LOGGING_ARGS):
        for word in block.split():
            for key, value in paths.items():
                word = word.replace(key, value)
            argv.append(word)
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        takes = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        value = argv[i + 1] if takes else None
        i += 2 if takes else 1
        if flag in DROPPED or flag in drop:
            continue
        out += [flag] + ([SIZES.get(flag, value)] if takes else [])
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixtral")
    data, tok = H.sp_dataset(str(d), max_docs=120, vocab_size=500,
                             tokenizer_type="Llama2Tokenizer")
    return dict(dir=d, tok=tok, data=data)


def test_the_configuration_is_megatrons_with_only_sizes_changed(data):
    argv = mixtral_argv({"TOKENIZER_MODEL": data["tok"], "DATA_PATH": data["data"],
                         "CHECKPOINT_PATH": "/c"})
    original = " ".join(" ".join(b.split()) for b in (MODEL_ARGS, MOE_ARGS, DATA_ARGS,
                                                      TRAINING_ARGS, MODEL_PARALLEL_ARGS,
                                                      LOGGING_ARGS)).split()
    flags_in = [w for w in original if w.startswith("--")]
    flags_out = [w for w in argv if w.startswith("--")]
    assert flags_out == [f for f in flags_in if f not in DROPPED]
    # --moe-grouped-gemm on the local path: torch grouped_mm experts, megatron-core's flag off
    from megatron_moe.arguments import parse_args
    from megatron_moe.moe.grouped_experts import local_grouped

    assert "--moe-grouped-gemm" in argv
    args = parse_args(argv, world_size=2, check_data_paths=False)
    assert args.transformer_impl == "local" and local_grouped(args)


EXACT_DROP = ("--no-load-optim", "--no-load-rng")


def test_trains_saves_resumes_exactly_and_generates(data):
    def argv(ckpt, drop=EXACT_DROP, extra=()):
        return mixtral_argv({"TOKENIZER_MODEL": data["tok"], "DATA_PATH": data["data"],
                             "CHECKPOINT_PATH": ckpt}, drop) + list(extra)

    ckpt = str(data["dir"] / "ckpt")
    half = ITERS // 2
    weights_only = str(data["dir"] / "weights_only")
    # the four runs one after the other in the same two ranks (one process start for all): the
    # full run, the run to --exit-interval, its resume, and Megatron's configuration continuing
    # from a copy of the half-way checkpoint (rank 0 copies it before the resume)
    runs = run_distributed(run_pretrain_steps, 2, [
        {"argv": argv(str(data["dir"] / "full"))},
        {"argv": argv(ckpt, extra=["--exit-interval", str(half)])},
        {"argv": argv(ckpt), "prepare": functools.partial(shutil.copytree, ckpt, weights_only)},
        {"argv": argv(weights_only, drop=())},
    ], timeout_s=600)[0]
    for run in runs:
        assert run["exit"] in (0, None) and run["history"] is not None, run["text"][-3000:]
    full, first, second, megatron = (run["history"] for run in runs)
    losses = full["lm_loss"]
    # Megatron's learning rate (1e-4) over 4 steps: the loss moves, it need not fall far
    assert all(l == l for l in losses) and len(set(losses)) == ITERS, losses
    assert os.path.isdir(os.path.join(weights_only, f"iter_{half:07d}"))
    assert second["iteration"][0] == half + 1
    assert first["lm_loss"] + second["lm_loss"] == losses
    assert first["grad_norm"] + second["grad_norm"] == full["grad_norm"]

    # Megatron's configuration unchanged but for the sizes: loads the weights, continues
    assert megatron["iteration"][0] == half + 1
    # its first step sees the same weights and data: the same loss, up to summation order
    assert megatron["lm_loss"][0] == pytest.approx(losses[half], rel=1e-3)

    text, logps = generate_cli(ckpt, "The module", tokens=6)
    assert 1 <= len(logps) <= 6 and all(v <= 0 for v in logps), (text, logps)
