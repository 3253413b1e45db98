"""The digits, trained from Spark: the data set is a Spark DataFrame, each
rank reads its own partition of it where it lives, and hvdmx.spark.run runs
the training on ranks placed in Spark tasks.

    python examples/spark_digits.py --num-proc 2                 # local[2]
    python examples/spark_digits.py --num-proc 4 --master spark://host:7077 \
        --conf spark.executorEnv.PYTHONPATH=/path/to/hvdmx

The driver (this process) builds the DataFrame of scikit-learn's 8x8
digits (in a real job it would come from storage: spark.read.parquet(...)),
80% for training, and calls hvdmx.spark.run(train, ..., data=df): Spark
repartitions the DataFrame into one partition per rank, and each rank gets
its task's partition as an MXNet ArrayDataset (hvdmx.spark.rank_dataset)
for a gluon DataLoader. Training is mnist_gluon.py's (same network,
learning rate schedule and replica check), with DistributedTrainer. The
partitions differ in size by a few rows, so the ranks first agree on the
smallest share (an allreduce of the minimum): every rank makes the same
number of steps, so every allreduce has its partners. At the end each rank
scores its part of the test set and rank 0 returns the job's accuracy; the
driver prints it, and whether every rank holds bitwise-identical parameters
(exit status 1 otherwise).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mnist_gluon  # noqa: E402  (the model and the training helpers)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train a small CNN on the digits, from a Spark DataFrame, with "
                    "hvdmx.spark.run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--num-proc", type=int, default=2, help="ranks (Spark tasks)")
    parser.add_argument("--master", default=None,
                        help="Spark master URL; default: the active session's, else "
                             "local[NUM_PROC]")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="a Spark configuration for the session this makes (repeat it)")
    parser.add_argument("--epochs", type=int, default=mnist_gluon.DEFAULTS["epochs"])
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples per rank and step (default: mnist_gluon.py's rule)")
    parser.add_argument("--lr", type=float, default=mnist_gluon.DEFAULTS["lr"],
                        help="learning rate of a batch of 32 (scaled as mnist_gluon.py does)")
    parser.add_argument("--warmup-epochs", type=float, default=2)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--start-timeout", type=float, default=None,
                        help="seconds for every rank to start (hvdmx.spark.run's)")
    args = parser.parse_args(argv)
    if args.num_proc < 1 or args.epochs < 1 or (args.batch_size is not None
                                                  and args.batch_size < 1):
        parser.error("--num-proc, --epochs and --batch-size must be >= 1")
    for item in args.conf:
        if "=" not in item:
            parser.error(f"--conf {item!r}: give KEY=VALUE")
    return args


def train(args, x_test, y_test, called_at):
    """One rank's training; returns (test accuracy, parameter digest, steps
    an epoch, epoch seconds, seconds from the driver's call to the end of the
    first allreduce)."""
    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    import hvdmx as hvd
    import hvdmx.spark

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    ctx = mx.cpu(hvd.local_rank())
    dataset = hvdmx.spark.rank_dataset("image", "label")
    # The ranks' shares differ by a few rows: train on the smallest share's
    # count everywhere (the same steps on every rank).
    smallest = int(hvd.allreduce(mx.nd.array([len(dataset)], dtype="int64"), op=hvd.Min,
                                 name="spark_digits.share").asnumpy()[0])
    first_allreduce = time.time() - called_at
    batch_size = args.batch_size or mnist_gluon.default_batch_size(smallest)
    steps = smallest // batch_size
    if steps == 0:
        raise ValueError(f"the smallest rank's share, {smallest} rows, is less than one batch "
                         f"of {batch_size}; use a smaller --batch-size or fewer ranks")
    mx.random.seed(args.seed + rank)
    np.random.seed(args.seed * 1000 + rank)  # the DataLoader's shuffling
    loader = gluon.data.DataLoader(dataset.transform(
        lambda image, label: (image.reshape(1, 8, 8).astype("float32"),
                              np.float32(label))),
        batch_size=batch_size, shuffle=True, last_batch="discard")
    net = mnist_gluon.build_net(8)
    net.initialize(mx.init.Xavier(magnitude=2.24), ctx=ctx)
    net.hybridize()
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    rank_lr = args.lr * batch_size / 32
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": rank_lr * size,
                                      "momentum": args.momentum})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    warmup_steps = round(args.warmup_epochs * steps)
    epoch_seconds = []
    for epoch in range(args.epochs):
        tic = time.time()
        for nbatch, (data, label) in enumerate(loader):
            if nbatch == steps:
                break
            trainer.set_learning_rate(mnist_gluon.warmup_lr(epoch * steps + nbatch,
                                                            warmup_steps, rank_lr, size))
            data, label = data.as_in_context(ctx), label.as_in_context(ctx)
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(batch_size)
        mx.nd.waitall()
        epoch_seconds.append(time.time() - tic)
        if rank == 0:
            print(f"epoch {epoch}: {steps} steps of {batch_size} x {size}, "
                  f"{epoch_seconds[-1]:.3f} s", flush=True)
    correct, total = mnist_gluon.evaluate(net, x_test[rank::size], y_test[rank::size], 256,
                                          ctx)
    counts = hvd.allreduce(mx.nd.array([correct, total], dtype="int64"), op=hvd.Sum,
                           name="spark_digits.test_counts").asnumpy()
    mnist_gluon.check_replicas(net, rank, "spark_digits.param_digest")
    return (float(counts[0] / counts[1]), mnist_gluon.parameter_digest(net), steps,
            epoch_seconds, first_allreduce)


def digits_frame(spark, seed):
    """(the training digits as a DataFrame of image: array<float> (64 values)
    and label: int, the test images and labels as arrays)."""
    (x_train, y_train), (x_test, y_test) = mnist_gluon.load_digits(seed)
    rows = [(image.reshape(-1).tolist(), int(label)) for image, label in zip(x_train, y_train)]
    frame = spark.createDataFrame(rows, "image array<float>, label int")
    return frame, x_test, y_test


def main(argv=None):
    args = parse_args(argv)
    from pyspark.sql import SparkSession

    import hvdmx.spark

    builder = SparkSession.builder.appName("hvdmx spark_digits")
    if args.master or SparkSession.getActiveSession() is None:
        builder = builder.master(args.master or f"local[{args.num_proc}]")
    for item in args.conf:
        name, _, value = item.partition("=")
        builder = builder.config(name, value)
    spark = builder.getOrCreate()
    frame, x_test, y_test = digits_frame(spark, args.seed)
    called_at = time.time()
    results = hvdmx.spark.run(train, args=(args, x_test, y_test, called_at),
                              num_proc=args.num_proc, start_timeout=args.start_timeout,
                              data=frame)
    accuracy, _, steps, epoch_seconds, first = results[0]
    digests = {digest for _, digest, _, _, _ in results}
    print(f"test accuracy {accuracy:.4f} after {args.epochs} epochs of {steps} steps on "
          f"{args.num_proc} ranks")
    print(f"first allreduce {first:.2f} s after hvdmx.spark.run; epoch seconds (rank 0) "
          + " ".join(f"{s:.3f}" for s in epoch_seconds))
    if len(digests) != 1:
        print(f"parameters differ between ranks: digests {sorted(digests)}", file=sys.stderr)
        return 1
    print(f"parameters bitwise identical on all {args.num_proc} ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
