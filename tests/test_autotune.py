"""Autotune: on a load where fusing is clearly best (many small allreduces a
step) it settles on a fused setting, applied on every rank in step (the
results stay right), and logs every trial; on a latency-bound load it picks
no waiting; and it leaves alone what the user fixed."""
import csv

from test_process_exit import run_job

LOAD = """
import time
grads = [mx.nd.ones((1024,)) * (i + 1) for i in range(64)]   # 64 x 4 KiB a step
deadline = time.time() + 9
step = 0
while True:
    outs = [hvd.allreduce(g, op=hvd.Sum, name=f"g{i}") for i, g in enumerate(grads)]
    mx.nd.waitall()
    if step % 20 == 0:   # right all along: the ranks always fuse alike
        assert outs[5].asnumpy()[0] == 6 * size, outs[5].asnumpy()[0]
        # every rank stops at the same step
        if hvd.allreduce(mx.nd.array([time.time() > deadline]), op=hvd.Max,
                         name="stop").asscalar():
            break
    step += 1
print(f"rank {rank} steps {step}")
"""


def test_autotune_finds_the_clearly_best_setting(tmp_path):
    log = tmp_path / "autotune.csv"
    result = run_job(2, LOAD, timeout=120, HVDMX_AUTOTUNE="1", HVDMX_AUTOTUNE_LOG=str(log),
                     HVDMX_LOG_LEVEL="info")
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(log.open()))
    assert rows[0]["note"] == "warm-up"
    trials = [r for r in rows if r["note"] == "trial"]
    assert len(trials) == 7 + 4  # every threshold at cycle 0, then the other cycle times
    chosen = [r for r in rows if r["note"] == "chosen"]
    assert len(chosen) == 1, rows
    best = chosen[0]
    assert int(best["fusion_threshold_bytes"]) >= 128 << 10  # fused, not one call per tensor
    assert float(best["bytes_per_second"]) == max(float(r["bytes_per_second"]) for r in trials)
    unfused = [float(r["bytes_per_second"]) for r in trials
               if int(r["fusion_threshold_bytes"]) == 0]
    assert float(best["bytes_per_second"]) > unfused[0]
    assert "autotune chose fusion_threshold=" in result.stderr


LATENCY_LOAD = """
import time
x = mx.nd.ones((16,))
deadline = time.time() + 4
step = 0
while True:   # one small allreduce a step, read at once
    hvd.allreduce(x, op=hvd.Sum, name="tiny").wait_to_read()
    step += 1
    if step % 50 == 0 and hvd.allreduce(mx.nd.array([time.time() > deadline]), op=hvd.Max,
                                        name="stop").asscalar():
        break
"""


def test_latency_bound_load_gets_no_cycle_time_and_fixed_values_stay(tmp_path):
    log = tmp_path / "autotune.csv"
    result = run_job(2, LATENCY_LOAD, timeout=120, HVDMX_AUTOTUNE="1",
                     HVDMX_AUTOTUNE_LOG=str(log), HVDMX_FUSION_THRESHOLD="1048576")
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(log.open()))
    assert {r["fusion_threshold_bytes"] for r in rows} == {"1048576"}  # fixed: not tuned
    assert len([r for r in rows if r["note"] == "trial"]) == 5  # the cycle times only
    chosen = [r for r in rows if r["note"] == "chosen"]
    assert len(chosen) == 1 and float(chosen[0]["cycle_time_ms"]) <= 0.5, rows
