"""What hvd.elastic's commit() costs beside a training step, on the digits
example's model and loop (examples/mnist_gluon.py: two convolutions, two
dense layers, SGD with momentum, DistributedTrainer, the accuracy metric
updated at every step).

    mpiexec -n 2 python benchmarks/elastic_commit.py [--steps 200] [--every K]

Prints one table (rank 0): the mean time of a step without commits, of a
step followed by a commit, their difference (what a commit adds to a step in
a training loop), that difference over the step, and a commit alone
(save() + check_host_updates(), waited for). Each row is the median of
--repeats runs of --steps steps, after a warm-up.
"""
import argparse
import os
import statistics
import sys
import time

import mxnet as mx
from mxnet import autograd, gluon

import hvdmx as hvd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from mnist_gluon import build_net, load_digits  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--every", type=int, default=1, metavar="K",
                        help="commit every K steps in the step+commit loop")
    args = parser.parse_args()
    hvd.init()
    (x, y), _ = load_digits(42)
    b = args.batch_size
    ctx = mx.cpu(hvd.local_rank())
    net = build_net(x.shape[-1])
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net(mx.nd.array(x[:b], ctx=ctx))  # shapes known: every parameter exists
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.02, "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    metric = mx.metric.Accuracy()
    state = hvd.elastic.GluonState(net, trainer, epoch=0, batch=0)
    batches = [(mx.nd.array(x[i * b:(i + 1) * b], ctx=ctx),
                mx.nd.array(y[i * b:(i + 1) * b], ctx=ctx)) for i in range(len(x) // b)]

    def steps(n, commit):
        start = time.perf_counter()
        for i in range(n):
            data, label = batches[i % len(batches)]
            with autograd.record():
                out = net(data)
                loss = loss_fn(out, label)
            loss.backward()
            trainer.step(b)
            metric.update([label], [out])  # as mnist_gluon.py's loop: reads the output
            if commit and i % args.every == 0:
                state.batch = i
                state.commit()
        mx.nd.waitall()
        return (time.perf_counter() - start) / n

    def commits(n):
        start = time.perf_counter()
        for _ in range(n):
            state.commit()
        mx.nd.waitall()
        return (time.perf_counter() - start) / n

    steps(20, False)
    steps(20, True)
    plain, with_commit, alone = [], [], []
    for _ in range(args.repeats):
        plain.append(steps(args.steps, False))
        with_commit.append(steps(args.steps, True))
        alone.append(commits(args.steps))
    step, both = statistics.median(plain), statistics.median(with_commit)
    commit = statistics.median(alone)
    if hvd.rank() == 0:
        size = sum(p.data().size * 4 for p in net.collect_params().values())
        print(f"# digits CNN, {size / 1e6:.2f} MB of float32 parameters (and as much "
              f"momentum), {hvd.size()} ranks, batch {b} per rank, {args.steps} steps x "
              f"{args.repeats}, medians, a commit every {args.every} step(s)")
        print(f"{'step(ms)':>10} {'step+commit(ms)':>16} {'added(ms)':>10} {'added/step':>11} "
              f"{'commit alone(ms)':>17}")
        print(f"{step * 1e3:10.3f} {both * 1e3:16.3f} {(both - step) * 1e3:10.3f} "
              f"{(both - step) / step:10.1%} {commit * 1e3:17.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
