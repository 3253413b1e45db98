"""A small elastic job for tests/test_elastic_jobs.py: a vector of float64
that every step moves by the sum over the ranks of (step + 1), under
hvd.elastic.run, committed at every step. The state remembers the job's
size at each step that counted, so the program knows what the vector must
hold whatever memberships it ran at, and checks it.

    python tests/elastic_job.py STEPS [--raise-on-rank R --at K] [--sleep S]

Prints "STEP k SIZE n" on rank 0 after each step (the tests watch it),
"RESET size n" on every rank after each reset, and at the end on rank 0
"DONE value V expected E size n identical B" (exit status 1 if V and E
differ, or if the ranks' vectors are not bitwise identical).
"""
import argparse
import sys
import time

import mxnet as mx
import numpy as np

import hvdmx as hvd


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("steps", type=int)
    parser.add_argument("--raise-on-rank", type=int, default=None)
    parser.add_argument("--at", type=int, default=0)
    parser.add_argument("--sleep", type=float, default=0.2)
    args = parser.parse_args()
    hvd.init()
    # (step, size) of every step that counted, so the expectation follows
    # the membership the job actually ran at.
    state = hvd.elastic.ObjectState(value=np.zeros(4), step=0, history=[])
    state.register_reset_callbacks([lambda: print(f"RESET size {hvd.size()}", flush=True)])

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            if args.raise_on_rank == hvd.rank() and state.step == args.at:
                raise ValueError(f"an error in the training script on rank {hvd.rank()}")
            grad = mx.nd.full((4,), state.step + 1.0, dtype="float64")
            total = hvd.allreduce(grad, op=hvd.Sum, name="elastic_job.grad").asnumpy()
            state.value = state.value + total
            state.history = state.history + [hvd.size()]
            state.step += 1
            state.commit()
            if hvd.rank() == 0:
                print(f"STEP {state.step} SIZE {hvd.size()}", flush=True)
            time.sleep(args.sleep)

    train(state)
    expected = sum((k + 1.0) * n for k, n in enumerate(state.history))
    digest = hvd.allgather_object(state.value.tobytes())
    same = all(d == digest[0] for d in digest)
    if hvd.rank() == 0:
        print(f"DONE value {state.value[0]:g} expected {expected:g} size {hvd.size()} "
              f"identical {same}", flush=True)
    if state.value[0] != expected or not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
