"""`python -m utils.bench.attention` (utils/bench/attention.py) on CPU ranks with a small sequence: the table of
every cp_attention variant against plain SDPA, its bytes as the variants' formulas give them, the ring's
overlap mode, and bad options refused in one line before any rank starts."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from tests.helpers import run_main, run_ranks

TOKENS, HEADS, HEAD_DIM = 64, 8, 48  # vit_base's layer (8 heads of 48) on a short sequence


def _bench(rank: int, world: int, out_dir: str, argv: list[str]) -> None:
    from utils.bench.attention import parse_options, run_rank

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert run_rank(parse_options(argv)) == 0
    if rank == 0:
        (Path(out_dir) / "table.md").write_text(printed.getvalue())


def _rows(text: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in text.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_table_of_every_variant_on_cp2(tmp_path):
    run_ranks(_bench, 2, tmp_path, str(tmp_path), ["--cp", "2", "--tokens", str(TOKENS), "--warmup", "0",
                                                   "--iters", "1"])
    rows = _rows((tmp_path / "table.md").read_text())
    block = 1 * HEADS * (TOKENS // 2) * HEAD_DIM * 4  # one rank's K (or V) shard, float32
    sent = {v: int(rows[v][2].replace(",", "")) for v in ("ring", "allgather", "alltoall")}
    assert sent["ring"] == 8 * block  # forward (cp-1) x 2 blocks, backward (cp-1) x 2 + cp x 2 (the ring's doc)
    assert sent["alltoall"] == 4 * block  # q, k, v, out there and back, (cp-1)/cp of each
    # all-gather of K and V, (cp-1) x 2 blocks, and their gradients' reduce-scatter, an all-reduce on gloo:
    # 2 x 2(cp-1)/cp x 2 blocks; together 6(cp-1)/cp x A with A = cp blocks (the README's table)
    assert sent["allgather"] == 6 * block
    assert all(float(rows[v][0]) > 0 for v in sent) and float(rows["plain SDPA (one device)"][1]) == 1.0
    assert rows["hierarchical"][0].startswith("n/a: needs cp >= 4")


def test_overlap_mode_reports_forward_and_backward(tmp_path):
    run_ranks(_bench, 2, tmp_path, str(tmp_path), ["--cp", "2", "--tokens", str(TOKENS), "--warmup", "0",
                                                   "--iters", "1", "--overlap", "--trace-dir", str(tmp_path)])
    text = (tmp_path / "table.md").read_text()
    assert re.search(r"\| forward \| K/V \| 1 \|", text)
    assert re.search(r"\| backward \| dK/dV home, after the last block \| 1 \|", text)
    assert (tmp_path / "ring_rank0.json").is_file() and (tmp_path / "ring_rank1.json").is_file()


def test_bad_options_are_refused_in_one_line():
    for argv, setting in ((["--dtype", "fp64"], "--dtype"), (["--shape", "gpt_tiny"], "--shape"),
                          (["--cp", "two"], "--cp"), (["--cores", "2"], "--cores")):
        code, _, err = run_main("utils.bench.attention", *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and setting in err, (argv, err)
