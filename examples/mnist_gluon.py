"""Data-parallel training of a small Gluon CNN on handwritten digits with hvdmx.

    mpiexec -n 2 python examples/mnist_gluon.py                      # scikit-learn's digits
    mpiexec -n 2 python examples/mnist_gluon.py --data-dir ~/mnist   # MNIST idx files

Every rank trains on its own shard of the training set; DistributedTrainer
averages the gradients over all ranks at every step, so the job trains one
model on a batch of batch-size x ranks samples (with --local-sgd-steps H,
each rank updates on its own and the parameters are averaged every H
steps instead; add --hierarchical-local-sgd to average the gradients inside
each host every step). The learning rate follows the job's batch linearly,
after a linear warm-up from one rank's (Goyal et al.), and the default batch
per rank shrinks where the data set would leave too few steps an epoch: at
1 to 8 ranks the digits reach a test accuracy >= 0.95 (docs/training.md,
"The digits example at 1 to 8 ranks"). With --op adasum the gradients are
combined by Adasum instead of averaged, at one rank's learning rate at any
number of ranks, without warm-up (docs/training.md#adasum). Rank 0 logs MXNet
Speedometer lines (speed in samples/sec of the whole job). At the end, the
test accuracy over the whole test set, and a check that every rank holds
bitwise-identical parameters (the exit status is 1 when they differ).

Without --data-dir it uses the 8x8 handwritten digits that scikit-learn ships
(1797 images, no download; `pip install scikit-learn`). With --data-dir it
reads train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte
and t10k-labels-idx1-ubyte, each optionally gzipped.
"""
import argparse
import gzip
import hashlib
import importlib
import logging
import os
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon import nn

import hvdmx as hvd

# Goyal et al.'s linear scaling of the learning rate (lr x ranks for a batch
# of 32 x ranks) holds while the job still makes enough steps. On the 1,437
# training digits, 32 per rank at 8 ranks leaves 5 steps an epoch, 40 in 8
# epochs: too few at any learning rate, warm-up or not (0.09 to 0.90 in
# docs/training.md's sweep). The default batch therefore keeps at least this
# many steps an epoch, shrinking the batch per rank where needed.
MIN_STEPS = 20

# One-bit compression (--compression onebit) sends each gradient as signs and
# two means per 256 values, with the error fed back into the next step: the
# update is noisier, and at the plain defaults (lr 0.02, 8 epochs) the test
# accuracy ended between 0.919 and 0.978 depending only on the CPU's kernels
# (issue 59; docs/training.md, "The digits example on every CPU kernel"). Half
# the rate over twice the epochs ends between 0.98 and 0.995 on all of them.
DEFAULTS = {"epochs": 8, "lr": 0.02}
ONEBIT_DEFAULTS = {"epochs": 16, "lr": 0.01}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train a small CNN on handwritten digits with hvdmx (data parallel; run "
                    "it under mpiexec).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data-dir", default=None,
                        help="directory with the MNIST idx files (optionally .gz); default: "
                             "scikit-learn's 8x8 digits")
    parser.add_argument("--epochs", type=int, default=argparse.SUPPRESS,
                        help=f"passes over the training set (default: {DEFAULTS['epochs']}; "
                             f"{ONEBIT_DEFAULTS['epochs']} with --compression onebit)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples per rank and step; if not given, 32, or fewer where "
                             f"32 x ranks would leave each epoch fewer than {MIN_STEPS} "
                             f"steps: the largest batch that leaves {MIN_STEPS}")
    parser.add_argument("--lr", type=float, default=argparse.SUPPRESS,
                        help=f"learning rate of a batch of 32 (default: {DEFAULTS['lr']}; "
                             f"{ONEBIT_DEFAULTS['lr']} with --compression onebit); "
                             "the job's batch of B samples "
                             "uses lr x B / 32, lr x ranks at 32 per rank (linear scaling), "
                             "reached after the warm-up (with --op adasum: lr x B / 32 for "
                             "a rank's batch of B, at any number of ranks)")
    parser.add_argument("--warmup-epochs", type=float, default=2,
                        help="epochs over which the learning rate grows linearly from one "
                             "rank's to the job's (Goyal et al.'s gradual warm-up; 0: the "
                             "job's from the first step)")
    parser.add_argument("--op", choices=["average", "adasum"], default="average",
                        help="how the gradients are combined: average (learning rate scaled "
                             "with the ranks, after the warm-up) or adasum (Adasum, one "
                             "rank's learning rate, no warm-up)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--log-interval", type=int, default=10,
                        help="batches between Speedometer lines")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send gradients as float16 (the same as --compression fp16)")
    parser.add_argument("--compression", choices=["none", "fp16", "onebit"], default="none",
                        help="how gradients travel: as they are, as float16, or as signs and "
                             "a scale with error feedback (hvd.Compression.onebit)")
    parser.add_argument("--local-sgd-steps", type=int, default=1, metavar="H",
                        help="local SGD: each rank updates on its own and the parameters are "
                             "averaged every H steps (1: average the gradients every step)")
    parser.add_argument("--hierarchical-local-sgd", action="store_true",
                        help="with --local-sgd-steps H: average the gradients over each host's "
                             "ranks every step, the parameters over all ranks every H steps")
    parser.add_argument("--easgd-beta", type=float, default=None, metavar="BETA",
                        help="with --local-sgd-steps H: elastic averaging (EASGD) every H "
                             "steps instead of the average, the center moving BETA (e.g. 0.9) "
                             "toward the ranks' mean; the center is evaluated")
    parser.add_argument("--seed", type=int, default=42, help="data split and shuffling seed")
    args = parser.parse_args(argv)
    for name, value in (ONEBIT_DEFAULTS if args.compression == "onebit" else DEFAULTS).items():
        if not hasattr(args, name):  # not given (argparse.SUPPRESS)
            setattr(args, name, value)
    if args.epochs < 1 or (args.batch_size is not None and args.batch_size < 1) \
            or args.log_interval < 1:
        parser.error("--epochs, --batch-size and --log-interval must be >= 1")
    if not args.warmup_epochs >= 0:
        parser.error(f"--warmup-epochs must be >= 0 (got {args.warmup_epochs})")
    return args


# --- data --------------------------------------------------------------------

def read_idx(path):
    """An array from an idx file (the MNIST format), gzipped or not."""
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if raw[:2] != b"\0\0" or raw[2] != 0x08:
        raise ValueError(f"{path}: not an idx file of unsigned bytes")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_mnist(data_dir):
    def images(name):
        return (read_idx(os.path.join(data_dir, name)).astype(np.float32) / 255.0)[:, None]

    def labels(name):
        return read_idx(os.path.join(data_dir, name)).astype(np.float32)

    return ((images("train-images-idx3-ubyte"), labels("train-labels-idx1-ubyte")),
            (images("t10k-images-idx3-ubyte"), labels("t10k-labels-idx1-ubyte")))


# Where hvdmx's own venv (`make venv`) puts scikit-learn and SciPy: apart from
# site-packages, because MXNet imports both at `import mxnet` whenever it can
# (for mxnet.model's scikit-learn base class, and scipy.sparse), which costs
# 0.7 s of every process's start and most of hvdmx's test suite's processes
# need neither. Anywhere else, scikit-learn is simply installed.
SKLEARN_APART = os.path.join(sys.prefix, "scikit-learn")


def sklearn_digits():
    """scikit-learn's load_digits(): where Python finds scikit-learn, or in
    SKLEARN_APART."""
    try:
        from sklearn.datasets import load_digits as sklearn_load
    except ImportError:
        if not os.path.isdir(SKLEARN_APART):
            sys.exit("the digits come with scikit-learn, which this Python cannot import: "
                     "pip install scikit-learn, or pass --data-dir with MNIST's files")
        sys.path.append(SKLEARN_APART)
        sklearn_load = importlib.import_module("sklearn.datasets").load_digits
    return sklearn_load()


def load_digits(seed):
    """scikit-learn's 8x8 digits, split 80/20 the same way on every rank."""
    digits = sklearn_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None]  # (n, 1, 8, 8) in [0, 1]
    y = digits.target.astype(np.float32)
    order = np.random.RandomState(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def default_batch_size(samples_per_rank):
    """32, or less where a rank's share of the training set would make fewer
    than MIN_STEPS steps an epoch of 32: the largest batch that makes
    MIN_STEPS (at least 1)."""
    return max(1, min(32, samples_per_rank // MIN_STEPS))


def rank_shard(x, y, rank, size):
    """This rank's training samples: the same count on every rank (the last
    len(x) % size samples are left out), so all ranks make the same number of
    steps and every allreduce has a partner."""
    per_rank = len(x) // size
    return x[rank::size][:per_rank], y[rank::size][:per_rank]


# --- model -------------------------------------------------------------------

def build_net(image_size):
    """Two 3x3 convolutions and two dense layers; one more pooling for 28x28."""
    net = nn.HybridSequential(prefix="cnn_")
    with net.name_scope():
        net.add(nn.Conv2D(32, kernel_size=3, padding=1, activation="relu"))
        if image_size > 16:
            net.add(nn.MaxPool2D(pool_size=2))
        net.add(nn.Conv2D(64, kernel_size=3, padding=1, activation="relu"),
                nn.MaxPool2D(pool_size=2),
                nn.Flatten(),
                nn.Dense(128, activation="relu"),
                nn.Dense(10))
    return net


def evaluate(net, x, y, batch_size, ctx):
    """(correct, total) on this rank's samples."""
    correct = 0
    for start in range(0, len(x), batch_size):
        out = net(mx.nd.array(x[start:start + batch_size], ctx=ctx))
        pred = out.argmax(axis=1).asnumpy()
        correct += int((pred == y[start:start + batch_size]).sum())
    return correct, len(x)


def warmup_lr(step, warmup_steps, lr, size):
    """The learning rate of step `step` (0, 1, ...) under Goyal et al.'s
    gradual warm-up ("Accurate, Large Minibatch SGD", 2017): from `lr`, one
    rank's, linearly to `lr` x `size`, the rate of the job's `size` times
    larger batch, reached at step `warmup_steps` and kept from there."""
    if step >= warmup_steps:
        return lr * size
    return lr + (lr * size - lr) * step / warmup_steps


def parameter_digest(net):
    """A 48-bit digest of all parameter bytes, in a fixed order."""
    h = hashlib.blake2b(digest_size=6)
    for name, p in sorted(net.collect_params().items()):
        h.update(name.encode())
        h.update(p.data().asnumpy().tobytes())
    return int.from_bytes(h.digest(), "little")


class ReplicasDiffer(RuntimeError):
    """The ranks' parameters are not bitwise identical at the end."""


def check_replicas(net, rank, name):
    """Replicas must not drift: every rank compares a digest of every
    parameter's bytes with the others' (one allreduce of the max of d and -d:
    equal everywhere exactly when max(d) == min(d)); raises ReplicasDiffer
    when they differ."""
    digest = parameter_digest(net)
    both = hvd.allreduce(mx.nd.array([digest, -digest], dtype="int64"), op=hvd.Max,
                         name=name).asnumpy()
    if both[0] != -both[1]:
        raise ReplicasDiffer(f"rank {rank}: the ranks' parameters are NOT identical "
                             f"(digest {digest:012x})")


def lr_ranks(args, size):
    """The ranks the job's learning rate scales with: one under --op adasum
    (Adasum's step has one rank's size: one rank's rate, nothing to warm up
    to), else all of them."""
    return 1 if args.op == "adasum" else size


def build_trainer(params, args, learning_rate):
    """The DistributedTrainer that the flags ask for: SGD with --momentum,
    --compression (or --fp16-allreduce), --local-sgd-steps,
    --hierarchical-local-sgd, --easgd-beta and --op (elastic_mnist.py builds
    its trainer here too)."""
    compression = getattr(hvd.Compression, "fp16" if args.fp16_allreduce else args.compression)
    return hvd.DistributedTrainer(params, "sgd",
                                  {"learning_rate": learning_rate, "momentum": args.momentum},
                                  compression=compression,
                                  local_sgd_steps=args.local_sgd_steps,
                                  hierarchical_local_sgd=args.hierarchical_local_sgd,
                                  easgd_beta=args.easgd_beta,
                                  op=hvd.Adasum if args.op == "adasum" else hvd.Average)


def main(argv=None):
    """Trains, evaluates and checks the replicas; returns the test accuracy.
    Raises ReplicasDiffer (a RuntimeError) when the ranks' parameters are not identical."""
    args = parse_args(argv)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    log = logging.getLogger("mnist_gluon")
    if rank == 0:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        logging.getLogger().setLevel(logging.INFO)
    else:
        logging.getLogger().setLevel(logging.WARNING)
    ctx = mx.gpu(hvd.local_rank()) if hvd.cuda_built() and mx.context.num_gpus() \
        else mx.cpu(hvd.local_rank())

    (x_train, y_train), (x_test, y_test) = (load_mnist(args.data_dir) if args.data_dir
                                            else load_digits(args.seed))
    x_local, y_local = rank_shard(x_train, y_train, rank, size)
    batch_size = args.batch_size or default_batch_size(len(x_local))
    steps = len(x_local) // batch_size
    if steps == 0:
        raise ValueError(f"{len(x_local)} training samples per rank is less than one batch "
                         f"of {batch_size}; use a smaller --batch-size")
    log.info("%s: %d training samples (%d per rank, %d steps of %d x %d per epoch), %d test "
             "samples, %d ranks", args.data_dir or "scikit-learn digits", len(x_train),
             len(x_local), steps, batch_size, size, len(x_test), size)

    # Each rank initializes differently (its own seed); broadcast_parameters
    # then gives every rank rank 0's values, as soon as the shapes are known
    # (deferred initialization, at the first forward pass).
    mx.random.seed(args.seed + rank)
    net = build_net(x_train.shape[-1])
    net.initialize(mx.init.Xavier(magnitude=2.24), ctx=ctx)
    net.hybridize()
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)

    # One rank's learning rate for its batch; the job's is size times that.
    rank_lr = args.lr * batch_size / 32
    ranks_lr = lr_ranks(args, size)
    trainer = build_trainer(net.collect_params(), args, rank_lr * ranks_lr)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    metric = mx.metric.Accuracy()
    speedometer = mx.callback.Speedometer(batch_size * size, args.log_interval)

    warmup_steps = round(args.warmup_epochs * steps)
    start = time.time()
    for epoch in range(args.epochs):
        tic = time.time()
        metric.reset()
        order = np.random.RandomState(args.seed * 1000 + epoch * size + rank) \
            .permutation(len(x_local))
        for nbatch in range(steps):
            trainer.set_learning_rate(warmup_lr(epoch * steps + nbatch, warmup_steps, rank_lr,
                                                ranks_lr))
            idx = order[nbatch * batch_size:(nbatch + 1) * batch_size]
            data = mx.nd.array(x_local[idx], ctx=ctx)
            label = mx.nd.array(y_local[idx], ctx=ctx)
            with autograd.record():
                out = net(data)
                loss = loss_fn(out, label)
            loss.backward()
            trainer.step(batch_size)
            metric.update([label], [out])
            speedometer(mx.model.BatchEndParam(epoch=epoch, nbatch=nbatch + 1,
                                               eval_metric=metric, locals=None))
        name, value = metric.get_global()
        log.info("Epoch[%d] Train-%s=%f (rank 0's shard)", epoch, name, value)
        log.info("Epoch[%d] Time cost=%.3f", epoch, time.time() - tic)
    # Under local SGD the replicas differ between averages: average once more
    # (under EASGD: every rank takes the center).
    trainer.average_parameters()
    train_seconds = time.time() - start

    # Test accuracy over the whole test set: each rank scores its part.
    correct, total = evaluate(net, x_test[rank::size], y_test[rank::size], 256, ctx)
    counts = hvd.allreduce(mx.nd.array([correct, total], dtype="int64"), op=hvd.Sum,
                           name="mnist.test_counts").asnumpy()
    accuracy = counts[0] / counts[1]
    log.info("test accuracy %.4f (%d/%d) after %d epochs; training took %.1f s on %d ranks",
             accuracy, counts[0], counts[1], args.epochs, train_seconds, size)

    check_replicas(net, rank, "mnist.param_digest")
    log.info("parameters bitwise identical on all %d ranks", size)
    return float(accuracy)


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as error:
        print(error, file=sys.stderr, flush=True)
        sys.exit(1)
