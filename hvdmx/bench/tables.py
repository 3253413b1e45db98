"""What ``python -m hvdmx.bench`` prints: nccl-tests' columns for the
collectives, the model's and the idle process's tables, and the plot."""
from __future__ import annotations

from hvdmx.bench.collectives import MPI_CALL


def _of_rounds(rounds: int) -> str:
    return f", median of {rounds} rounds taken in turn" if rounds > 1 else ""


def print_collective(rows: list, n: int, kind: str) -> None:
    tensors = rows[0]["tensors"] if rows else 1
    what = (f"grouped_{kind} of {tensors} tensors vs {tensors} x {MPI_CALL[kind]}"
            if tensors > 1 else f"{kind} vs {MPI_CALL[kind]}")
    if rows and rows[0].get("splits"):
        what = f"{kind} with splits (and received splits back) vs {MPI_CALL[kind]}"
    memory = "MXNet's memory" if rows and rows[0].get("mpi_memory") == "mxnet" else "numpy"
    rounds = _of_rounds(rows[0]["rounds"]) if rows else ""
    if rows and rows[0].get("unnamed"):
        what += ", hvdmx calls unnamed (each a new name)"
    print(f"# hvdmx {what} (mpi4py on {memory} buffers), {n} ranks; time = mean per call "
          f"incl. result read{rounds}; GB/s = 1e9 B/s; MPI/hvdmx compares in place where "
          "hvdmx has it")
    group = f"{'':>10} {'':>7} {'':>7} {'':>6}"
    print(f"{'':>12} {'':>11} {'':>8} {'':>5} | {'hvdmx out-of-place':<{len(group)}} | "
          f"{'hvdmx in-place':<{len(group)}} | {MPI_CALL[kind]:<{len(group)}} |")
    cols = f"{'time(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
    print(f"{'size(B)':>12} {'count':>11} {'type':>8} {'redop':>5} | {cols} | {cols} | {cols} | "
          f"{'MPI/hvdmx':>9}")

    def figures(r, prefix):
        if r[f"{prefix}_us"] != r[f"{prefix}_us"]:  # NaN: not run
            return f"{'n/a':>10} {'':>7} {'':>7} {'':>6}"
        return (f"{r[prefix + '_us']:>10.1f} {r[prefix + '_algbw']:>7.2f} "
                f"{r[prefix + '_busbw']:>7.2f} {r[prefix + '_wrong']:>6}")

    for r in rows:
        print(f"{r['bytes']:>12} {r['count']:>11} {r['type']:>8} {r['redop']:>5} | "
              f"{figures(r, 'oop')} | {figures(r, 'ip')} | {figures(r, 'mpi')} | "
              f"{r['mpi_us'] / r['hvdmx_us']:>9.2f}")


def plot_rows(rows: list, kind: str, n: int, path: str) -> None:
    """busbw against size for hvdmx and MPI."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes_ = [r["bytes"] for r in rows]
    ax.plot(sizes_, [r["oop_busbw"] for r in rows], "o-", label="hvdmx out of place")
    if any(r["ip_us"] == r["ip_us"] for r in rows):
        ax.plot(sizes_, [r["ip_busbw"] for r in rows], "^-", label="hvdmx in place")
    if any(r["mpi_us"] == r["mpi_us"] for r in rows):  # not all NaN
        ax.plot(sizes_, [r["mpi_busbw"] for r in rows], "s--", label=MPI_CALL[kind])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"{kind}, {n} ranks, {rows[0]['type']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_model(row: dict, n: int) -> None:
    print(f"# {row['model']} gradients: {row['tensors']} tensors, "
          f"{row['bytes'] / 1e6:.1f} MB, {n} ranks; ms per iteration "
          f"(mean of {row['iters']}{_of_rounds(row['rounds'])}); memory floor: "
          "every rank reads and writes its gradients once, all at once")
    adasum = "adasum_ms" in row
    print(f"{'hvdmx':>10} " + (f"{'hvdmx Adasum':>13} {'Adasum/hvdmx':>13} " if adasum else "")
          + f"{'memory floor':>13} {'MPI per tensor':>15} "
          f"{'MPI fused':>10} {'MPI fused + copies':>19}")
    nan = float("nan")
    print(f"{row['hvdmx_ms']:>10.1f} "
          + (f"{row['adasum_ms']:>13.1f} {row['adasum_ms'] / row['hvdmx_ms']:>13.2f} "
             if adasum else "")
          + f"{row['floor_ms']:>13.1f} "
          f"{row.get('mpi_per_tensor_ms', nan):>15.1f}"
          f" {row.get('mpi_fused_ms', nan):>10.1f}"
          f" {row.get('mpi_fused_copies_ms', nan):>19.1f}")


def print_idle(rows: list, seconds: float) -> None:
    print(f"# CPU used while idle for {seconds:g} s after hvd.init()")
    print(f"{'rank':>4} {'cpu s':>8} {'% of a core':>12}")
    for r in rows:
        print(f"{r['rank']:>4} {r['cpu_s']:>8.3f} {r['core_percent']:>12.2f}")
