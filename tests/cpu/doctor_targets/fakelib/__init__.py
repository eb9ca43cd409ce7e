"""A fake kernel library for the doctor's catalogue: one public op per thing Dynamo cannot trace.

Re-exports its ops at the top level, as libraries do, so the doctor should name them ``fakelib.<op>``.
"""

from .loaders import config, scale
from .ops import add_bias, labs_scale, logged_gelu, lookup, noise, quiet, shell_gelu, sized, timed

__all__ = ["config", "scale", "add_bias", "labs_scale", "logged_gelu", "lookup", "noise", "quiet", "shell_gelu",
           "sized", "timed"]
