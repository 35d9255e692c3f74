"""fitkit inside Ray Train's ``TorchTrainer`` on a local Ray cluster of 2 CPUs, 2 workers.

Run as ``python _ray_scenario.py OUT``: the workers train 4 epochs with ``RayReport``; rank 1
dies at the start of epoch 2 on the first attempt, Ray restarts the workers (``max_failures=1``)
and fitkit resumes from the checkpoint Ray gives back (epoch 1's). Each rank writes what it saw
to ``OUT/rank{r}.pt`` (and, first, :func:`partial_reports`), the driver Ray's result to
``OUT/result.pt``. :func:`reference` is the
same training on one process with the global batch.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch

EPOCHS, GLOBAL_BATCH = 4, 8


def _data_and_net():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
    g = torch.Generator().manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return x, y, net


def _model(net, **kwargs):
    import fitkit

    model = fitkit.Model(net, device="cpu", **kwargs)
    model.compile(optimizer=functools.partial(torch.optim.Adam, lr=0.01), loss="mse")
    return model


def reference() -> dict:
    """One process, batches of 8, the same seeds: the uninterrupted run."""
    x, y, net = _data_and_net()
    torch.manual_seed(0)  # the epochs' shuffles
    h = _model(net).fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=True, verbose=0)
    return {"params": [p.detach() for p in net.parameters()], "loss": h.history["loss"]}


def train_loop(config):
    import ray.train

    import fitkit
    from fitkit.distributed import rank, world_size

    out = config["out"]
    x, y, net = _data_and_net()
    try:  # Ray started the process group: a timeout of fitkit's own cannot apply
        _model(net, timeout=5)
        refused = ""
    except ValueError as e:
        refused = str(e)
    given = ray.train.get_checkpoint()
    if given is None:  # the first attempt
        partial_reports(out)
    model = _model(net)
    torch.manual_seed(0)
    marker = os.path.join(out, "crashed")

    class Crash(fitkit.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2 and rank() == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                # Ray's controller takes the workers' reports when it polls them: give it time to
                # take epoch 1's before the worker dies (one dying at once may take it along).
                time.sleep(3)
                os._exit(1)

    epochs_run: list[int] = []
    seen = fitkit.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: epochs_run.append(epoch))
    h = model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH // world_size(),
        epochs=EPOCHS,
        shuffle=True,
        verbose=0,
        callbacks=[fitkit.callbacks.RayReport(), Crash(), seen],
    )
    torch.save(
        {
            "params": [p.detach() for p in net.parameters()],
            "loss": h.history["loss"],
            "epochs_run": epochs_run,
            "world": world_size(),
            "refused": refused,
            "given": None if given is None else given.path,
        },
        os.path.join(out, f"rank{rank()}.pt"),
    )


def partial_reports(out: str) -> None:
    """3 epochs of 5 steps with ``RayReport(save_freq=4, checkpoint=False)`` on a fresh model, before
    the main fit of the first attempt: each rank records the ``(epoch, global_step)`` of every report
    it makes to Ray (4, 8, 12, and 15, the run's last step)."""
    import ray.train

    import fitkit
    from fitkit.distributed import rank, world_size

    reported, plain = [], ray.train.report

    def recording(metrics, *args, **kwargs):
        reported.append((metrics["epoch"], metrics["global_step"]))
        return plain(metrics, *args, **kwargs)

    x, y, net = _data_and_net()
    torch.manual_seed(0)
    ray.train.report = recording
    try:
        _model(net).fit(
            x,
            y,
            batch_size=GLOBAL_BATCH // world_size(),
            epochs=3,
            shuffle=True,
            verbose=0,
            callbacks=[fitkit.callbacks.RayReport(save_freq=4, checkpoint=False)],
        )
    finally:
        ray.train.report = plain
    torch.save(reported, os.path.join(out, f"partial{rank()}.pt"))


def main(out: str) -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster of this process only
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"out": out},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(
                storage_path=os.path.join(out, "storage"), name="fitkit", failure_config=FailureConfig(max_failures=1)
            ),
        )
        result = trainer.fit()
        with result.checkpoint.as_directory() as folder:
            files = sorted(os.listdir(folder))
        torch.save(
            {
                "metrics": dict(result.metrics),
                "files": files,
                "reports": [(c.path, dict(m)) for c, m in result.best_checkpoints],
            },
            os.path.join(out, "result.pt"),
        )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
