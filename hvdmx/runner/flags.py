"""hvdmxrun's tuning flags: their argparse group, and the HVDMX_* variables
they set on every rank (docs/running.md, "Tuning flags"). Values are checked
here, before anything starts, with a message naming the flag, the value and
what is accepted; tests/test_run.py checks that the core accepts all of them.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, Dict

LOG_LEVELS = ("trace", "debug", "info", "warning", "warn", "error", "fatal")
ALLREDUCE_ALGOS = ("auto", "shm", "ring", "mpi")
TRANSPORTS = ("auto", "tcp", "mpi")


def _number(what: str, integer: bool = False, minimum: int = 0) -> Callable[[str], float]:
    """An argparse type: a finite number >= `minimum` (an integer if `integer`)."""
    def parse(text: str):
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < minimum:
            kind = "an integer" if integer else "a number"
            raise argparse.ArgumentTypeError(
                f"invalid value {text!r}: expected {kind} >= {minimum} ({what})")
        return value
    return parse


def _word(words) -> Callable[[str], str]:
    """An argparse type: one of `words`, in any case; returned in lower case."""
    def parse(text: str) -> str:
        if text.lower() not in words:
            raise argparse.ArgumentTypeError(
                f"invalid value {text!r}: expected one of {', '.join(words)} (any case)")
        return text.lower()
    return parse


def _nonempty(what: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"invalid value '': expected {what}")
        return text
    return parse


def _format_number(value: float) -> str:
    """5.0 -> '5', 2.5 -> '2.5': what the core's parser reads back exactly."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def tuning_env(args: argparse.Namespace) -> Dict[str, str]:
    """The HVDMX_* variables the tuning flags ask for (only flags that were given)."""
    env = {}
    if args.fusion_threshold_mb is not None:
        env["HVDMX_FUSION_THRESHOLD"] = str(round(args.fusion_threshold_mb * 1024 * 1024))
    if args.fusion_max_tensor_kb is not None:
        env["HVDMX_FUSION_MAX_TENSOR_BYTES"] = str(round(args.fusion_max_tensor_kb * 1024))
    if args.fusion_piece_kb is not None:
        env["HVDMX_FUSION_PIECE_BYTES"] = str(round(args.fusion_piece_kb * 1024))
    if args.output_pool_mb is not None:
        env["HVDMX_OUTPUT_POOL_BYTES"] = str(round(args.output_pool_mb * 1024 * 1024))
    if args.cycle_time_ms is not None:
        env["HVDMX_CYCLE_TIME"] = _format_number(args.cycle_time_ms)
    if args.cache_capacity is not None:
        env["HVDMX_CACHE_CAPACITY"] = str(args.cache_capacity)
    if args.allreduce_algo is not None:
        env["HVDMX_ALLREDUCE_ALGO"] = args.allreduce_algo
    if args.hierarchical_allreduce:
        env["HVDMX_HIERARCHICAL_ALLREDUCE"] = "1"
    if args.transport is not None:
        env["HVDMX_TRANSPORT"] = args.transport
    if args.network_interface is not None:
        env["HVDMX_TCP_IFACE"] = args.network_interface
    if args.timeline_filename is not None:
        env["HVDMX_TIMELINE"] = args.timeline_filename
    if args.timeline_mark_cycles:
        env["HVDMX_TIMELINE_MARK_CYCLES"] = "1"
    if args.autotune:
        env["HVDMX_AUTOTUNE"] = "1"
    if args.autotune_log_file is not None:
        env["HVDMX_AUTOTUNE_LOG"] = args.autotune_log_file
    if args.no_stall_check:
        # Both times at 0 ("off") do what Horovod's HOROVOD_STALL_CHECK_DISABLE
        # does; the core has no separate switch.
        env["HVDMX_STALL_CHECK_TIME_SECONDS"] = "0"
        env["HVDMX_STALL_SHUTDOWN_TIME_SECONDS"] = "0"
    if args.stall_check_warning_time_seconds is not None:
        env["HVDMX_STALL_CHECK_TIME_SECONDS"] = _format_number(
            args.stall_check_warning_time_seconds)
    if args.stall_check_shutdown_time_seconds is not None:
        env["HVDMX_STALL_SHUTDOWN_TIME_SECONDS"] = _format_number(
            args.stall_check_shutdown_time_seconds)
    if args.log_level is not None:
        env["HVDMX_LOG_LEVEL"] = args.log_level
    return env


def add_tuning_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the tuning group to hvdmxrun's parser; tuning_env reads it back."""
    tuning = parser.add_argument_group(
        "tuning (each sets an environment variable on every rank; see docs/env.md)")
    tuning.add_argument("--fusion-threshold-mb", type=_number("MiB; 0 turns fusion off"),
                        metavar="MB", help="largest fused group of tensors, in MiB "
                        "(HVDMX_FUSION_THRESHOLD, in bytes; default 64)")
    tuning.add_argument("--fusion-max-tensor-kb", type=_number("KiB; 0 fuses nothing"),
                        metavar="KB", help="tensors larger than this run alone, unfused, in KiB "
                        "(HVDMX_FUSION_MAX_TENSOR_BYTES, in bytes; default 256)")
    tuning.add_argument("--fusion-piece-kb", type=_number("KiB", minimum=1),
                        metavar="KB", help="a fused group goes through the fusion buffer in "
                        "pieces of this many KiB, on the ring and MPI "
                        "(HVDMX_FUSION_PIECE_BYTES, in bytes; default 1024)")
    tuning.add_argument("--output-pool-mb", type=_number("MiB; 0 keeps no output memory"),
                        metavar="MB", help="memory of dropped out-of-place outputs each "
                        "process keeps for the next ones, in MiB (HVDMX_OUTPUT_POOL_BYTES, "
                        "in bytes; default 256)")
    tuning.add_argument("--cycle-time-ms", type=_number("milliseconds; 0 starts each round "
                                                        "at once"),
                        metavar="MS", help="wait before each negotiation round, in ms "
                        "(HVDMX_CYCLE_TIME; default 0)")
    tuning.add_argument("--cache-capacity", type=_number("entries; 0 turns the cache off",
                                                         integer=True),
                        metavar="N", help="negotiated responses each rank remembers "
                        "(HVDMX_CACHE_CAPACITY; default 1024)")
    tuning.add_argument("--allreduce-algo", type=_word(ALLREDUCE_ALGOS), metavar="ALGO",
                        help=f"allreduce algorithm: {', '.join(ALLREDUCE_ALGOS)} "
                             "(HVDMX_ALLREDUCE_ALGO; default auto: chosen by size and "
                             "topology)")
    tuning.add_argument("--hierarchical-allreduce", action="store_true",
                        help="allreduce within each host first, then across hosts "
                             "(HVDMX_HIERARCHICAL_ALLREDUCE=1)")
    tuning.add_argument("--transport", type=_word(TRANSPORTS), metavar="NAME",
                        help=f"how ranks talk outside shared memory: {', '.join(TRANSPORTS)} "
                             "(HVDMX_TRANSPORT; default auto: tcp when the job spans hosts)")
    tuning.add_argument("--network-interface", type=_nonempty("an interface name"),
                        metavar="IFACE", help="the interface the tcp transport uses, e.g. "
                        "eth0 (HVDMX_TCP_IFACE; default: the address of the host's name)")
    tuning.add_argument("--timeline-filename", type=_nonempty("a file name"), metavar="FILE",
                        help="write a Chrome-trace timeline of the collectives to FILE "
                             "(HVDMX_TIMELINE)")
    tuning.add_argument("--timeline-mark-cycles", action="store_true",
                        help="mark each background cycle in the timeline "
                             "(HVDMX_TIMELINE_MARK_CYCLES=1)")
    tuning.add_argument("--autotune", action="store_true",
                        help="let hvdmx tune its settings while training "
                             "(HVDMX_AUTOTUNE=1)")
    tuning.add_argument("--autotune-log-file", type=_nonempty("a file name"), metavar="FILE",
                        help="with --autotune, log the settings tried to FILE "
                             "(HVDMX_AUTOTUNE_LOG)")
    stall = tuning.add_mutually_exclusive_group()
    stall.add_argument("--no-stall-check", action="store_true",
                       help="no stall warning and no stall shutdown (sets "
                            "HVDMX_STALL_CHECK_TIME_SECONDS and "
                            "HVDMX_STALL_SHUTDOWN_TIME_SECONDS to 0)")
    stall.add_argument("--stall-check-warning-time-seconds",
                       type=_number("seconds; 0 turns the warning off"), metavar="S",
                       help="warn about a collective that waits this long for other ranks "
                            "(HVDMX_STALL_CHECK_TIME_SECONDS; default 60)")
    tuning.add_argument("--stall-check-shutdown-time-seconds",
                        type=_number("seconds; 0 never shuts down"), metavar="S",
                        help="shut hvdmx down when a collective waits this long "
                             "(HVDMX_STALL_SHUTDOWN_TIME_SECONDS)")
    tuning.add_argument("--log-level", type=_word(LOG_LEVELS), metavar="LEVEL",
                        help=f"hvdmx's log level: {', '.join(LOG_LEVELS)} (HVDMX_LOG_LEVEL; "
                             "default warning)")
