"""Set up each executed tutorial (sphinx-gallery's ``reset_modules``): the doctest setup's rules."""

import os


def reset(gallery_conf, fname, when=None):
    """Seeded, one CPU thread (numbers that do not depend on the core count), on the CPU."""
    import torch

    os.environ.setdefault("FITKIT_DEVICE", "cpu")
    torch.set_num_threads(1)
    torch.manual_seed(0)
