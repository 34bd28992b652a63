"""The speed benchmark's torch rows (the [bench] extra): the same tanh CNN in torch, a
non-private step and Opacus DP-SGD on the same batches as the JAX rows."""

from __future__ import annotations


import numpy as np

from benchmarks import interleave
from benchmarks.common import fixed_size_batches



def make_torch_tanh_cnn(num_classes: int = 10, center_inputs: bool = True):
    """dpbench.models.TanhCNN in torch (NCHW), layer for layer: conv 16@8x8 stride 2 'SAME'
    (padding 3 on 28x28), tanh, max-pool 2 stride 1, conv 32@4x4 stride 2 'VALID', tanh,
    max-pool 2 stride 1, dense 512 -> 32, tanh, dense 32 -> classes; 26,010 parameters."""
    import torch
    from torch import nn
    import torch.nn.functional as F

    class TorchTanhCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv0 = nn.Conv2d(1, 16, 8, stride=2, padding=3)
            self.conv1 = nn.Conv2d(16, 32, 4, stride=2)
            self.fc0 = nn.Linear(32 * 4 * 4, 32)
            self.fc1 = nn.Linear(32, num_classes)

        def forward(self, x):
            if center_inputs:
                x = 2.0 * x - 1.0
            x = F.max_pool2d(torch.tanh(self.conv0(x)), 2, 1)
            x = F.max_pool2d(torch.tanh(self.conv1(x)), 2, 1)
            x = torch.tanh(self.fc0(x.flatten(1)))
            return self.fc1(x)

    return TorchTanhCNN()


def _torch_setup(spec: dict):
    import torch

    from dpbench import data, sampling

    torch.set_num_threads(int(spec["torch_threads"]))
    torch.manual_seed(0)
    dataset = data.load_dataset(**spec["dataset_kwargs"])
    model = make_torch_tanh_cnn(dataset.num_classes, spec["model"]["center_inputs"])
    hyper = spec["optimizer"]
    if hyper["optimizer"] == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=hyper["learning_rate"])
    else:
        momentum = hyper["momentum"] if hyper["optimizer"] == "momentum" else 0.0
        optimizer = torch.optim.SGD(model.parameters(), lr=hyper["learning_rate"],
                                    momentum=momentum,
                                    nesterov=bool(hyper["nesterov"]) and momentum > 0)
    n = len(dataset.train)
    seeds = np.random.SeedSequence(spec["seed"]).generate_state(3)
    sampler = sampling.PoissonSampler(n, spec["batch_size"], seed=int(seeds[2]),
                                      pad_multiple=spec["micro_batch_size"])
    return torch, dataset, model, optimizer, sampler, seeds


def _torch_batch(torch, dataset, idx):
    """NHWC float32 images -> a torch NCHW tensor with standard (NCHW-contiguous) strides.

    Not np.ascontiguousarray(x.transpose(0, 3, 1, 2)): with one channel numpy calls that view
    contiguous already and keeps its strides, torch then sees a channels_last tensor, the convs
    run channels_last, and Opacus's unfold-based conv grad sampler (hooks, ghost), which assumes
    NCHW strides, returns wrong per-sample gradients.
    """
    x = dataset.train.images[idx]
    images = np.empty((x.shape[0], x.shape[3], x.shape[1], x.shape[2]), np.float32)
    images[...] = x.transpose(0, 3, 1, 2)
    return (torch.from_numpy(images),
            torch.from_numpy(dataset.train.labels[idx].astype(np.int64)))


def _torch_train_step(model, optimizer, criterion, holder: dict):
    """One torch training step on (images, labels); the loss lands in holder['loss']."""
    model.train()

    def run_step(batch):
        images, labels = batch
        optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()
        holder["loss"] = loss

    return run_step


def worker_torch_nonprivate(spec: dict) -> dict:
    torch, dataset, model, optimizer, _, seeds = _torch_setup(spec)
    criterion = torch.nn.CrossEntropyLoss()
    n, b = len(dataset.train), spec["batch_size"]
    indices = fixed_size_batches(n, b, int(seeds[2]), spec["warmup"] + spec["steps"])
    holder = {}
    run_step = _torch_train_step(model, optimizer, criterion, holder)

    timing = interleave.timed_loop(spec["steps"], spec["warmup"],
                         lambda t: _torch_batch(torch, dataset, indices[t]), run_step)
    return dict(timing, dataset_size=n, expected_batch_size=b, padded_batch_size=b,
                final_train_loss=float(holder["loss"]), torch_threads=torch.get_num_threads(),
                param_count=int(sum(p.numel() for p in model.parameters())))


def worker_opacus(spec: dict) -> dict:
    """Opacus DP-SGD (flat clip, Gaussian noise) on the same realized Poisson batches as dpbench:
    the batch is handed to the step directly, as dpbench's is (data already in memory); the
    DataLoader is only what make_private needs to set the sampling rate."""
    torch, dataset, model, optimizer, sampler, _ = _torch_setup(spec)
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    n, b, mode = len(dataset.train), spec["batch_size"], spec["mode"]
    param_count = int(sum(p.numel() for p in model.parameters()))
    loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=b)
    engine = PrivacyEngine()
    made = engine.make_private(
        module=model, optimizer=optimizer, criterion=torch.nn.CrossEntropyLoss(),
        data_loader=loader, noise_multiplier=float(spec["noise_multiplier"]),
        max_grad_norm=float(spec["l2_bound"]), poisson_sampling=True, grad_sample_mode=mode)
    if len(made) == 4:
        model, optimizer, criterion, _ = made
    else:
        model, optimizer, _ = made
        criterion = torch.nn.CrossEntropyLoss()
    samples = [sampler.sample(t) for t in range(spec["warmup"] + spec["steps"])]
    holder = {}
    run_step = _torch_train_step(model, optimizer, criterion, holder)

    timing = interleave.timed_loop(
        spec["steps"], spec["warmup"],
        lambda t: _torch_batch(torch, dataset, samples[t].indices[:samples[t].size]), run_step)
    loss = float(holder["loss"].detach()) if hasattr(holder["loss"], "detach") else float(
        holder["loss"])
    return dict(timing, dataset_size=n, expected_batch_size=b,
                padded_batch_size=None, realized_mean=float(np.mean([s.size for s in samples])),
                opacus_expected_batch_size=getattr(optimizer, "expected_batch_size", None),
                final_train_loss=loss, torch_threads=torch.get_num_threads(),
                param_count=param_count)
