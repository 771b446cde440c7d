"""CPU torch tensors in, torch tensors out.

The compiled calls read a CPU tensor through the numpy view of its memory
(no copy for a contiguous float32 tensor; float16, float64 and bfloat16 are
converted, bfloat16 exactly from its bits). A call given a tensor returns
tensors: the arrays it made are wrapped by ``torch.from_numpy`` (no copy).
torch stays optional: it is imported only when a tensor arrives, which
means the caller has imported it already.
"""
import functools

import numpy as np


_is_tensor_type = {}  # type -> whether it is a torch.Tensor (a decode step asks ~100 times)


def is_tensor(x):
    """Whether x is a torch.Tensor, without importing torch."""
    t = type(x)
    known = _is_tensor_type.get(t)
    if known is None:
        known = _is_tensor_type[t] = t.__module__.startswith("torch") and any(
            c.__name__ == "Tensor" for c in t.__mro__)
    return known


def _as_torch(x, torch):
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    if isinstance(x, tuple):
        return tuple(_as_torch(v, torch) for v in x)
    return x


def returns_torch_for_torch(fn):
    """fn, whose array results become tensors when any argument is one."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if any(is_tensor(a) for a in args) or any(is_tensor(v) for v in kwargs.values()):
            import torch

            return _as_torch(out, torch)
        return out

    return wrapper


def wrap_methods(cls, names):
    for name in names:
        setattr(cls, name, returns_torch_for_torch(getattr(cls, name)))
