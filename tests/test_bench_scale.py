"""``python -m hvdmx.bench scale``: the scale harness runs ranks as threads of one
process without mpiexec, and what it prints holds the negotiation's bounds: one
leader a host touches the network, no rank sends or receives more than the doubling
allows, every rank's step sums are exact. Times are printed, never asserted."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def scale(*args):
    result = subprocess.run([sys.executable, "-m", "hvdmx.bench", "scale", *args, "--json"],
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    table, _, rows = result.stdout.partition("\n[")
    return table, json.loads("[" + rows)


def test_the_table_and_the_bounds_at_a_host_count_that_is_not_a_power_of_two():
    # 24 ranks: 6 hosts of 4 (the leaders AND by doubling, 6 is folded into 4),
    # or all 24 alike (doubling over 16, 8 folded in).
    table, rows = scale("--ranks", "4,24", "--per-host", "4", "--rounds", "3",
                        "--model", "none")
    assert "max msgs/rank" in table and "floor(us)" in table
    by = {(r["ranks"], r["scheme"]): r for r in rows}
    assert set(by) == {(4, "tree"), (4, "flat"), (24, "tree"), (24, "flat")}
    # One host: the tree needs no network at all; flat is direct, 3 peers.
    assert by[4, "tree"]["max_msgs"] == 0 and by[4, "tree"]["hops"] == 0
    assert by[4, "flat"]["max_msgs"] == 6 and by[4, "flat"]["hops"] == 1
    # 6 leaders: doubling over 4 with 2 folded in: at most 3 messages each way, and
    # 3 or 4 latencies; 3 to 4 links.
    tree = by[24, "tree"]
    assert tree["hosts"] == 6 and tree["max_msgs"] == 6 and 3 <= tree["hops"] <= 4
    assert tree["links"] <= 4
    # Flat over 24: at most 5 each way, 5 or 6 latencies: more than the tree.
    flat = by[24, "flat"]
    assert flat["max_msgs"] == 10 and 5 <= flat["hops"] <= 6
    for r in rows:
        assert r["step_ms"] is None and r["round_us"] > 0 and r["cpu_us"] > 0


def test_a_step_of_a_small_model_is_exact_on_every_rank():
    table, rows = scale("--ranks", "6", "--per-host", "3", "--rounds", "2",
                        "--model", "squeezenet1.0", "--steps", "1", "--scheme", "tree")
    assert "squeezenet1.0's 52 gradients" in table, table
    assert len(rows) == 1 and rows[0]["step_correct"] and rows[0]["step_ms"] > 0


def test_bad_options_name_the_flag():
    result = subprocess.run([sys.executable, "-m", "hvdmx.bench", "scale", "--ranks", "6",
                             "--per-host", "4", "--model", "none"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "--per-host 4 does not divide --ranks 6" in result.stdout + result.stderr
    result = subprocess.run([sys.executable, "-m", "hvdmx.bench", "scale", "--ranks", "2,x"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "expected rank counts like 2,16,256" in result.stderr
