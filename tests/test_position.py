"""Position: where a checkpoint resumes, and what cannot be carried over to another world size."""



def test_a_source_resumed_by_batches_at_another_world_size_is_refused_before_a_step(tmp_path):
    """A DataLoader's batches at another world size hold other samples: a clear error, not a skip."""
    import pytest
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import fitkit
    from fitkit.files import atomic_save

    def make():
        torch.manual_seed(0)
        model = fitkit.Model(torch.nn.Linear(2, 1), device="cpu")
        model.compile(optimizer="sgd", loss="mse")
        return model

    loader = DataLoader(TensorDataset(torch.randn(12, 2), torch.randn(12, 1)), batch_size=4)
    def save_at_1(b, logs):
        if b == 1:
            model.save_checkpoint(tmp_path / "c.pt")

    save = fitkit.callbacks.LambdaCallback(on_train_batch_end=save_at_1)
    model = make()
    model.fit(loader, epochs=1, verbose=0, callbacks=[save])  # inside epoch 1, 2 batches done, on 1 process
    state = torch.load(tmp_path / "c.pt", weights_only=True)
    assert (state["step_in_epoch"], state["world_size"]) == (2, 1)
    atomic_save({**state, "world_size": 2}, tmp_path / "c.pt")  # as if taken on 2 processes
    resumed = make()
    start = resumed.load_checkpoint(tmp_path / "c.pt")
    before = [p.detach().clone() for p in resumed.module.parameters()]
    with pytest.raises(ValueError, match=r"on 2 process\(es\), and this fit runs on 1\. This source \(DataLoader\) "
                       r"resumes by batches"):  # fmt: skip
        resumed.fit(loader, epochs=1, initial_epoch=start, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, resumed.module.parameters(), strict=True))
