"""A sample of Megatron-LM's MoE CI configs (core_v0.19.0, tests/data/
megatron_moe_functional_configs.json) trained on CPU ranks: only sizes and the run's length
overridden, every housekeeping / logging / schedule / recompute flag kept (tests/
_megatron_ci_configs.py); the resume config resumes exactly."""

import functools
import glob
import os

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._ckpt_cases import run_pretrain_steps
from tests._megatron_ci_configs import tiny_training_argv
from tests._train_cases import run_pretrain


def _train(name, tmp, train_iters=4, without=(), **overrides):
    world, argv, dropped = tiny_training_argv(name, str(tmp), train_iters, without, **overrides)
    return run_distributed(run_pretrain, world, argv, timeout_s=900)[-1], argv, dropped


def _scalars(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for path in glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")):
        acc = EventAccumulator(path)
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


def test_alltoall_etp1_ep4_trains_and_logs_megatrons_scalars(tmp_path):
    name = "gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4"
    history, argv, dropped = _train(name, tmp_path, **{"--eval-interval": "2"})
    assert "--overlap-moe-expert-parallel-comm" in dropped      # GPU-only, refused on CPU
    assert {"--log-params-norm", "--log-num-zeros-in-grad", "--deterministic-mode",
            "--dist-ckpt-strictness", "--use-persistent-ckpt-worker"} <= set(argv)
    assert len(history["lm_loss"]) == 4 and all(l == l for l in history["lm_loss"])
    tags = _scalars(str(tmp_path / "tensorboard_path"))
    assert {"params-norm", "num-zeros", "mem-max-rss-bytes", "lm loss validation ppl"} <= tags, tags


def test_mla_mtp_interleaved_pp2_trains(tmp_path):
    """MLA + MTP + PP2 with 4 virtual stages per rank (megatron-core's interleaved schedule)."""
    name = "gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed"
    # 2 iterations: every rank runs the interleaved schedule's warm-up, steady state and
    # cool-down in each one, and the second starts from the first's optimizer step
    history, argv, _ = _train(name, tmp_path, train_iters=2)
    assert "--num-virtual-stages-per-pipeline-rank" in argv and "--mtp-num-layers" in argv
    assert len(history["lm_loss"]) == 2 and all(l == l for l in history["lm_loss"])
    # the run was interleaved (4 chunks per rank) and its chunks hold every layer once, at
    # megatron-core's global layer numbers
    from megatron.core import dist_checkpointing

    ckpt = str(tmp_path / "checkpoint_save_path" / "iter_0000002")
    common = dist_checkpointing.load_common_state_dict(ckpt)
    assert common["args"].virtual_pipeline_model_parallel_size == 4
    keys = dist_checkpointing.load_tensors_metadata(ckpt).keys()
    layers = {int(k.split("decoder.layers.")[1].split(".")[0]) for k in keys
              if "decoder.layers." in k}
    assert layers == set(range(8)), sorted(layers)


def _assert_tracker(ckpt, iteration):
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == iteration, "the first run's tracker"


def _check_resumes_exactly(name, tmp_path):
    """Megatron's ckpt-resume test for config ``name``: train 4 == train 2, save, stop, resume,
    train 2. Returns the resumed run's checkpoint root."""
    world, full_argv, _ = tiny_training_argv(name, str(tmp_path / "full"), 4, ())
    resumed = {"--save-interval": "2"}
    _, first_argv, _ = tiny_training_argv(name, str(tmp_path / "resumed"), 4, (),
                                          **resumed, **{"--exit-interval": "2"})
    ckpt = tmp_path / "resumed" / "checkpoint_save_path"
    # Megatron's runner (run_ci_test.sh): the second run of a ckpt-resume test loads what the
    # first one saved
    _, second_argv, _ = tiny_training_argv(name, str(tmp_path / "resumed"), 4, (),
                                           **resumed, **{"--load": str(ckpt)})
    # the three runs one after the other in the same ranks (one process start for all); before
    # the resume, rank 0 checks that the first run stopped with its iteration-2 checkpoint tracked
    runs = run_distributed(run_pretrain_steps, world, [
        {"argv": full_argv}, {"argv": first_argv},
        {"argv": second_argv, "prepare": functools.partial(_assert_tracker, str(ckpt), "2")},
    ], timeout_s=900)[-1]
    for run in runs:
        assert run["exit"] in (0, None) and run["history"] is not None, run["text"][-3000:]
    full, first, second = (run["history"] for run in runs)
    assert second["iteration"][0] == 3
    assert first["lm_loss"] + second["lm_loss"] == full["lm_loss"]
    assert first["lr"] + second["lr"] == full["lr"]
    return ckpt, full_argv


def test_resume_config_resumes_exactly(tmp_path):
    """Megatron's ckpt-resume test: train 4 == train 2, save, stop, resume, train 2 (sinkhorn,
    distributed optimizer, --dist-ckpt-strictness log_all, async save, deterministic mode)."""
    _check_resumes_exactly(
        "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_dist_optimizer", tmp_path)


def test_megatron_fsdp_zero3_config_resumes_exactly(tmp_path):
    """Megatron's ZeRO-3 ckpt-resume test (Megatron-FSDP optim_grads_params with TP2 x EP2,
    sequence parallel, per-token loss, --ckpt-format fsdp_dtensor)."""
    ckpt, argv = _check_resumes_exactly(
        "gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router", tmp_path)
    assert {"--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"} <= set(argv)
    assert (ckpt / "iter_0000002" / ".metadata").is_file()


def test_verify_integrity_refuses_a_changed_checkpoint_file(tmp_path):
    """--verify-integrity (the resume config sets it): megatron-core's hash manifest is written at
    save, and a shard changed after the save stops the load (megatron-core >= 0.19)."""
    from megatron_moe.compat import checkpoint_options
    from megatron_moe.runtime.local_ranks import DistributedRunError

    if not checkpoint_options.HAS_INTEGRITY_MANIFEST:
        pytest.skip(f"megatron-core {checkpoint_options.MCORE_VERSION} has no integrity manifest")
    name = "gpt3_mcore_te_tp2_pp1_resume_torch_dist_te_8experts2parallel_dist_optimizer"
    _train(name, tmp_path, train_iters=2, **{"--exit-interval": "2"})
    ckpt = tmp_path / "checkpoint_save_path"
    assert (ckpt / "iter_0000002" / "integrity.json").is_file()
    shard = sorted((ckpt / "iter_0000002").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # refused naming the file: this package's checksum manifest (always written, checked first)
    # catches it before megatron-core's integrity.json is read, with --verify-integrity ...
    with pytest.raises(DistributedRunError, match=shard.name):
        _train(name, tmp_path, train_iters=4, **{"--load": str(ckpt)})
    # ... and without it (docs/checkpoints.md)
    with pytest.raises(DistributedRunError, match=shard.name):
        _train(name, tmp_path, train_iters=3, without=("--verify-integrity",),
               **{"--load": str(ckpt), "--save-interval": "100"})


def test_context_parallel_config_resumes_exactly(tmp_path):
    """Megatron's CP2 x PP2 x EP2 config (4 ranks) with --context-parallel-size kept: the local
    path's SDPA attention by all-gather (--attention-backend flash), each CP rank half of every
    sequence on both pipeline stages that read data; train 4 == train 2, save, resume, train 2."""
    _, argv = _check_resumes_exactly(
        "gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic", tmp_path)
    i = argv.index("--context-parallel-size")
    assert argv[i + 1] == "2" and "--pipeline-model-parallel-size" in argv


def test_tp2_cp2_pp2_config_on_eight_ranks_resumes_exactly(tmp_path):
    """Megatron's TP2 x CP2 x PP2 x EP2 config (8 ranks), nothing dropped: sequence-parallel
    tensor ranks and context-parallel ranks together, each CP rank half of every sequence; train
    4 == train 2, save, resume, train 2."""
    world, argv, dropped = tiny_training_argv("gpt3_mcore_tp2_cp2_pp2_ep2_te_4experts2parallel",
                                              str(tmp_path / "probe"), 4)
    assert world == 8 and dropped == []
    a = dict(zip(argv, argv[1:]))
    assert (a["--tensor-model-parallel-size"], a["--context-parallel-size"],
            a["--pipeline-model-parallel-size"]) == ("2", "2", "2")
    _check_resumes_exactly("gpt3_mcore_tp2_cp2_pp2_ep2_te_4experts2parallel", tmp_path)
