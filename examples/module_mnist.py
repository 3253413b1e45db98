"""Data-parallel training with MXNet's Module API and hvdmx, on handwritten digits.

    mpiexec -n 2 python examples/module_mnist.py

The model is a symbol (a small CNN) trained by ``mx.mod.Module.fit``; the only
hvdmx parts are the broadcast of the initial parameters and the optimizer,
wrapped in hvd.DistributedOptimizer so that every gradient is averaged over
all ranks before the update. Each rank trains on its own shard of
scikit-learn's 8x8 digits (1797 images, no download), so the job trains one
model on a batch of batch-size x ranks images. Rank 0 logs Speedometer lines;
at the end the test accuracy over the whole test set, and a check that every
rank holds bitwise-identical parameters (exit status 1 when they differ).
"""
import argparse
import hashlib
import logging
import os
import sys

import mxnet as mx
import numpy as np

import hvdmx as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist_gluon import load_digits  # noqa: E402  (the same data, split the same way)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train a small CNN on scikit-learn's digits with the Module API and "
                    "hvd.DistributedOptimizer (data parallel; run it under mpiexec).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank and step")
    parser.add_argument("--lr", type=float, default=0.02,
                        help="learning rate per rank; the job uses lr x ranks")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--log-interval", type=int, default=10,
                        help="batches between Speedometer lines")
    parser.add_argument("--seed", type=int, default=42, help="data split and shuffling seed")
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.log_interval < 1:
        parser.error("--epochs, --batch-size and --log-interval must be >= 1")
    return args


def rank_shard(x, y, rank, size):
    """This rank's samples: the same count on every rank (the last
    len(x) % size are left out), so all ranks make the same number of steps."""
    per_rank = len(x) // size
    return x[rank::size][:per_rank], y[rank::size][:per_rank]


def build_symbol():
    """Two 3x3 convolutions, a pooling and two dense layers, for 8x8 images."""
    data = mx.sym.Variable("data")
    net = mx.sym.Convolution(data, num_filter=32, kernel=(3, 3), pad=(1, 1), name="conv1")
    net = mx.sym.Activation(net, act_type="relu")
    net = mx.sym.Convolution(net, num_filter=64, kernel=(3, 3), pad=(1, 1), name="conv2")
    net = mx.sym.Activation(net, act_type="relu")
    net = mx.sym.Pooling(net, kernel=(2, 2), stride=(2, 2), pool_type="max")
    net = mx.sym.Flatten(net)
    net = mx.sym.FullyConnected(net, num_hidden=128, name="fc1")
    net = mx.sym.Activation(net, act_type="relu")
    net = mx.sym.FullyConnected(net, num_hidden=10, name="fc2")
    return mx.sym.SoftmaxOutput(net, name="softmax")


def parameter_digest(arg_params, aux_params):
    """A 48-bit digest of all parameter bytes, in a fixed order."""
    h = hashlib.blake2b(digest_size=6)
    for params in (arg_params, aux_params):
        for name, value in sorted(params.items()):
            h.update(name.encode())
            h.update(value.asnumpy().tobytes())
    return int.from_bytes(h.digest(), "little")


def main(argv=None):
    """Trains, evaluates and checks the replicas; returns the test accuracy.
    Raises RuntimeError when the ranks' parameters are not identical."""
    args = parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    log = logging.getLogger("module_mnist")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(message)s")
    ctx = mx.cpu(hvd.local_rank())

    (x_train, y_train), (x_test, y_test) = load_digits(args.seed)
    x_local, y_local = rank_shard(x_train, y_train, rank, size)
    if len(x_local) < args.batch_size:
        raise ValueError(f"{len(x_local)} training samples per rank is less than one batch "
                         f"of {args.batch_size}; use a smaller --batch-size")
    np.random.seed(args.seed + rank)  # NDArrayIter shuffles with numpy's global generator
    train_iter = mx.io.NDArrayIter(x_local, y_local, args.batch_size, shuffle=True,
                                   last_batch_handle="discard", label_name="softmax_label")
    log.info("scikit-learn digits: %d training samples (%d per rank, %d steps of %d x %d per "
             "epoch), %d test samples, %d ranks", len(x_train), len(x_local),
             len(x_local) // args.batch_size, args.batch_size, size, len(x_test), size)

    mod = mx.mod.Module(build_symbol(), context=ctx, logger=log)
    mod.bind(data_shapes=train_iter.provide_data, label_shapes=train_iter.provide_label)
    # Each rank draws its own initial values; every rank then takes rank 0's.
    mx.random.seed(args.seed + rank)
    mod.init_params(mx.init.Xavier(magnitude=2.24))
    arg_params, aux_params = mod.get_params()
    hvd.broadcast_parameters(arg_params, root_rank=0, prefix="arg.")
    hvd.broadcast_parameters(aux_params, root_rank=0, prefix="aux.")
    mod.set_params(arg_params, aux_params)

    # rescale_grad = 1 / the local batch: DistributedOptimizer averages the
    # gradients over the ranks, so each update uses the whole job's batch.
    optimizer = hvd.DistributedOptimizer(mx.optimizer.create(
        "sgd", learning_rate=args.lr * size, momentum=args.momentum,
        rescale_grad=1.0 / args.batch_size))
    callback = mx.callback.Speedometer(args.batch_size * size, args.log_interval) \
        if rank == 0 else None
    # fit() binds and initializes again (force_*: quietly), from rank 0's values.
    mod.fit(train_iter, num_epoch=args.epochs, kvstore=None, optimizer=optimizer,
            eval_metric="acc", batch_end_callback=callback, arg_params=arg_params,
            aux_params=aux_params, force_rebind=True, force_init=True)

    # Test accuracy over the whole test set: each rank scores its part.
    x_part, y_part = x_test[rank::size], y_test[rank::size]
    test_iter = mx.io.NDArrayIter(x_part, y_part, 256, label_name="softmax_label")
    pred = mod.predict(test_iter).argmax(axis=1).asnumpy()
    counts = hvd.allreduce(mx.nd.array([int((pred == y_part).sum()), len(y_part)],
                                       dtype="int64"), op=hvd.Sum,
                           name="module_mnist.test_counts").asnumpy()
    accuracy = counts[0] / counts[1]
    log.info("test accuracy %.4f (%d/%d) after %d epochs on %d ranks", accuracy, counts[0],
             counts[1], args.epochs, size)

    # Replicas must not drift: compare a digest of every parameter's bytes.
    digest = parameter_digest(*mod.get_params())
    both = hvd.allreduce(mx.nd.array([digest, -digest], dtype="int64"), op=hvd.Max,
                         name="module_mnist.param_digest").asnumpy()
    if both[0] != -both[1]:
        raise RuntimeError(f"rank {rank}: the ranks' parameters are NOT identical "
                           f"(digest {digest:012x})")
    log.info("parameters bitwise identical on all %d ranks", size)
    return float(accuracy)


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as error:
        print(error, file=sys.stderr, flush=True)
        sys.exit(1)
