"""Ranks and rendezvous from torchrun's or srun's variables (megatron_moe/runtime/launcher.py), as the
parser and initialize.py read them (issue 26; tests/test_slurm.py runs both under a real Slurm)."""

import os

import pytest

from megatron_moe.runtime import launcher
from megatron_moe.arguments import parse_args
from tests._ckpt_cases import TINY

SLURM = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
         "SLURM_JOB_NODELIST": "gpu[007-008],cpu1", "SLURM_JOB_ID": "123456"}
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "2"}
ALL = [*SLURM, *TORCHRUN, "MASTER_ADDR", "MASTER_PORT"]


@pytest.fixture
def env():
    """Sets variables for one test; every name in ALL is restored after it (set_rendezvous_env
    writes os.environ itself)."""
    saved = {name: os.environ.pop(name, None) for name in ALL}
    yield os.environ.update
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


def _error_line(capsys):
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    return line


def test_sources_in_order(env):
    assert launcher.launcher_env() == (0, 1, 0, "default")
    env(**SLURM)
    assert launcher.launcher_env() == (1, 4, 1, "SLURM_NTASKS")
    env(**TORCHRUN)      # srun + torchrun: torchrun's variables win
    assert launcher.launcher_env() == (3, 8, 2, "WORLD_SIZE")


@pytest.mark.parametrize("nodelist, host", [("node1", "node1"), ("gpu[007-008],cpu1", "gpu007"),
                                            ("n[3,5-6]", "n3"), ("a1,b[1-2]", "a1")])
def test_first_host(nodelist, host):
    assert launcher.first_host(nodelist) == host


def test_rendezvous_from_the_job(env):
    env(**SLURM)
    launcher.set_rendezvous_env()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("gpu007", "23456")


def test_rendezvous_under_torchrun_is_torchruns(env):
    env(**SLURM, **TORCHRUN, MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    launcher.set_rendezvous_env()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.1", "29500")


def test_parser_takes_the_world_size_from_slurm(env, capsys):
    env(**SLURM)
    args = parse_args(TINY + ["--expert-model-parallel-size", "2", "--train-iters", "1"])
    assert (args.world_size, args.rank, args.data_parallel_size) == (4, 1, 4)
    assert not hasattr(args, "world_size_source")   # not stored in checkpoints' args
    env(SLURM_NTASKS="3")
    with pytest.raises(SystemExit):
        parse_args(TINY + ["--expert-model-parallel-size", "2", "--train-iters", "1"])
    assert _error_line(capsys) == ("pretrain_gpt_moe.py: error: world size 3 (SLURM_NTASKS, srun's --ntasks) is not "
                   "divisible by --expert-tensor-parallel-size (1) x --expert-model-parallel-size "
                   "(2) x --pipeline-model-parallel-size (1)")


def test_bad_variable_is_one_line(env, capsys):
    env(SLURM_PROCID="0", SLURM_NTASKS="two")
    with pytest.raises(SystemExit):
        parse_args(TINY)
    assert _error_line(capsys) == (
        "pretrain_gpt_moe.py: error: environment variable SLURM_NTASKS='two' is not an integer")
