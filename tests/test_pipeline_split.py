"""Uneven pipeline stages (--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-
in-pipeline-split) in the real pretrain() loop on 2 gloo ranks.

Check: a tiny 3-layer GPT-MoE (fp32, no dropout, constant LR) trains 4 iterations at PP=1 (DP=2)
and at PP=2 with each uneven split. Every rank records the global numbers of the decoder layers
its model chunk built (the split megatron-core made) and what models/pipeline_split.py says it
holds (what the memory report and the ring-memory check use): both must be the split asked for.
Megatron seeds each pipeline rank's initialisation differently, so the splits start from PP=1's
iteration-1 checkpoint: their iterations 2-4 must equal the PP=1 run's (up to summation order:
another data-parallel size; weights and Adam state resharded onto the uneven layout by
megatron-core's sharded state dict with its global layer offsets). The 1+2 split's own
iteration-2 checkpoint then resumes at PP=1: iterations 3-4 equal PP=1's again, and
tools/generate.py reads it at PP=1 with --use-checkpoint-args (the split is the training run's
layout, not taken from the checkpoint).

Mutation: the model's TransformerConfig built without the split's fields (the builder not
passing them): the 1+2 run cannot build a 3-layer model on 2 even stages, so the test fails.
The six pretrain() runs share one 2-rank spawn.

Also: an uneven split with virtual stages (6 layers, 2 on the first stage, 2 chunks per rank)
builds Megatron's interleaved layers and continues PP=1's checkpoint with its losses; bad
combinations exit at parse time with one line naming the flag; the memory report
(tools/report_theoretical_memory.py) places a dense first layer and the MoE layers on the stages
that hold them (mutation: the former even split assumed).
"""

import os

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import TINY

BASE = list(TINY)
BASE[BASE.index("--num-layers") + 1] = "3"
BASE += ["--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--lr-decay-style", "constant", "--expert-model-parallel-size", "1"]
PP2 = ["--pipeline-model-parallel-size", "2"]
SPLITS = {   # flags -> decoder layers (1-based layer_number) of each model chunk on pipeline
    # rank 0, rank 1
    "first-1": (["--decoder-first-pipeline-num-layers", "1"], [[[1]], [[2, 3]]]),
    "last-1": (["--decoder-last-pipeline-num-layers", "1"], [[[1, 2]], [[3]]]),
    "embedding": (["--account-for-embedding-in-pipeline-split"], [[[1]], [[2, 3]]]),
    "loss": (["--account-for-loss-in-pipeline-split"], [[[1, 2]], [[3]]]),
}
REL = 1e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _drop_split_fields(builder):
    """Mutation: the model config built as if the split flags were not given."""
    real = builder.transformer_config_from_args

    def without_split(args, *a, **k):
        import copy

        args = copy.copy(args)
        args.decoder_first_pipeline_num_layers = args.decoder_last_pipeline_num_layers = None
        args.account_for_embedding_in_pipeline_split = False
        args.account_for_loss_in_pipeline_split = False
        return real(args, *a, **k)

    builder.transformer_config_from_args = without_split
    return lambda: setattr(builder, "transformer_config_from_args", real)


def run_recording_layers(rank, world_size, argvs, mutate):
    """pretrain() runs one after another; per run (history, the layer numbers this rank built,
    models/pipeline_split.py's layers for this rank), or the exception's text."""
    from megatron.core import parallel_state

    from megatron_moe.models import builder
    from megatron_moe.models.pipeline_split import stage_layers
    from tests._train_cases import pretrain_with_step

    undo = _drop_split_fields(builder) if mutate == "config_fields_dropped" else (lambda: None)
    out = []
    try:
        for argv in argvs:
            parallel_state.destroy_model_parallel()
            seen = {}

            def wrap(step):
                def train_step(self, data_iterator):
                    if not seen:
                        seen["built"] = [[layer.layer_number
                                          for layer in builder.unwrap(chunk).decoder.layers]
                                         for chunk in self.model]
                        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
                        seen["helper"] = [[i + 1 for i in chunk]
                                          for chunk in stage_layers(self.args, pp_rank)]
                    return step(self, data_iterator)
                return train_step

            try:
                result = pretrain_with_step(argv, wrap)
            except Exception as exc:   # the mutation's failure, reported to the test
                out.append(f"raised {type(exc).__name__}: {exc}")
                continue
            out.append((result["history"], seen["built"], seen["helper"]))
    finally:
        undo()
    return out


def _layers_ok(runs, expected):
    """Each rank built (and the helper reports) the chunks expected[pp rank]."""
    return all(not isinstance(r, str) and r[1] == expected[rank] and r[2] == expected[rank]
               for rank, r in enumerate(runs))


@pytest.mark.parametrize("mutate", ["none", "config_fields_dropped"])
def test_uneven_splits_continue_pp1_and_back(tmp_path, mutate):
    pp1_ckpt, uneven_ckpt = str(tmp_path / "pp1"), str(tmp_path / "uneven")
    names = list(SPLITS) if mutate == "none" else ["first-1"]
    argvs = [BASE + ["--save", pp1_ckpt, "--save-interval", "1"]]
    for name in names:   # PP=1 -> each split: iterations 2-4 from PP=1's iteration-1 checkpoint
        argvs.append(BASE + PP2 + SPLITS[name][0] + ["--load", pp1_ckpt, "--ckpt-step", "1"]
                     + (["--save", uneven_ckpt, "--save-interval", "2"] if name == "first-1"
                        else []))
    if mutate == "none":  # the 1+2 split's iteration-2 checkpoint -> PP=1: iterations 3-4
        argvs.append(BASE + ["--load", uneven_ckpt, "--ckpt-step", "2"])
    per_rank = run_distributed(run_recording_layers, 2, argvs, mutate, timeout_s=500)
    ref = per_rank[0][0]
    assert not isinstance(ref, str), ref
    assert ref[1] == [[1, 2, 3]] and ref[2] == [[1, 2, 3]]   # PP=1: all layers on each rank
    ok = True
    for index, name in enumerate(names, start=1):
        runs = [per_rank[rank][index] for rank in range(2)]
        ok &= _layers_ok(runs, SPLITS[name][1])
        # iteration 2 runs the loaded weights, 3 and 4 the loaded Adam state too
        ok &= all(not isinstance(r, str) and r[0]["iteration"] == [2, 3, 4]
                  and r[0]["lm_loss"] == pytest.approx(ref[0]["lm_loss"][1:], rel=REL)
                  for r in runs)
    if mutate == "none":
        back = [per_rank[rank][-1] for rank in range(2)]
        ok &= all(not isinstance(r, str) and r[0]["iteration"] == [3, 4]
                  and r[0]["lm_loss"] == pytest.approx(ref[0]["lm_loss"][2:], rel=REL)
                  for r in back)
    assert ok == (mutate == "none"), per_rank
    if mutate == "none":
        _generate_reads_the_uneven_checkpoint(uneven_ckpt)


def _generate_reads_the_uneven_checkpoint(ckpt):
    """tools/generate.py's flags at PP=1 from the 1+2 split's checkpoint (--use-checkpoint-args):
    the split is that run's layout, not the model's, so it is not taken from the checkpoint."""
    import sys

    sys.path.insert(0, ROOT)
    from megatron_moe.inference.arguments import parse_inference_args
    from tools.generate import add_text_generate_args, validate_generation_args

    was = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = "1"
    try:
        args = parse_inference_args(["--load", ckpt, "--prompts", "x", "--use-checkpoint-args"],
                                    add_text_generate_args, prog="generate.py",
                                    validate_tool=validate_generation_args)
    finally:
        if was is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = was
    assert (args.num_layers, args.pipeline_model_parallel_size) == (3, 1)
    assert args.decoder_first_pipeline_num_layers is None


# --- parse time: Megatron's rules, one line naming the flag ----------------------------------
@pytest.mark.parametrize("extra,needle", [
    ("--decoder-first-pipeline-num-layers 0", "--decoder-first-pipeline-num-layers must be > 0"),
    ("--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 2",
     "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers with --num-layers 3"),
    ("--decoder-last-pipeline-num-layers 1 --account-for-loss-in-pipeline-split",
     "--decoder-last-pipeline-num-layers cannot be used with --account-for-loss-in-pipeline-split"),
    ("--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
     "--num-layers (3) + 1 (--account-for-embedding-in-pipeline-split) + 1 "
     "(--account-for-loss-in-pipeline-split) must be divisible by --pipeline-model-parallel-size"),
    ("", "--num-layers (3) must be divisible by --pipeline-model-parallel-size (2)"),
    ("--decoder-first-pipeline-num-layers 1 --pipeline-model-parallel-layout Et|ttL",
     "--decoder-first-pipeline-num-layers cannot be used with --pipeline-model-parallel-layout"),
    ("--decoder-first-pipeline-num-layers 1 --num-layers-per-virtual-pipeline-stage 1",
     "--decoder-first-pipeline-num-layers with virtual pipeline stages needs "
     "--num-virtual-stages-per-pipeline-rank"),
    ("--decoder-first-pipeline-num-layers 1 --num-virtual-stages-per-pipeline-rank 2",
     "--decoder-first-pipeline-num-layers with --num-layers 3, --pipeline-model-parallel-size 2: "
     "number of layers at first stage: 1"),   # megatron-core's: not divisible by the 2 chunks
])
def test_bad_split_is_one_line_at_parse_time(extra, needle, capsys):
    from megatron_moe.arguments import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + PP2 + extra.split(), world_size=2, check_data_paths=False)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and needle in lines[0] and "Traceback" not in "".join(lines), lines


# --- the memory report counts the layers each stage really holds ----------------------------
@pytest.mark.parametrize("mutate", ["none", "even_split_assumed"])
def test_memory_report_follows_the_split(mutate, monkeypatch):
    import sys

    from megatron_moe.models import pipeline_split

    sys.path.insert(0, ROOT)
    from tools import report_theoretical_memory as rtm

    if mutate == "even_split_assumed":   # the report's former even split
        monkeypatch.setattr(pipeline_split, "stage_layers", lambda args, rank: [range(
            rank * (args.num_layers // 2), (rank + 1) * (args.num_layers // 2))])
    dense_first = BASE + ["--moe-layer-freq", "[0,1,1]"] + PP2   # layer 1 dense, 2-3 MoE
    got = {}
    for name in SPLITS:
        args, ignored = rtm.parse(dense_first + SPLITS[name][0] + ["--world-size", "2"])
        assert ignored == []
        got[name] = [rtm.stage_pattern(args, stage) for stage in range(2)]
        got[name + ":experts"] = [rtm.stage_params(args, stage)[1] > 0 for stage in range(2)]
    want = {"first-1": [[0], [1, 1]], "last-1": [[0, 1], [1]], "embedding": [[0], [1, 1]],
            "loss": [[0, 1], [1]]}
    ok = all(got[n] == want[n] for n in want) and \
        got["first-1:experts"] == [False, True] and got["last-1:experts"] == [True, True]
    assert ok == (mutate == "none"), got


def test_uneven_split_with_virtual_stages():
    """6 layers, 2 on the first stage, 2 virtual stages per rank (Megatron-LM: uneven stages with
    --num-virtual-stages-per-pipeline-rank): rank 0 holds layers 1 and 4, rank 1 layers 2-3 and
    5-6; iterations 2-3 from PP=1's iteration-1 checkpoint give PP=1's losses."""
    import tempfile

    six = list(BASE)
    six[six.index("--num-layers") + 1] = "6"
    six[six.index("--train-iters") + 1] = "3"
    with tempfile.TemporaryDirectory() as ckpt:
        argvs = [six + ["--save", ckpt, "--save-interval", "1"],
                 six + PP2 + ["--num-virtual-stages-per-pipeline-rank", "2",
                              "--decoder-first-pipeline-num-layers", "2",
                              "--load", ckpt, "--ckpt-step", "1"]]
        per_rank = run_distributed(run_recording_layers, 2, argvs, "none", timeout_s=500)
    ref = per_rank[0][0]
    runs = [per_rank[rank][1] for rank in range(2)]
    assert _layers_ok(runs, [[[1], [4]], [[2, 3], [5, 6]]]), runs
    for r in runs:
        assert r[0]["iteration"] == [2, 3]
        assert r[0]["lm_loss"] == pytest.approx(ref[0]["lm_loss"][1:], rel=REL)
