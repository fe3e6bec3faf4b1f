"""Megatron-LM's model confs for Qwen3-235B-A22B, DeepSeek-R1 and Kimi-K2
(examples/post_training/modelopt/conf at core_v0.19.0, their MODEL_ARGS words in
tests/data/megatron_moe_functional_configs.json) parse at full size and train at tiny size.

Substitutions: the HuggingFace tokenizer -> NullTokenizer on --mock-data (no download), and the
training flags a model conf leaves to its launcher (--train-iters, --lr)."""

import json
import os

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._train_cases import run_pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "tests", "data", "megatron_moe_functional_configs.json")) as f:
    CONFS = json.load(f)["model_confs"]
TRAINING = ["--train-iters", "2", "--lr", "1e-4", "--mock-data", "--log-interval", "1",
            "--eval-iters", "1", "--eval-interval", "1000"]
TINY = {"--num-layers": "2", "--hidden-size": "32", "--ffn-hidden-size": "64",
        "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "8",
        "--num-experts": "4", "--moe-ffn-hidden-size": "32", "--moe-router-topk": "2",
        "--moe-shared-expert-intermediate-size": "32", "--moe-layer-freq": "([0]*1+[1]*1)",
        "--moe-router-num-groups": "2", "--moe-router-group-topk": "1", "--seq-length": "32",
        "--max-position-embeddings": "64", "--kv-lora-rank": "16", "--q-lora-rank": "16",
        "--qk-head-dim": "8", "--qk-pos-emb-head-dim": "8", "--v-head-dim": "8"}


def _argv(conf, sizes=None):
    words = list(CONFS[conf])
    out = []
    i = 0
    while i < len(words):
        word = words[i]
        takes_value = i + 1 < len(words) and not words[i + 1].startswith("--")
        value = words[i + 1] if takes_value else None
        if word == "--tokenizer-type":
            value = "NullTokenizer"
        if sizes and word in sizes:
            value = sizes[word]
        out += [word] + ([value] if value is not None else [])
        i += 2 if takes_value else 1
    return out + ["--vocab-size", "256"] + TRAINING


@pytest.mark.parametrize("conf", sorted(CONFS))
def test_conf_parses_at_full_size(conf):
    from megatron_moe.arguments import parse_args

    args = parse_args(_argv(conf), world_size=8)
    assert args.num_layers in (61, 94) and args.num_experts in (128, 256, 384)
    assert "moe" in (args.recompute_modules or []) or args.moe_layer_recompute


@pytest.mark.parametrize("conf", sorted(CONFS))
def test_conf_trains_at_tiny_size(conf):
    argv = _argv(conf, TINY) + ["--expert-model-parallel-size", "2"]
    histories = run_distributed(run_pretrain, 2, argv, timeout_s=400)
    losses = histories[0]["lm_loss"]
    assert len(losses) == 2 and all(l == l for l in losses)
