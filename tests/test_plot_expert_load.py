import os

import pytest

from tools import plot_expert_load

LOG = """\
 [2026-11-22 14:00:00.000000] iteration       10/     100 | consumed samples:          160 | lm loss: 7.0E+00 |
 [moe] layer   1 | expert load max/mean: 1.500 | EP-rank load max/mean: 1.100 | tokens per expert: [30, 10, 20, 20] |
 [moe] layer   2 | expert load max/mean: 1.200 | EP-rank load max/mean: 1.050 | tokens per expert: [24, 16, 20, 20] |
 [2026-11-22 14:00:01.000000] iteration       20/     100 | consumed samples:          320 | lm loss: 6.0E+00 |
 [moe] layer   1 | expert load max/mean: 1.100 | EP-rank load max/mean: 1.000 | tokens per expert: [22, 18, 20, 20] |
 [moe] layer   2 | expert load max/mean: 1.000 | EP-rank load max/mean: 1.000 | tokens per expert: [20, 20, 20, 20] |
"""


def test_parse_and_plot(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text(LOG)
    parsed = plot_expert_load.parse_log(LOG.splitlines())
    assert parsed[1][0] == (10, 1.5, 1.1, [30, 10, 20, 20])
    assert [r[0] for r in parsed[2]] == [10, 20]
    out = tmp_path / "load.png"
    assert plot_expert_load.main([str(log), "--output", str(out)]) == 0
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "worst max/mean 1.500 (layer 1, iteration 10)" in capsys.readouterr().out


def test_log_without_moe_lines_is_an_error(tmp_path):
    log = tmp_path / "dense.log"
    log.write_text("iteration 1/ 2 | lm loss: 1.0 |\n")
    with pytest.raises(SystemExit):
        plot_expert_load.main([str(log), "--output", str(tmp_path / "x.png")])
