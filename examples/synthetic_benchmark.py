"""Training throughput of a Gluon model-zoo network on synthetic data with hvdmx.

    mpiexec -n 2 python examples/synthetic_benchmark.py                       # resnet50_v1, 224x224
    mpiexec -n 2 python examples/synthetic_benchmark.py --model resnet18_v1 --image-size 64

Every rank trains the model on one random batch, the same batch at every step,
with DistributedTrainer (SGD); parameters start from rank 0's values
(broadcast_parameters). After --num-warmup-batches batches, it times
--num-iters iterations of --num-batches-per-iter batches each. Rank 0 prints
the images per second of each iteration (the mean over the ranks, and the
job's total) and at the end the mean and a 95% interval (1.96 standard
deviations over the iterations), per rank and in total.

Gradients are allreduced while the backward pass is still running: each
allreduce starts as soon as its gradient is written. --no-overlap waits for
the whole backward pass first, to show what that overlap is worth, and times
the two phases of a batch (forward+backward; allreduce+update) separately.
--sync-only exchanges no gradients at all (each rank updates from its own) but
keeps the ranks in step after every batch: it measures what training in
lockstep costs on a machine, apart from moving the gradients.
--horovod runs the same program with `import horovod.mxnet as hvd` instead
of hvdmx, for comparison, from an environment that has Horovod (see
benchmarks/horovod/build.sh).
"""
import argparse
import importlib
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon.model_zoo import vision


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Measure the training throughput (images/sec) of a Gluon model-zoo "
                    "network on synthetic data with hvdmx (data parallel; run it under "
                    "mpiexec).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="resnet50_v1",
                        help="a name that mx.gluon.model_zoo.vision.get_model knows, e.g. "
                             "resnet18_v1, resnet50_v1, mobilenet1.0, vgg16")
    parser.add_argument("--image-size", type=int, default=224,
                        help="height and width of the synthetic images (3 channels)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank and batch")
    parser.add_argument("--num-classes", type=int, default=1000,
                        help="classes of the model's output layer")
    parser.add_argument("--num-warmup-batches", type=int, default=10,
                        help="batches before the timing starts")
    parser.add_argument("--num-batches-per-iter", type=int, default=10,
                        help="batches per timed iteration")
    parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send gradients as float16 (the same as --compression fp16)")
    parser.add_argument("--compression", choices=["none", "fp16", "onebit"], default="none",
                        help="how gradients travel: float32, float16, or one bit per value "
                             "with a scale and error feedback (hvd.Compression.onebit; "
                             "hvdmx only)")
    parser.add_argument("--local-sgd-steps", type=int, default=1, metavar="H",
                        help="local SGD: no gradient is sent; the parameters are averaged "
                             "every H steps (hvdmx only)")
    parser.add_argument("--hierarchical-local-sgd", action="store_true",
                        help="with --local-sgd-steps H: average the gradients over each host's "
                             "ranks every step (hvdmx only)")
    parser.add_argument("--easgd-beta", type=float, default=None, metavar="BETA",
                        help="with --local-sgd-steps H: elastic averaging (EASGD) every H "
                             "steps instead of the average (hvdmx only)")
    parser.add_argument("--op", choices=["average", "adasum"], default="average",
                        help="how the gradients are combined: average (learning rate 0.01 x "
                             "ranks) or adasum (Adasum, learning rate 0.01; hvdmx only)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="wait for the whole backward pass before the first allreduce "
                             "starts (no overlap of communication with backward), and "
                             "print the time of each phase")
    parser.add_argument("--sync-only", action="store_true",
                        help="exchange no gradients: each rank updates from its own with a "
                             "plain gluon.Trainer, and the ranks only wait for each other "
                             "after every batch (mx.nd.waitall, then hvd.barrier). What "
                             "training in step costs here, apart from moving the gradients")
    parser.add_argument("--horovod", action="store_true",
                        help="train with horovod.mxnet instead of hvdmx (the same script, "
                             "as a Horovod user would run it), for comparison")
    args = parser.parse_args(argv)
    for name in ("image_size", "batch_size", "num_classes", "num_batches_per_iter",
                 "num_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_warmup_batches < 0:
        parser.error("--num-warmup-batches must be >= 0")
    if args.sync_only and args.horovod:
        parser.error("--sync-only needs hvd.barrier(), which horovod.mxnet does not have: "
                     "give one of --sync-only and --horovod")
    if (args.local_sgd_steps != 1 or args.hierarchical_local_sgd
            or args.easgd_beta is not None) and \
            (args.horovod or args.sync_only or args.compression != "none" or args.fp16_allreduce):
        parser.error("--local-sgd-steps, --hierarchical-local-sgd and --easgd-beta are "
                     "hvdmx's local SGD, which sends no gradients: give them without "
                     "--horovod, --sync-only and compression")
    if args.op == "adasum" and (args.horovod or args.sync_only or args.local_sgd_steps != 1
                                or args.compression == "onebit"):
        parser.error("--op adasum combines the gradients with hvdmx's Adasum (Horovod's MXNet "
                     "binding has none): give it without --horovod, --sync-only, "
                     "--local-sgd-steps and --compression onebit")
    for flag in ("fp16_allreduce", "no_overlap"):
        if args.sync_only and getattr(args, flag):
            parser.error(f"--{flag.replace('_', '-')} is about the gradients' allreduce, "
                         "which --sync-only leaves out: give one of the two")
    return args


def main(argv=None):
    """Runs the benchmark; returns (mean, half width of the 95% interval) of
    the job's total images per second."""
    args = parse_args(argv)
    hvd = importlib.import_module("horovod.mxnet" if args.horovod else "hvdmx")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    ctx = mx.gpu(hvd.local_rank()) if hvd.cuda_built() and mx.context.num_gpus() \
        else mx.cpu(hvd.local_rank())

    def log(message):
        if rank == 0:
            print(message, flush=True)

    try:
        net = vision.get_model(args.model, classes=args.num_classes)
    except ValueError as error:  # an unknown name; the message lists the known ones
        raise SystemExit(f"--model {args.model!r}: {error}") from None
    mx.random.seed(rank)  # different initial values: broadcast_parameters makes them rank 0's
    net.initialize(mx.init.Xavier(rnd_type="gaussian", magnitude=2), ctx=ctx)
    net.hybridize(static_alloc=True, static_shape=True)
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    if args.fp16_allreduce:
        args.compression = "fp16"
    compression = getattr(hvd.Compression, args.compression)
    adasum = args.op == "adasum"
    optimizer_params = {"learning_rate": 0.01 * (1 if adasum else size), "momentum": 0.9}
    if args.sync_only:
        trainer = gluon.Trainer(net.collect_params(), "sgd", optimizer_params, kvstore=None)
    else:
        trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", optimizer_params,
                                         compression=compression,
                                         local_sgd_steps=args.local_sgd_steps,
                                         hierarchical_local_sgd=args.hierarchical_local_sgd,
                                         easgd_beta=args.easgd_beta,
                                         **({"op": hvd.Adasum} if adasum else {}))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    data = mx.nd.random.uniform(-1, 1, shape=(args.batch_size, 3, args.image_size,
                                              args.image_size), ctx=ctx)
    label = mx.nd.array(np.random.RandomState(rank).randint(0, args.num_classes,
                                                            args.batch_size), ctx=ctx)

    # Seconds in the two phases of the timed batches: --no-overlap: forward+backward,
    # then step(); --sync-only: forward+backward+step(), then waiting in the barrier.
    phases = np.zeros(2)

    def train_batches(count):
        for _ in range(count):
            start = time.perf_counter()
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            if args.no_overlap:
                mx.nd.waitall()
                backward_done = time.perf_counter()
                trainer.step(args.batch_size)
                mx.nd.waitall()
                phases[:] += (backward_done - start, time.perf_counter() - backward_done)
            else:
                trainer.step(args.batch_size)
            if args.sync_only:
                mx.nd.waitall()
                computed = time.perf_counter()
                hvd.barrier()
                phases[:] += (computed - start, time.perf_counter() - computed)
        mx.nd.waitall()

    log(f"Model: {args.model}, image size {args.image_size}, batch size {args.batch_size} per "
        f"rank, {size} rank(s) on {ctx.device_type}, " + (
            "gradients: not exchanged (--sync-only: the ranks wait for each other after "
            "every batch)" if args.sync_only else
            f"compression: {args.compression}, overlap with "
            f"backward: {'no' if args.no_overlap else 'yes'}" + (
                f", local SGD every {args.local_sgd_steps} steps"
                f"{' (hierarchical)' if args.hierarchical_local_sgd else ''}"
                f"{f' (EASGD, beta {args.easgd_beta})' if args.easgd_beta else ''}"
                if args.local_sgd_steps > 1 else "")))
    log(f"Running {args.num_warmup_batches} warm-up batches...")
    train_batches(args.num_warmup_batches)

    log("Running benchmark...")
    phases[:] = 0
    totals = []
    for i in range(args.num_iters):
        start = time.perf_counter()
        train_batches(args.num_batches_per_iter)
        seconds = time.perf_counter() - start
        mine = args.batch_size * args.num_batches_per_iter / seconds
        # Outside the timed part: the job's total, from every rank's own rate.
        total = float(hvd.allreduce(mx.nd.array([mine], dtype="float64"), op=hvd.Sum,
                                    name="benchmark.img_sec").asnumpy()[0])
        totals.append(total)
        log(f"Iter #{i}: {total / size:.1f} img/sec per rank, {total:.1f} in total "
            f"({1000 * seconds / args.num_batches_per_iter:.1f} ms per batch on rank 0)")

    num_params = sum(int(np.prod(p.shape)) for p in net.collect_params().values()
                     if p.grad_req != "null")
    log(f"{num_params / 1e6:.2f} M trained parameters: {num_params * 4 / 1e6:.1f} MB of "
        f"float32 gradients {'kept by each rank' if args.sync_only else 'allreduced'} "
        "per batch")
    batches = args.num_iters * args.num_batches_per_iter
    if args.no_overlap:
        log(f"Per batch on rank 0: forward+backward {1000 * phases[0] / batches:.1f} ms, then "
            f"allreduce+update {1000 * phases[1] / batches:.1f} ms")
    if args.sync_only:
        log(f"Per batch on rank 0: forward+backward+update {1000 * phases[0] / batches:.1f} "
            f"ms, then waiting for the other ranks {1000 * phases[1] / batches:.1f} ms")
    totals = np.array(totals)
    mean, conf = totals.mean(), 1.96 * totals.std()
    log(f"Img/sec per rank: {mean / size:.1f} +-{conf / size:.1f}")
    log(f"Total img/sec on {size} rank(s): {mean:.1f} +-{conf:.1f}")
    return float(mean), float(conf)


if __name__ == "__main__":
    main()
