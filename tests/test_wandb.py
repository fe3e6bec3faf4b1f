"""W&B on the ``wandb`` library (megatron_moe/training/wandb_writer.py): Megatron-LM's four flags; the run
(offline, ``WANDB_MODE=offline``) holds every scalar TensorBoard gets, with the values of the log
line; without the flags wandb is never imported; flags that cannot apply are refused."""

import glob
import importlib.util
import json
import struct

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests import _data_helpers as H

# not importorskip: the rank processes import this module, and must not import wandb by it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                reason="wandb is not installed")


def train_case(rank, world_size, argv):
    """pretrain() in this process; returns (what it printed, whether wandb was imported)."""
    import contextlib
    import io

    from tests._inference_cases import train_and_capture

    out = io.StringIO()
    with contextlib.redirect_stderr(out):
        printed = train_and_capture(rank, world_size, argv)
    from megatron_moe.compat import wandb_loaded

    return printed, wandb_loaded()


def read_wandb_history(path):
    """The history rows of an offline run's .wandb file. wandb 0.31 has no Python reader (its
    Go core writes and syncs the file), so this test oracle reads the container: LevelDB's log
    format (7-byte ':W&B' header; 32 KiB blocks; records of crc32 u32, length u16, type u8 --
    1 full, 2 first, 3 middle, 4 last) around wandb's ``Record`` protobuf messages."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    pos, block, rows, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                             for i in record.history.item})
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("wandb")
    data, tok = H.sp_dataset(str(d), max_docs=60, vocab_size=300)
    argv = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 2 --lr 3e-3 --split 80,20,0 "
            "--tokenizer-type SentencePieceTokenizer --num-experts 4 --moe-router-topk 2 "
            "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 --disable-bias-linear "
            "--train-iters 4 --log-interval 1 --eval-interval 2 --eval-iters 1").split()
    return d, argv + ["--data-path", data, "--tokenizer-model", tok]


def test_offline_run_holds_the_tensorboard_scalars(data):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d, argv = data
    tb, wb = str(d / "tb"), str(d / "wb")
    argv = argv + ["--tensorboard-dir", tb, "--wandb-project", "mm-test", "--wandb-exp-name",
                   "tiny", "--wandb-save-dir", wb]
    printed, imported = run_distributed(train_case, 1, argv, timeout_s=300,
                                        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})[0]
    assert imported
    runs = glob.glob(f"{wb}/wandb/offline-run-*/run-*.wandb")
    assert len(runs) == 1, runs
    rows = read_wandb_history(runs[0])
    history = {}
    for row in rows:
        for key, value in row.items():
            if not key.startswith("_"):
                history.setdefault(key, {})[row["_step"]] = value
    events = EventAccumulator(tb)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(history) == tags  # the same scalars
    assert {"lm loss", "learning-rate", "grad-norm", "tokens-per-second",
            "moe/expert_load_max_over_mean_layer_1", "lm loss validation"} <= tags, tags
    for tag in tags:  # the same values at the same iterations
        tb_values = {e.step: e.value for e in events.Scalars(tag)}
        assert history[tag] == pytest.approx(tb_values, rel=1e-6), tag
    # the losses of the log lines, iteration by iteration
    logged = {int(line.split("iteration")[1].split("/")[0]): float(
        line.split("lm loss:")[1].split("|")[0]) for line in printed.splitlines()
        if " iteration " in line and "lm loss:" in line}
    assert sorted(logged) == [1, 2, 3, 4]
    assert {k: history["lm loss"][k] for k in logged} == pytest.approx(logged, rel=1e-5)


def test_without_the_flags_wandb_is_not_imported(data):
    d, argv = data
    printed, imported = run_distributed(train_case, 1, argv, timeout_s=300)[0]
    assert "iteration        4/" in printed and not imported


def test_flags_that_cannot_apply_are_refused(data, capsys, monkeypatch):
    from megatron_moe.arguments import parse_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    _, argv = data
    for extra, message in (
            (["--wandb-exp-name", "x"], "--wandb-exp-name needs --wandb-project"),
            (["--wandb-entity", "me"], "--wandb-entity needs --wandb-project"),
            (["--wandb-project", "p"], "--wandb-project needs --wandb-save-dir or --save"),
            (["--wandb-project", "p", "--wandb-exp-name", "", "--save", "s"],
             "please specify the wandb experiment name")):
        with pytest.raises(SystemExit):
            parse_args(argv + extra)
        assert message in capsys.readouterr().err
    args = parse_args(argv + ["--wandb-project", "p", "--wandb-exp-name", "e", "--save", "s",
                              "--wandb-entity", "team"])
    assert (args.wandb_project, args.wandb_exp_name, args.wandb_entity) == ("p", "e", "team")
