"""--moe-enable-routing-replay (Megatron-LM's flag; megatron-core's RouterReplay, 0.16 and 0.19):
the flag reaches TransformerConfig, every router gets its RouterReplay, and a recorded routing is
replayed exactly even after the router weights change (a free forward then routes differently).
Mutation: the flag parsed but dropped before the config (no RouterReplay: the replay pass routes
as the free one)."""

import pytest

from megatron_moe.runtime.local_ranks import run_distributed
from tests._routing_replay_cases import run


@pytest.mark.parametrize("mutate", [None, "not_in_config"])
def test_replayed_routing_equals_recorded(mutate):
    out = run_distributed(run, 1, mutate=mutate, timeout_s=200)[0]
    assert out["routers"] == 2 and len(out["recorded"]) == 2
    assert out["free"] != out["recorded"]   # the new weights route differently
    replayed = out["instances"] == 2 and out["replayed"] == out["recorded"]
    assert replayed is (mutate is None), (out["instances"], mutate)


def test_refused_with_congestion_routing(capsys):
    from megatron_moe import arguments
    from tests._routing_replay_cases import TINY

    with pytest.raises(SystemExit):
        arguments.parse_args(TINY + ["--moe-router-topology", "congestion"], world_size=1)
    err = capsys.readouterr().err.splitlines()[0]
    assert "--moe-router-topology congestion cannot be combined with --moe-enable-routing-replay" \
        in err, err
