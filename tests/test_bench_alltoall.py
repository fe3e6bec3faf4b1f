"""Smoke test of bench/alltoall.py: a --quick run on 2 gloo ranks (2 emulated nodes x 1).

Asserts on what the bench measures, not on timings: every algorithm x compression cell is in the
JSON, the bytes the algorithms put on the wire equal the note's formulas (exact for equal
splits), outputs equal the peer's, and the chunked exchange reproduces r=1.
"""

import json

from bench import alltoall as bench


def test_quick_run_world2(tmp_path, capsys):
    path = tmp_path / "a2a.json"
    results = bench.main(["--quick", "--world-size", "2", "--ranks-per-node", "1",
                          "--backend", "gloo", "--degrees", "1,2", "--timeout", "240",
                          "--json", str(path)])
    printed = capsys.readouterr().out
    assert "bytes on the wire equal the formulas in every cell: True" in printed
    assert "CPU/gloo run" in printed  # the footer that says CPU numbers mean little

    with open(path) as f:
        data = json.load(f)
    assert data["cells"] == json.loads(json.dumps(results["cells"]))
    sizes = [p["size_bytes"] for p in data["peer"]]
    assert sizes == [64 << 10, 1 << 20]  # the --quick sizes, whole rows of 1024 fp32
    cells = {(c["size_bytes"], c["algorithm"], c["compression"]): c for c in data["cells"]}
    want = {(s, a, c) for s in sizes for a in bench.ALGORITHMS for c in bench.COMPRESSIONS}
    assert set(cells) == want
    for key, c in cells.items():
        assert c["bytes_match"] is True, (key, c["measured"], c["formula"])
        assert c["output_ok"] is True, key
        assert c["median_s"] > 0 and c["vs_peer"] > 0
        # 2 nodes x 1: everything leaves the node, half of the payload (the other half is mine)
        wire = c["size_bytes"] // (1024 * 4) * c["row_wire_bytes"]
        assert c["measured"] == {"intra_bytes": 0, "inter_bytes": wire // 2,
                                 "intra_msgs": 0, "inter_msgs": 1}, key
    # compression shrinks the wire as documented: fp16/bf16 half, int8 a quarter + 8 B/row
    row = {c: cells[(sizes[0], "flat", c)]["row_wire_bytes"] for c in bench.COMPRESSIONS}
    assert row == {"none": 4096, "fp16": 2048, "bf16": 2048, "int8": 1032}

    chunked = {(r["algorithm"], r["degree"]): r for r in data["chunked"]}
    assert set(chunked) == {("flat", 1), ("flat", 2), ("pipe", 1), ("pipe", 2)}
    for key, r in chunked.items():
        assert r["max_abs_diff_vs_r1"] < 1e-5, key
        assert r["fwd_s"] > 0 and r["fwd+bwd_s"] > 0


def test_parse_size_and_flag_errors():
    assert bench.parse_size("64K") == 65536
    assert bench.parse_size("64KiB") == 65536
    assert bench.parse_size("4M") == 4 << 20
    assert bench.parse_size("1000") == 1000
    for argv, flag in ((["--world-size", "4", "--ranks-per-node", "3"], "--ranks-per-node"),
                       (["--algorithms", "flat,ring"], "--algorithms"),
                       (["--compressions", "zfp"], "--compressions"),
                       (["--degrees", "2,4"], "--degrees"),
                       (["--sizes", "12Q"], "--sizes")):
        try:
            bench.main(argv)
        except SystemExit as e:
            assert flag in str(e), (argv, e)
        else:
            raise AssertionError(f"{argv} should fail naming {flag}")


def test_chunked_section_behind_the_link(capsys):
    """--link-gbps: the chunked section's exchanges pay the emulated link (windows counted on every
    rank; each chunk's exchange is one window per direction), outputs still equal r=1."""
    res = bench.main(["--world-size", "2", "--ranks-per-node", "1", "--backend", "gloo", "--sizes", "64K",
                      "--algorithms", "flat", "--compressions", "none", "--chunk-algorithms", "flat",
                      "--degrees", "1,2", "--chunk-size", "64K", "--iters", "1", "--warmup", "0",
                      "--link-gbps", "1", "--timeout", "240"])
    assert "behind an emulated 1 GB/s link per rank" in capsys.readouterr().out
    for st in res["chunked_link"]:
        assert st["a2a_windows"] > 0 and st["a2a_bytes"] > 0 and st["busy_s"] > 0
    assert all(r["max_abs_diff_vs_r1"] < 1e-5 for r in res["chunked"])
    try:
        bench.main(["--link-gbps", "0"])
    except SystemExit as e:
        assert "--link-gbps" in str(e)
    else:
        raise AssertionError("--link-gbps 0 accepted")
