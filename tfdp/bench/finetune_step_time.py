"""Step time of parameter-efficient private fine-tuning against full fine-tuning.

Times one private step (`tfdp.dp.PrivateTrainStep`: accumulate one physical
batch, then apply) of the same model (a ViT, or with `--model=convnet` the
default run's small convnet at 28 px) under full fine-tuning, LoRA at each rank
asked for, and BiTFiT, for each clipping method. The variants run in
interleaved rounds (every variant once per round, in turn), so that a slow
spell of a shared machine hits all of them; each round times `steps` steps
after a warm-up, and the figure is the median over all timed steps.

    python -m tfdp.bench.finetune_step_time --rounds 4 --steps 5

The defaults are docs/FINETUNING.md's: 32 px, patch 4, width 64, depth 4,
4 heads, batch 64, methods bk and mixed, LoRA r = 4 and 8.

    python -m tfdp.bench.finetune_step_time --model=convnet --batch 256
"""

import argparse
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tfdp import dp
from tfdp.secret_key import SecretKey


def per_example_xent(y, logits):
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def build_model(args):
    keras.utils.set_random_seed(0)
    if args.model == "convnet":
        return tfdp.models.small_convnet(10, (args.size, args.size, args.channels))
    return tfdp.models.vit(10, (args.size, args.size, args.channels), patch_size=args.patch,
                           width=args.width, depth=args.depth, num_heads=args.heads)


def make_variant(name, args, method):
    """(model, step, trainable parameters) of a variant: "full", "last_layer", "bitfit", "lora<r>"."""
    model = build_model(args)
    if name == "last_layer":
        trainable = tfdp.finetune.last_layer(model).trainable_params
    elif name == "bitfit":
        trainable = tfdp.finetune.bitfit(model).trainable_params
    elif name.startswith("lora"):
        trainable = tfdp.finetune.lora(model, int(name[4:])).trainable_params
    else:
        trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    step = dp.PrivateTrainStep(
        model, keras.optimizers.SGD(0.1), per_example_xent, l2_norm_clip=1.0,
        noise_multiplier=1.0, expected_batch_size=args.batch, method=method,
        secret_key=SecretKey.insecure_from_seed(0))
    return model, step, trainable


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit", choices=("vit", "convnet"))
    parser.add_argument("--size", type=int, default=None,
                        help="image size; default 32 for the ViT, 28 for the convnet")
    parser.add_argument("--patch", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--methods", default="bk,mixed")
    parser.add_argument("--variants", default="full,lora4,lora8,bitfit",
                        help="of full, last_layer, bitfit, lora<r>")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    args.size = args.size or (28 if args.model == "convnet" else 32)
    args.channels = 1 if args.model == "convnet" else 3
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(args.batch, args.size, args.size, args.channels)), tf.float32)
    y = tf.constant(rng.integers(0, 10, args.batch))
    w = tf.ones([args.batch])
    runs = {}
    for method in args.methods.split(","):
        for name in args.variants.split(","):
            model, step, trainable = make_variant(name, args, method)
            for _ in range(2):  # Warm-up: tracing and first-call allocations.
                step.accumulate(x, y, w)
                step.apply()
            runs[(method, name)] = (step, trainable, [])
    for _ in range(args.rounds):
        for (method, name), (step, _, times) in runs.items():
            for _ in range(args.steps):
                start = time.perf_counter()
                step.accumulate(x, y, w)
                step.apply()
                times.append(time.perf_counter() - start)
    what = (f"small convnet {args.size}px" if args.model == "convnet" else
            f"ViT {args.size}px patch {args.patch} width {args.width} depth {args.depth} "
            f"heads {args.heads}")
    print(f"{what}, batch {args.batch}; medians of {args.rounds} interleaved rounds of "
          f"{args.steps} steps")
    print(f"{'method':<8} {'variant':<8} {'trainable':>10} {'ms/step':>9} {'vs full':>8}")
    for (method, name), (_, trainable, times) in runs.items():
        median = statistics.median(times) * 1e3
        full = statistics.median(runs[(method, "full")][2]) * 1e3 if (
            (method, "full") in runs) else float("nan")
        print(f"{method:<8} {name:<8} {trainable:>10,} {median:>9.1f} {median / full:>7.2f}x")


if __name__ == "__main__":
    main()
