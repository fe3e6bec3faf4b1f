"""A Megatron-FSDP checkpoint (--ckpt-format fsdp_dtensor) is usable without Megatron-FSDP.

One tiny Mixtral-like MoE (SwiGLU, --moe-grouped-gemm, 4 experts at EP=2, RMSNorm, rope, untied
output) trained with ZeRO-3 on 2 gloo ranks saves fsdp_dtensor at its last iteration; after that
step the trained Megatron-FSDP model itself gives the reference: its logits of fixed tokens and a
greedy decode. Then, all in fp32:

* our model without Megatron-FSDP, through load_checkpoint as the inference tools load (no
  optimizer, no scheduler), at DP=2, EP=2, TP=2 (experts split by tensor parallelism too) and
  TP=2 x EP=2 x ETP=1, every checkpoint tensor set to NaN first: the reference logits, no tensor
  left NaN, every stored tensor filled (counted); mutations: SwiGLU's halves re-joined the other
  way round (TP=2), or the experts' global numbers taken as local (EP=2): the logits differ;
* a checkpoint written at TP=2 (Megatron-FSDP over tensor parallelism) the same at each layout;
* tools/generate.py on one process: the reference's greedy tokens and their log probs;
  tools/evaluate.py: the training run's validation loss; the REST server: the greedy completion;
* tools/checkpoint/convert.py -> HF: transformers' Mixtral gives the reference logits; with the
  SwiGLU mutation it does not;
* training without Megatron-FSDP (DDP + distributed optimizer, at EP=2 and at PP=2, tied
  embeddings too) fine-tunes from the checkpoint (--finetune: weights only) with the losses of
  the Megatron-FSDP fine-tune from it; mutation: the second stage's layers not renumbered (a
  resume without Megatron-FSDP is refused in one line that names what works:
  tests/test_megatron_fsdp.py).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _fsdp_dtensor_export_cases as cases
from tests._train_cases import generate_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = dict(rtol=1e-5, atol=1e-5)
MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
         "--ffn-hidden-size 96 --seq-length 32 --max-position-embeddings 64 "
         "--position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --swiglu "
         "--untie-embeddings-and-output-weights --disable-bias-linear --num-experts 4 "
         "--moe-router-topk 2 --moe-aux-loss-coeff 0.01 --moe-token-dispatcher-type alltoall "
         "--moe-grouped-gemm --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 255 --log-interval 1 --eval-interval 1000 "
         "--eval-iters 1 --hidden-dropout 0 --attention-dropout 0").split()
FSDP = ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
        "--ckpt-format fsdp_dtensor").split()
EP2 = ["--expert-model-parallel-size", "2"]
TOKENS = torch.randint(0, 255, (2, 16), generator=torch.Generator().manual_seed(1)).tolist()
PROMPT = [3, 17, 42, 9, 100]
STEPS = 6
LAYOUTS = ["", "--expert-model-parallel-size 2",
           "--tensor-model-parallel-size 2 --sequence-parallel",
           "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2 "
           "--expert-tensor-parallel-size 1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint root, reference of rank 0) of the ZeRO-3 run, saved at iteration 2."""
    root = str(tmp_path_factory.mktemp("fsdp_export") / "ckpt")
    argv = MODEL + FSDP + EP2 + ["--train-iters", "2", "--save", root, "--save-interval", "2"]
    (losses, ref), (losses1, ref1) = run_distributed(cases.train_and_reference, 2, argv, TOKENS,
                                                  PROMPT, STEPS, timeout_s=300)
    assert losses == losses1 and len(losses) == 2
    ref["validation"] += ref1["validation"]   # printed by the last rank
    ref["logits"] = torch.from_numpy(ref["logits"])
    assert os.path.isfile(os.path.join(root, "iter_0000002", ".metadata"))
    assert not os.path.isfile(os.path.join(root, "iter_0000002", "metadata.json"))  # fsdp_dtensor
    return root, ref


def _load(root, layouts, mutate=None):
    argv = MODEL + ["--train-iters", "1", "--load", root]
    return [(*rest, torch.from_numpy(logits)) for *rest, logits in run_distributed(
        cases.load_logits, 2, argv, layouts, TOKENS, mutate, timeout_s=300)[0]]


def test_loads_into_every_layout_without_megatron_fsdp(trained):
    from megatron_moe.training.fsdp_dtensor_checkpoint import ModelWeights

    root, ref = trained
    stored = ModelWeights(os.path.join(root, "iter_0000002")).keys
    results = _load(root, LAYOUTS)
    for layout, (iteration, filled, tensors, nan, logits) in zip(LAYOUTS, results):
        assert iteration == 2, layout
        assert filled == tensors and nan == 0, (layout, filled, tensors, nan)
        torch.testing.assert_close(logits, ref["logits"], **TOL, msg=layout)
    # the whole model on one rank (DP=2): every stored tensor used, SwiGLU's halves as one
    assert results[0][1] == len(stored) == 2 * (5 + 4 * 2) + 3, sorted(stored)


def test_a_checkpoint_written_at_tp2_loads_at_every_layout(tmp_path):
    """Megatron-FSDP over TP=2 (sequence parallel) stores whole tensors too (its DTensors span
    the tensor-parallel ranks); the reader needs nothing else."""
    root = str(tmp_path / "ckpt")
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    (_, ref), _ = run_distributed(
        cases.train_and_reference, 2,
        MODEL + FSDP + tp2 + ["--train-iters", "2", "--save", root, "--save-interval", "2"],
        TOKENS, PROMPT, 0, timeout_s=300)
    ref["logits"] = torch.from_numpy(ref["logits"])
    for layout, (_, filled, tensors, nan, logits) in zip(LAYOUTS, _load(root, LAYOUTS)):
        assert filled == tensors and nan == 0, (layout, filled, tensors, nan)
        torch.testing.assert_close(logits, ref["logits"], **TOL, msg=layout)


@pytest.mark.parametrize("mutate, layout", [
    ("swiglu-swapped", "--tensor-model-parallel-size 2 --sequence-parallel"),
    ("experts-not-renumbered", "--expert-model-parallel-size 2"),
])
def test_load_mutations_change_the_logits(trained, mutate, layout):
    root, ref = trained
    [(_, filled, tensors, nan, logits)] = _load(root, [layout], mutate)
    assert filled == tensors and nan == 0
    assert not torch.allclose(logits, ref["logits"], **TOL)


def test_generate_cli_reads_it(trained):
    root, ref = trained
    text, logps = generate_cli(root, prompt=" ".join(map(str, PROMPT)), tokens=STEPS)
    tokens, ref_logps = ref["greedy"]
    assert text.split() == [str(t) for t in PROMPT + tokens], (text, tokens)
    # printed with 4 decimals
    assert logps == pytest.approx(ref_logps, abs=1e-4), (logps, ref_logps)


def test_evaluate_and_server_read_it(trained):
    """tools/evaluate.py gives the training run's own validation loss; the REST server
    answers the reference's greedy completion."""
    import re

    root, ref = trained
    (rc, printed), (rc_server, answer) = run_distributed(
        cases.evaluate_and_serve, 1, root, " ".join(map(str, PROMPT)), STEPS, timeout_s=300)[0]
    assert rc == 0 and rc_server == 0, (rc, rc_server, printed[-2000:])
    loss = lambda text: float(re.search(r"lm loss value: (\S+)", text).group(1))
    [line] = ref["validation"]
    # DP=2 ranks of Megatron-FSDP in training against one process here: summation order only
    assert loss(printed) == pytest.approx(loss(line), rel=1e-6), (printed, line)
    status, body = answer
    assert status == 200
    assert body["text"] == [" ".join(map(str, PROMPT + ref["greedy"][0]))], body


def _convert(root, out, mutate=None):
    code = ("import json, sys; sys.path.insert(0, 'tools/checkpoint'); import convert\n"
            "from tests import _fsdp_dtensor_export_cases as cases\n"
            "argv, mutate = json.loads(sys.argv[1])\n"
            "if mutate: cases.MUTATIONS[mutate]()\n"
            "convert.main(argv)")
    argv = ["--model-type", "GPT", "--loader", "megatron", "--saver", "hf", "--load-dir", root,
            "--save-dir", out]
    proc = subprocess.run([sys.executable, "-c", code, json.dumps([argv, mutate])], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _hf_logits(path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits


@pytest.mark.parametrize("mutate", [None, "swiglu-swapped"])
def test_converts_to_hf(trained, tmp_path, mutate):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    root, ref = trained
    log = _convert(root, str(tmp_path / "hf"), mutate)
    assert "MixtralForCausalLM" in log and "WARNING" not in log, log
    hf = _hf_logits(str(tmp_path / "hf"))
    ours = ref["logits"][..., :cases.TRUE_VOCAB]
    if mutate:
        assert not torch.allclose(hf, ours, **TOL)
    else:
        torch.testing.assert_close(hf, ours, **TOL)


def _train(argv, model=MODEL, mutate=None):
    """Rank 0's losses of a 2-rank training run."""
    return run_distributed(cases.train_and_reference, 2, model + argv, TOKENS, PROMPT, 0, mutate,
                           timeout_s=300)[0][0]


def _close(a, b, rel):
    return all(abs(x - y) <= rel * y for x, y in zip(a, b))


def test_ddp_finetunes_from_it_as_megatron_fsdp_does(trained):
    """Weights only (--finetune) into DDP + distributed optimizer at EP=2 and at PP=2 (the second
    stage's layers renumbered): the Megatron-FSDP fine-tune's losses."""
    root, _ = trained
    finetune = ["--train-iters", "2", "--load", root, "--finetune"]
    ddp = ["--use-distributed-optimizer"]
    fsdp = _train(FSDP + EP2 + finetune)
    same = _train(ddp + EP2 + finetune)
    assert len(set(fsdp)) == 2
    assert _close(same, fsdp, 1e-6), (same, fsdp)
    pp2 = _train(ddp + ["--pipeline-model-parallel-size", "2"] + finetune)
    # the first step's forward from the loaded weights; then another gradient reduction order
    assert _close(pp2[:1], fsdp, 1e-6) and _close(pp2, fsdp, 1e-4), (pp2, fsdp)
    # mutation: the second stage reads the first stage's layers
    wrong = _train(ddp + ["--pipeline-model-parallel-size", "2"] + finetune,
                   mutate="layers-not-renumbered")
    assert not _close(wrong[:1], fsdp, 1e-3), (wrong, fsdp)
    # not the losses of a fresh start: the weights were loaded
    fresh = _train(ddp + EP2 + ["--train-iters", "2"])
    assert abs(fresh[0] - same[0]) > 1e-3, (fresh, same)


def test_tied_embeddings_finetune_at_pp2(tmp_path):
    """Embedding and output layer tied: a one-stage save stores the embedding only; the last
    stage of PP=2 holds a copy of it as its output layer, read from the embedding."""
    root = str(tmp_path / "ckpt")
    tied = [a for a in MODEL if a != "--untie-embeddings-and-output-weights"]
    _train(FSDP + EP2 + ["--train-iters", "1", "--save", root, "--save-interval", "1"], tied)
    finetune = ["--train-iters", "2", "--load", root, "--finetune"]
    fsdp = _train(FSDP + EP2 + finetune, tied)
    pp2 = _train(["--use-distributed-optimizer", "--pipeline-model-parallel-size", "2"]
                 + finetune, tied)
    assert _close(pp2[:1], fsdp, 1e-6) and _close(pp2, fsdp, 1e-4), (pp2, fsdp)


def test_names_of_both_expert_layouts_and_stages():
    """TEGroupedMLP's ``linear_fc1.weight3`` and SequentialMLP's ``local_experts.3.linear_fc1
    .weight`` are one name; a stage's local layer and a rank's local expert get global numbers."""
    from megatron_moe.training.fsdp_dtensor_checkpoint import _canonical, _global_name

    grouped = "decoder.layers.1.mlp.experts.linear_fc1.weight3"
    assert _canonical(grouped) == "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert _global_name("decoder.layers.0.mlp.experts.linear_fc2.weight1", {0: 5}, 2) == \
        "decoder.layers.5.mlp.experts.local_experts.3.linear_fc2.weight"
    assert _global_name("embedding.word_embeddings.weight", {}, 2) == \
        "embedding.word_embeddings.weight"


def test_inference_takes_the_model_not_the_wrapper_from_the_checkpoint(trained, monkeypatch):
    """--use-checkpoint-args reads the model's flags, not how the run sharded it: a ZeRO-3
    checkpoint generates at PP=2 (Megatron-FSDP refuses PP > 1; copied, it stopped generate.py)."""
    from megatron_moe.inference.arguments import parse_inference_args
    from tools.generate import add_generate_args, validate_generate_args

    root, _ = trained
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = parse_inference_args(
        ["--load", root, "--use-checkpoint-args", "--pipeline-model-parallel-size", "2",
         "--prompts", "1 2"], add_generate_args, prog="generate.py",
        validate_tool=validate_generate_args)
    assert not args.use_megatron_fsdp and args.ckpt_format == "torch_dist"
    assert args.checkpoint_args.use_megatron_fsdp   # what the run itself used
