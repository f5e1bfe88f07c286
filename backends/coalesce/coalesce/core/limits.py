"""Bounds on what one request may cost, checked before any work is done on it."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from coalesce.core.errors import InvalidInputError


def request_bytes(tensors: Mapping[str, np.ndarray]) -> int:
    """Bytes a request's inputs carry: ``nbytes`` of each tensor; of a ``TYPE_STRING`` one, its items' lengths.

    An object array's ``nbytes`` counts only its pointers; what a client sent, and what
    the backend would copy and tokenise, is the items themselves.
    """
    total = 0
    for array in tensors.values():
        if array.dtype != np.object_:
            total += int(array.nbytes)
            continue
        for item in array.flat:
            if isinstance(item, str):
                total += len(item)  # characters: a lower bound of its UTF-8 bytes, without encoding it
            elif isinstance(item, bytes | bytearray | np.bytes_):
                total += len(item)
            else:
                total += 8
    return total


def oversize_error(size: int, limit: int) -> InvalidInputError:
    """The error of a request of ``size`` bytes over ``limit``: it names both and the parameter."""
    return InvalidInputError(f"request is {size} bytes, over the model's limit of {limit} bytes per request "
                             "(parameter 'max_request_bytes'); send fewer or shorter rows per request")


def check_request_bytes(tensors: Mapping[str, np.ndarray], limit: int) -> InvalidInputError | None:
    """The error a request over ``limit`` bytes gets (0: no limit), else None."""
    size = request_bytes(tensors) if limit > 0 else 0
    return oversize_error(size, limit) if size > limit > 0 else None
