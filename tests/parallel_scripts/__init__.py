"""Scripts that run under torchrun (``fixtures.torchrun``), each a module of this package."""
