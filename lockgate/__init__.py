"""lockgate: an inference server for classic models and causal language models."""

__version__ = "0.1.0"
