"""The digits example (mnist_gluon.py) as an elastic job: hosts may fail or
join while it trains, and it goes on (docs/elastic.md).

    hvdmxrun -np 3 --min-np 2 -H a:1,b:1,c:1 python examples/elastic_mnist.py
    hvdmxrun -np 2 --max-np 4 --host-discovery-script ./hosts.sh --slots-per-host 1 \\
        python examples/elastic_mnist.py --epochs 10

It takes mnist_gluon.py's flags (--compression, --local-sgd-steps,
--easgd-beta, --op, ... and their defaults) and trains the same model the
same way, inside ``hvd.elastic.run``: the parameters, the optimizer's state,
one-bit compression's residuals, the EASGD center and the place in the
training (epoch, batch) are a ``hvd.elastic.GluonState``,
committed every --commit-every batches and at the end of each epoch. When a
host fails, the survivors' collectives fail, hvdmx restarts in the same
processes with the ranks that are left, the state goes back to the last
commit, and the training goes on from there; when a host joins, it does so
at the next commit. At every (re)start the training data are re-sharded by
the job's current size and rank, and the learning rate follows the current
size. It ends, like mnist_gluon.py, with the test accuracy and whether the
ranks' parameters are bitwise identical (exit status 1 if not).
"""
import logging
import os
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hvdmx as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mnist_gluon as digits  # noqa: E402  (the model, the data and the checks)


def parse_args(argv=None):
    """mnist_gluon.py's flags, and how often to commit."""
    extra = list(argv if argv is not None else sys.argv[1:])
    commit_every = 10
    if "--commit-every" in extra:
        at = extra.index("--commit-every")
        try:
            commit_every = int(extra[at + 1])
        except (IndexError, ValueError):
            sys.exit("elastic_mnist.py: --commit-every needs a whole number of batches >= 1")
        del extra[at:at + 2]
        if commit_every < 1:
            sys.exit(f"elastic_mnist.py: --commit-every {commit_every} must be >= 1")
    args = digits.parse_args(extra)
    args.commit_every = commit_every
    return args


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    log = logging.getLogger("elastic_mnist")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ctx = mx.cpu()
    (x_train, y_train), (x_test, y_test) = (digits.load_mnist(args.data_dir) if args.data_dir
                                            else digits.load_digits(args.seed))
    mx.random.seed(args.seed + hvd.rank())
    net = digits.build_net(x_train.shape[-1])
    net.initialize(mx.init.Xavier(magnitude=2.24), ctx=ctx)
    net(mx.nd.array(x_train[:1], ctx=ctx))  # shapes known: the state can hold them
    # The trainer of the same flags as mnist_gluon.main's (the rate is set at every step).
    trainer = digits.build_trainer(net.collect_params(), args, args.lr)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    state = hvd.elastic.GluonState(net.collect_params(), trainer, epoch=0, batch=0)

    def on_reset():
        log.info("rank %d: reset; the job now has %d ranks (epoch %d, batch %d)",
                 hvd.rank(), hvd.size(), state.epoch, state.batch)
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        # Everything that depends on the job's shape is worked out again
        # after every reset: this rank's shard, the batch and the rate.
        rank, size = hvd.rank(), hvd.size()
        x_local, y_local = digits.rank_shard(x_train, y_train, rank, size)
        batch_size = args.batch_size or digits.default_batch_size(len(x_local))
        steps = len(x_local) // batch_size
        rank_lr = args.lr * batch_size / 32
        lr_ranks = digits.lr_ranks(args, size)
        warmup_steps = round(args.warmup_epochs * steps)
        while state.epoch < args.epochs:
            order = np.random.RandomState(args.seed * 1000 + state.epoch * size + rank) \
                .permutation(len(x_local))
            tic = time.time()
            for nbatch in range(min(state.batch, steps), steps):
                trainer.set_learning_rate(digits.warmup_lr(state.epoch * steps + nbatch,
                                                           warmup_steps, rank_lr, lr_ranks))
                idx = order[nbatch * batch_size:(nbatch + 1) * batch_size]
                data = mx.nd.array(x_local[idx], ctx=ctx)
                label = mx.nd.array(y_local[idx], ctx=ctx)
                with autograd.record():
                    loss = loss_fn(net(data), label)
                loss.backward()
                trainer.step(batch_size)
                state.batch = nbatch + 1
                if state.batch % args.commit_every == 0:
                    state.commit()
            if rank == 0:
                log.info("Epoch[%d] Time cost=%.3f on %d ranks", state.epoch, time.time() - tic,
                         size)
            state.epoch += 1
            state.batch = 0
            state.commit()

    start = time.time()
    train(state)
    # Under local SGD the replicas differ between averages: average once more
    # (under EASGD: every rank takes the center).
    trainer.average_parameters()
    rank, size = hvd.rank(), hvd.size()
    correct, total = digits.evaluate(net, x_test[rank::size], y_test[rank::size], 256, ctx)
    counts = hvd.allreduce(mx.nd.array([correct, total], dtype="int64"), op=hvd.Sum,
                           name="elastic_mnist.test_counts").asnumpy()
    accuracy = counts[0] / counts[1]
    if rank == 0:
        log.info("test accuracy %.4f (%d/%d) after %d epochs; training took %.1f s, ending "
                 "on %d ranks", accuracy, counts[0], counts[1], args.epochs,
                 time.time() - start, size)
    digits.check_replicas(net, rank, "elastic_mnist.param_digest")
    if rank == 0:
        log.info("parameters bitwise identical on all %d ranks", size)
    return float(accuracy)


if __name__ == "__main__":
    try:
        main()
    except digits.ReplicasDiffer as error:
        print(error, file=sys.stderr, flush=True)
        sys.exit(1)
