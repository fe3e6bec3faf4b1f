import pytest

from megatron_moe.runtime.local_ranks import DistributedRunError, run_distributed
from tests import _dist_cases


def test_allreduce_two_ranks():
    assert run_distributed(_dist_cases.allreduce_rank, 2) == [3.0, 3.0]


def test_hang_is_killed():
    with pytest.raises(DistributedRunError, match="timed out"):
        run_distributed(_dist_cases.hang_rank, 2, timeout_s=20)


def test_failure_is_reported_with_traceback():
    with pytest.raises(DistributedRunError, match="boom on rank 1"):
        run_distributed(_dist_cases.fail_rank, 2, timeout_s=60, collective_timeout_s=10)
